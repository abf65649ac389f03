"""Stop strings: their limits, and a matcher that looks at each token's new text only.

A request may give at most :data:`MAX_STOP_STRINGS` stop strings of at most
:data:`MAX_STOP_CHARS` characters each (``Engine.check`` refuses more: OpenAI takes 4
strings, so a real client stays far inside both). :class:`StopMatcher` keeps a request's
output as decoded text pieces plus a tail of the last ``longest stop - 1`` characters;
each token decodes a window of a few ids (the last settled ids as context, then the new
ones, as ``xspec.serve.text`` and vLLM's incremental detokenizer do) and the stop strings
are searched in ``tail + new text`` only. A token thus costs one search per stop string
in fewer than ``longest stop`` + its own characters, whatever the output's length.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256

REPLACEMENT = "\ufffd"  # what a decoder gives for the first bytes of an unfinished character
# ids a window may hold unsettled (an unfinished character: at most 4 UTF-8 bytes); past
# this the text is taken as it is, so a run of invalid bytes never grows the window
MAX_PENDING_IDS = 8


def stop_problem(stop: object) -> str | None:
    """Why ``stop`` is not a valid list of stop strings (None: it is)."""
    if not isinstance(stop, list):
        return f"stop must be a list of non-empty strings (got {stop!r})"
    if len(stop) > MAX_STOP_STRINGS:
        return f"stop: {len(stop)} stop strings; at most {MAX_STOP_STRINGS} are taken, give fewer"
    if not all(isinstance(x, str) and x for x in stop):
        return f"stop must be a list of non-empty strings (got {stop!r})"
    if long := [x for x in stop if len(x) > MAX_STOP_CHARS]:
        return (
            f"stop: a stop string of {len(long[0])} characters; at most {MAX_STOP_CHARS} "
            "characters each, give shorter ones"
        )
    return None


class StopMatcher:
    """The first of ``stops`` in one request's output, found as its tokens arrive."""

    def __init__(
        self, stops: list[str], decode: Callable[[list[int]], str], include: bool = False
    ) -> None:
        self.stops, self.decode, self.include = stops, decode, include
        self.keep = max(len(s) for s in stops) - 1  # tail characters a match may start in
        self.ids: list[int] = []
        self.pieces: list[str] = []  # the settled text, in the pieces it was decoded in
        self.size = 0  # characters in ``pieces``
        self.tail = ""  # their last ``keep`` characters
        self._context = 0  # ids[_context:_read]: the settled ids the next window starts with
        self._read = 0

    def push(self, token: int) -> str | None:
        """Add one generated token; once it completes a stop string, the output's text
        before the first one (``include``: up to its end; else None)."""
        self.ids.append(token)
        new = self._advance()
        if not new:
            return None
        window = self.tail + new  # a match ending before ``new`` was found by an earlier push
        hits = [(k, len(s)) for s in self.stops if (k := window.find(s)) >= 0]
        start = self.size - len(self.tail)  # where ``window`` begins in the whole text
        self.pieces.append(new)
        self.size += len(new)
        if hits:
            at, length = min(hits)  # the first match; of two there, the shorter stop
            return "".join(self.pieces)[: start + at + (length if self.include else 0)]
        self.tail = window[len(window) - self.keep :] if self.keep else ""
        return None

    def _advance(self) -> str:
        """The text the ids since the last settled one add ("" while it is unsettled: an
        unfinished character, or a context whose text the new ids change)."""
        ids, start, read = self.ids, self._context, self._read
        context = self.decode(ids[start:read]) if read > start else ""
        window = self.decode(ids[start:])
        unsettled = window.endswith(REPLACEMENT) or not window.startswith(context)
        if unsettled and len(ids) - read <= MAX_PENDING_IDS:
            return ""
        self._context, self._read = read, len(ids)
        return window[len(context) :]
