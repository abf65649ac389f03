"""Text deltas for a stream of token ids: what can be sent now, and the rest at the end.

Each step's new text is the decoded output's growth since the last delta. Two things
are held back until they are certain: a trailing U+FFFD (the first bytes of a character
that the next token completes) and, with stop strings, the last ``longest stop - 1``
characters (they could be the start of a stop string the next token completes; the
engine cuts the output before a matched stop string, and that text must never have been
sent). The concatenated deltas equal the final text.
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode = decode
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def push(self, token_ids: list[int]) -> str:
        """The text that became certain with these new tokens."""
        self.token_ids += token_ids
        text = self.decode(self.token_ids)
        safe = text[: len(text) - self.hold] if self.hold else text
        safe = safe.rstrip("\ufffd")
        return self._send(safe)

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the engine's text: cut before a stop string)."""
        return self._send(final_text)

    def _send(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new (or a tokenizer that rewrote the past: never retract)
        out, self.sent = text[len(self.sent) :], text
        return out
