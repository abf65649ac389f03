"""The reasoning splitter: a whole reply and the same reply streamed in every chunking
give the same reasoning and content; no part of a tag is released as text."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from xspec.chat import DEEPSEEK_V4, PLAIN_DSML, PLAIN_HERMES, chat_prompt
from xspec.chat.reasoning import ReasoningStream, Split, reasoning_opened, split_reasoning

REPLIES = [
    ('plan it</think>{"a": 1}', Split("plan it", '{"a": 1}')),
    ("<think>\nplan</think>\n\nhi", Split("\nplan", "\n\nhi")),  # Qwen3 writes <think>
    ("\n<think>x</think>", Split("x", "")),
    ("still thinking when cut", Split("still thinking when cut", None)),
    ("a </thin", Split("a </thin", None)),  # a tag never completed is text
    ("<thi", Split("<thi", None)),
    ("a < b </think>c</think>d", Split("a < b ", "c</think>d")),  # the first end tag ends it
    ("</think>", Split("", "")),
    ("", Split("", None)),
]


@pytest.mark.parametrize(("text", "expected"), REPLIES)
def test_whole_replies_split(text: str, expected: Split) -> None:
    assert split_reasoning(text) == expected


def _streamed(pieces: list[str]) -> tuple[list[str], list[str]]:
    stream, reasoning, content = ReasoningStream(), [], []
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return [*reasoning, r], [*content, c]


@pytest.mark.parametrize(("text", "expected"), REPLIES)
def test_every_chunking_adds_up_to_the_whole_split(text: str, expected: Split) -> None:
    for cuts in itertools.chain.from_iterable(
        itertools.combinations(range(1, len(text)), k) for k in range(min(3, len(text)))
    ):
        bounds = [0, *cuts, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        reasoning, content = _streamed(pieces)
        assert "".join(reasoning) == expected.reasoning, pieces
        assert "".join(content) == (expected.content or ""), pieces
        # nothing released as reasoning holds a tag or a piece of the end tag at its end
        for r in reasoning[:-1]:
            assert "</think>" not in r and "<think>" not in r, pieces


def test_a_tag_split_across_chunks_is_held_back() -> None:
    stream = ReasoningStream()
    assert stream.feed("<th") == ("", "")  # may be the start tag
    assert stream.feed("ink>let me see </") == ("let me see ", "")  # "</" may start the end
    assert stream.feed("thi") == ("", "")
    assert stream.feed("nk>{") == ("", "{") and stream.closed
    assert stream.feed('"a"}') == ("", '"a"}')
    assert stream.finish() == ("", "")
    cut = ReasoningStream()
    assert cut.feed("x </thi") == ("x ", "")
    assert cut.finish() == ("</thi", "") and not cut.closed  # cut by max_tokens: reasoning


def test_where_a_thinking_reply_starts(tmp_path: Path) -> None:
    """DeepSeek-V4's thinking prompt opens <think>: its reply starts inside the reasoning;
    Qwen3's does not (the model writes <think>); the presets follow their family."""
    from tests.test_chat import qwen3_checkpoint

    messages = [{"role": "user", "content": "Hi"}]
    on = {"thinking": True, "enable_thinking": True}
    dsv4 = chat_prompt(messages, template=DEEPSEEK_V4, options=on)
    assert dsv4.endswith("<think>") and reasoning_opened(DEEPSEEK_V4, dsv4)
    qwen3 = qwen3_checkpoint(tmp_path)
    assert not reasoning_opened(qwen3, chat_prompt(messages, template=qwen3, options=on))
    assert reasoning_opened(PLAIN_DSML, "Hi") and not reasoning_opened(PLAIN_HERMES, "Hi")
