"""Index tensors of one ragged batch, built once per forward and shared by every layer.

A forward appends ``lens[b]`` rows to each live sequence ``b`` (sequences with no rows
are left out) at positions ``starts[b]..starts[b]+lens[b]-1``; its rows are the
consecutive rows ``row0[b]..`` of the flattened batch. A layer reads the caches of all
its sequences through one gather per source instead of a Python loop over sequences:

* attention: decode / verify queries gather their window rows from the stacked SWA
  rings ``[ring of seq 0 | ... | seq B-1]`` (:meth:`BatchLayout.window_index`), and
  every query its compressed entries from ``[entries of seq 0 | ... | seq B-1]``
  (:meth:`BatchLayout.causal_entries`, :meth:`BatchLayout.picked_entries`); -1 = masked;
* compressor emission: ``[row rings of all live seqs | the T new rows | pad row]``,
  indexed by :attr:`Emission.index` (the pad row, kv 0 / score -inf, stands for
  positions before the sequence start);
* the indexer scores each sequence's queries against its own keys as one padded
  batched matmul (:meth:`BatchLayout.padded`, :meth:`BatchLayout.padded_entries`).

Everything here depends only on the batch layout and on ring sizes, never on cache
contents, so layers of the same kind reuse the same tensors (memoised per key).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Emission:
    """The compressed entries one forward completes, for one ``(ratio, coff, ring)``.

    ``seqs``: live index of every sequence completing at least one window, ``firsts``
    its first new entry id, ``counts`` how many; ``index [E, coff*ratio]`` rows of
    ``cat(row rings of all live seqs, T new rows, pad row)`` that entry ``e`` pools, in
    position order; ``window_starts [E]`` int64, the rope position of each entry.
    """

    seqs: list[int]
    firsts: list[int]
    counts: list[int]
    index: torch.Tensor
    window_starts: torch.Tensor
    limit: int  # largest window start + 1 (rope table size)
    memo: dict[Any, Any] = field(default_factory=dict)


class BatchLayout:
    """The ragged layout of one forward: ``positions [T]`` int64 of the flattened rows,
    ``seq_lens`` / ``starts`` per sequence (all sequences, empty ones included)."""

    def __init__(self, positions: torch.Tensor, seq_lens: list[int], starts: list[int]) -> None:
        self.positions = positions
        self.device = positions.device
        self.live = [b for b, n in enumerate(seq_lens) if n]
        self.lens = [seq_lens[b] for b in self.live]
        self.starts = [starts[b] for b in self.live]
        self.row0 = list(itertools.accumulate([0, *self.lens[:-1]]))
        self.num_rows = sum(self.lens)
        self.end = max((s + n for s, n in zip(self.starts, self.lens)), default=0)
        self.uniform = len(set(self.lens)) <= 1  # every live sequence has the same row count
        self._memo: dict[Any, Any] = {}

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per key for this forward."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def seq(self) -> torch.Tensor:
        """``[T]`` live index of each row's sequence."""

        def build() -> torch.Tensor:
            ids = torch.arange(len(self.lens), device=self.device)
            return ids.repeat_interleave(self._tensor(self.lens), output_size=self.num_rows)

        return self.memo("seq", build)

    def chunk_start(self) -> torch.Tensor:
        """``[T]`` first position of each row's chunk (its sequence's ``start``)."""
        return self.memo("chunk_start", lambda: self._tensor(self.starts)[self.seq()])

    def offset(self) -> torch.Tensor:
        """``[T]`` index of each row within its sequence's chunk."""
        return self.memo("offset", lambda: self.positions - self.chunk_start())

    def phase(self, ratio: int) -> torch.Tensor:
        """``[T]`` position modulo ``ratio`` (the compressor's ``ape`` row)."""
        return self.memo(("phase", ratio), lambda: self.positions % ratio)

    def visible(self, ratio: int) -> torch.Tensor:
        """``[T]`` entries each row may read: entry ``w`` is causal iff ``w < visible``."""
        return self.memo(("visible", ratio), lambda: (self.positions + 1) // ratio)

    def rotation(self, rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE ``cos, sin [T, rd]`` of the rows (see :meth:`Rope.rotation`)."""
        return self.memo(("rope", rope.key), lambda: rope.rotation(self.positions, self.end))

    def ring_slots(self, size: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Where the new rows go in a ring stack ``[B, size, C]`` viewed as ``[B*size, C]``:
        ``(picked rows [M] or None = all T rows, flat slots [M])``. Of a sequence with
        more than ``size`` new rows only the last ``size`` are written (the earlier ones
        would be overwritten, and one scatter must not write a slot twice)."""

        def build() -> tuple[torch.Tensor | None, torch.Tensor]:
            slots = self.seq() * size + self.positions % size
            if max(self.lens) <= size:
                return None, slots
            lens = self._tensor(self.lens)[self.seq()]
            picked = (self.offset() >= lens - size).nonzero().squeeze(1)
            return picked, slots[picked]

        return self.memo(("ring_slots", size), build)

    # -- attention sources ---------------------------------------------------------------

    def window_index(self, ring: int, window: int) -> torch.Tensor:
        """``[T, W]`` ring-stack rows (``b * ring + p % ring``) of the ``window`` positions
        ending at each query's own, -1 before position 0; the new rows must already be
        in the rings (valid while no sequence has more than ``ring - window + 1`` rows)."""

        def build() -> torch.Tensor:
            width = min(window, self.end)
            ahead = torch.arange(1 - width, 1, device=self.device)  # [W] p - query position
            pos = self.positions[:, None] + ahead  # [T, W]
            index = self.seq()[:, None] * ring + pos.remainder(ring)
            return index.masked_fill_(pos < 0, -1)

        return self.memo(("window", ring, window), build)

    def earlier_slots(self, ring: int, window: int) -> list[torch.Tensor]:
        """Per live sequence, the ring slots of the raw rows before its chunk that its
        first query sees: positions ``[max(0, start - window + 1), start)``."""

        def build() -> list[torch.Tensor]:
            return [
                torch.arange(max(0, s - window + 1), s, device=self.device) % ring
                for s in self.starts
            ]

        return self.memo(("earlier", ring, window), build)

    def entry_counts(self, ratio: int) -> list[int]:
        """Entries each live sequence holds after this forward (``tokens // ratio``)."""
        return [(s + n) // ratio for s, n in zip(self.starts, self.lens)]

    def entry_base(self, ratio: int) -> torch.Tensor:
        """``[T]`` offset of each row's sequence in ``cat(entries of every sequence)``."""

        def build() -> torch.Tensor:
            offsets = list(itertools.accumulate([0, *self.entry_counts(ratio)[:-1]]))
            return self._tensor(offsets)[self.seq()]

        return self.memo(("entry_base", ratio), build)

    def causal_entries(self, ratio: int) -> torch.Tensor:
        """``[T, n_max]`` rows of ``cat(entries of every sequence)``: every causal entry of
        each row's sequence, -1 = not (yet) causal."""

        def build() -> torch.Tensor:
            n_max = max(self.entry_counts(ratio), default=0)
            ids = torch.arange(n_max, device=self.device)[None, :]  # [1, n]
            index = ids + self.entry_base(ratio)[:, None]
            return index.masked_fill_(ids >= self.visible(ratio)[:, None], -1)

        return self.memo(("causal", ratio), build)

    def padded_entries(self, ratio: int) -> torch.Tensor:
        """``[B, n_max]`` rows of ``cat(entries)`` laying each sequence's entries out in
        a padded batch; the padding repeats other rows (callers mask it: it is never
        causal)."""

        def build() -> torch.Tensor:
            counts = self.entry_counts(ratio)
            offsets = list(itertools.accumulate([0, *counts[:-1]]))
            ids = torch.arange(max(counts), device=self.device)[None, :]
            return (self._tensor(offsets)[:, None] + ids).clamp_(max=max(sum(counts) - 1, 0))

        return self.memo(("padded_entries", ratio), build)

    def picked_entries(self, ratio: int, picks: torch.Tensor) -> torch.Tensor:
        """Entry ids ``picks [T, K]`` (-1 = none) -> rows of ``cat(entries)``."""
        return torch.where(picks >= 0, picks + self.entry_base(ratio)[:, None], -1)

    # -- per-sequence padding (the indexer scores each sequence against its own keys) ----

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``x [T, ...]`` -> ``[B, S, ...]`` (zero padded; a view when uniform)."""
        b, s = len(self.lens), max(self.lens)
        if self.uniform:
            return x.view(b, s, *x.shape[1:])
        out = x.new_zeros(b, s, *x.shape[1:])
        return out.index_put_((self.seq(), self.offset()), x)

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`padded`: ``[B, S, ...]`` -> ``[T, ...]``."""
        if self.uniform:
            return x.reshape(self.num_rows, *x.shape[2:])
        return x[self.seq(), self.offset()]

    # -- compressor emission -------------------------------------------------------------

    def emission(self, ratio: int, coff: int, ring: int) -> Emission | None:
        """Entries completed by this forward (None if none); see :class:`Emission`."""
        return self.memo(("emission", ratio, coff, ring), lambda: self._emission(ratio, coff, ring))

    def _emission(self, ratio: int, coff: int, ring: int) -> Emission | None:
        seqs: list[int] = []
        firsts: list[int] = []
        counts: list[int] = []
        for b, (s, n) in enumerate(zip(self.starts, self.lens)):
            first, last = s // ratio, (s + n) // ratio  # new entries: [first, last)
            if last > first:
                seqs.append(b)
                firsts.append(first)
                counts.append(last - first)
        if not seqs:
            return None
        which = [b for b, c in zip(seqs, counts) for _ in range(c)]  # [E] live seq of entry
        entry = self._tensor([f + i for f, c in zip(firsts, counts) for i in range(c)])  # [E]
        start = self._tensor([self.starts[b] for b in which])[:, None]  # [E, 1]
        row0 = self._tensor([self.row0[b] for b in which])[:, None]
        # entry w pools positions (w - coff + 1) * ratio .. (w + 1) * ratio - 1
        span = torch.arange(coff * ratio, device=self.device)
        pos = (entry[:, None] - coff + 1) * ratio + span  # [E, coff*ratio]
        rings = len(self.lens) * ring  # new rows follow the rings of every live sequence
        ring_rows = self._tensor(which)[:, None] * ring + pos.remainder(ring)
        index = torch.where(pos >= start, rings + row0 + pos - start, ring_rows)
        index.masked_fill_(pos < 0, rings + self.num_rows)  # the pad row
        return Emission(seqs, firsts, counts, index, entry * ratio, self.end)
