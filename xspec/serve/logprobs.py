"""Logprobs in OpenAI's two response shapes.

Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``, one entry per token; ``top_logprobs`` maps token text to logprob, the
chosen token always included (as vLLM), and an echoed prompt's first token has null
``token_logprobs`` and ``top_logprobs``. Chat: ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's text is its own decoding; ``bytes`` its UTF-8 bytes. A logprob of -inf (a
token outside what the request samples from, ``logprobs_mode: processed``) is written
as -9999.0, as OpenAI's API does, so the body stays strict JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xspec.sampling import TokenLogprob

Decode = Callable[[list[int]], str]
NEG_INF = -9999.0  # what OpenAI writes for a token of zero probability


def _value(x: float) -> float:
    return x if x > NEG_INF else NEG_INF


class CompletionLogprobs:
    """The legacy logprobs of one choice, built chunk by chunk (streaming) or at once;
    ``text_offset`` counts on from ``offset`` (the echoed prompt's, or 0)."""

    def __init__(self, decode: Decode, offset: int = 0) -> None:
        self.decode, self.offset = decode, offset

    def block(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
        """The logprobs object of the tokens ``ids`` (their entries; None: no logprob,
        an echoed prompt's first token)."""
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for t, e in zip(ids, entries):
            text = self.decode([t])
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_value(e.logprob))
            top = {self.decode([i]): _value(v) for i, v in e.top}
            top.setdefault(text, _value(e.logprob))
            out["top_logprobs"].append(top)
        return out


def _entry(decode: Decode, token: int, logprob: float) -> dict:
    text = decode([token])
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(decode: Decode, entries: Sequence[TokenLogprob]) -> dict:
    """The chat logprobs object of these tokens' entries."""
    return {
        "content": [
            {
                **_entry(decode, e.token, e.logprob),
                "top_logprobs": [_entry(decode, i, v) for i, v in e.top],
            }
            for e in entries
        ]
    }
