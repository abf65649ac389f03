"""Text deltas for a stream of token ids: what can be sent now, and the rest at the end.

Each step's new text is the decoded output's growth since the last delta. Two things
are held back until they are certain: an incomplete character (the first bytes of a
character that a later token completes: its text ends in U+FFFD) and, with stop strings,
the last ``longest stop - 1`` characters (they could be the start of a stop string the
next token completes; the engine cuts the output before a matched stop string, and that
text must never have been sent). The concatenated deltas equal the final text.

Incremental: each push decodes a short window, the ids of the last completed push as
context plus the new ones, and takes the window's text past its context's text (as
vLLM's incremental detokenizer does: the context keeps a tokenizer's first-token rules,
such as a SentencePiece leading space, out of the new text). Decoding the whole output on
every step costs O(n) per step and O(n^2) per request, which for outputs of thousands of
tokens would make the server's thread the bottleneck.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode = decode
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # the text of token_ids[:_read]
        self._context = 0  # token_ids[_context:_read]: the window's context
        self._read = 0
        self.sent = ""

    def push(self, token_ids: list[int]) -> str:
        """The text that became certain with these new tokens."""
        self.token_ids += token_ids
        self._advance()
        safe = self.text[: len(self.text) - self.hold] if self.hold else self.text
        return self._send(safe)

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the engine's text: cut before a stop string)."""
        return self._send(final_text)

    def _advance(self) -> None:
        ids, start, read = self.token_ids, self._context, self._read
        context = self.decode(ids[start:read]) if read > start else ""
        window = self.decode(ids[start:])
        if window.endswith(REPLACEMENT) or not window.startswith(context):
            return  # a character still incomplete (or the context's text not settled): wait
        self.text += window[len(context) :]
        self._context, self._read = read, len(ids)

    def _send(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new (or a tokenizer that rewrote the past: never retract)
        out, self.sent = text[len(self.sent) :], text
        return out
