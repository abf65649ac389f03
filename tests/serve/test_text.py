"""TextStream: streamed text deltas concatenate to the final text, hold back what is not
certain yet (an incomplete character, a possible stop string) and decode a bounded window
per push, not the whole output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from xspec.serve.text import TextStream
from xspec.tokenizer import ByteTokenizer, HFTokenizer

ASSETS = Path(__file__).resolve().parents[2] / "xspec" / "assets" / "dsv4_tiny"
TEXT = "def f(x):\n    return x * 2  # doubles, naïvely: 2€ → 4€ 🙂\n" * 3


def byte_tok() -> ByteTokenizer:
    return ByteTokenizer(vocab_size=300, bos_id=0, stop_ids=[1])


def hf_tok() -> HFTokenizer:
    return HFTokenizer(ASSETS / "tokenizer.json", bos_id=None, stop_ids=[])


def stream(tok, ids: list[int], sizes: list[int], stop: list[str] | None = None):
    """Push ``ids`` in pieces of ``sizes`` (cycled); the pieces sent and the stream."""
    s, out, i, k = TextStream(tok.decode, stop or []), [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(s.push(ids[i : i + n]))
        i, k = i + n, k + 1
    return out, s


@pytest.mark.parametrize("make", [byte_tok, hf_tok], ids=["bytes", "bpe"])
@pytest.mark.parametrize("sizes", [[1], [2, 1, 3], [5]])
def test_deltas_concatenate_to_the_text(make, sizes: list[int]) -> None:
    tok = make()
    ids = tok.encode(TEXT, special=False)
    pieces, s = stream(tok, ids, sizes)
    final = tok.decode(ids)
    assert final == TEXT
    assert "".join(pieces) + s.finish(final) == final
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    assert "".join(pieces) == final  # everything was certain by the last push


def test_an_incomplete_character_waits_for_its_last_byte() -> None:
    tok = byte_tok()
    ids = tok.encode("a€b")  # € is 3 bytes
    s = TextStream(tok.decode, [])
    assert s.push(ids[:2]) == ""  # "a" + the first byte of €: wait (one window)
    assert s.push(ids[2:3]) == ""
    assert s.push(ids[3:4]) == "a€"
    assert s.push(ids[4:]) == "b"


def test_a_possible_stop_string_is_held_back() -> None:
    tok = byte_tok()
    s = TextStream(tok.decode, ["STOP"])
    assert s.push(tok.encode("hello ST")) == "hello"  # the last 3 could start "STOP"
    assert s.push(tok.encode("x")) == " "  # always the last 3
    assert s.finish("hello STx") == "STx"


def test_each_push_decodes_a_bounded_window() -> None:
    """2000 tokens one at a time: every decode call sees at most a few ids (whole-output
    decoding would be O(n) per step, O(n^2) per request)."""
    tok = hf_tok()
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "(x)", "\n", "    ", "naïve", "€", "🙂"]
    ids = tok.encode(" ".join(rng.choice(words) for _ in range(1500)))[:2000]
    seen: list[int] = []

    def decode(chunk: list[int]) -> str:
        seen.append(len(chunk))
        return tok.decode(chunk)

    s = TextStream(decode, [])
    pieces = [s.push([t]) for t in ids]
    assert "".join(pieces) + s.finish(tok.decode(ids)) == tok.decode(ids)
    assert max(seen) <= 8, max(seen)
