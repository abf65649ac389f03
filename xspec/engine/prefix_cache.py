"""The prefix cache: model state at prompt block boundaries, restored bit for bit.

Prompts are cut into blocks of ``block`` tokens at fixed boundaries (``block``, ``2 *
block``, ...). An entry is the state of a sequence at one boundary ``b``: what the
target and the drafter gained over the block ``[b - block, b)`` (append-only rows: K/V,
compressed entries, indexer keys) and what a continuation reads of their fixed-size
parts at ``b`` (SWA rings, compressor rows, a drafter's window or last hidden state), as
the models snapshot them (:class:`~xspec.models.base.Snapshot`). Restoring boundary
``b`` rebuilds a fresh state from the entries of every block up to it (copy on restore:
a running sequence never shares memory with the cache).

**Keys.** An entry's key is ``(parent entry id, the block's tokens)``: a hash chain as
vLLM's, where the parent id stands for every token before the block. Python's dict
compares the token tuples on a hash match, so two prefixes never collide, and an entry's
id is never reused, so a key made of an evicted parent cannot match a new one. (A radix
tree would match any token count; the states can only be snapshotted where a forward
ended, so boundaries are fixed anyway and a chain of dict lookups is all it needs.)

**The row before a boundary.** A drafter may read the token after each row it observes
(MTP embeds it), which at ``b`` is not part of the key; so the drafter's state at ``b``
has observed every row but the last, and the entry keeps that row's target hidden states
(:class:`~xspec.spec.block_prefill.HeldRow`), observed with the new prompt's next token
after a restore. A hit never covers a whole prompt: at least its last token is
prefilled, to sample the first output.

**Lineage.** A sequence inserts its boundaries only while every entry before them is
its own or the chain it restored: when a boundary is already cached from another
prefill, it stops, so no entry is ever restored on top of rows another forward made.

**Memory.** Entries are evicted least recently used first, leaves first (an entry's
descendants need it); entries pinned by a request between its admission and its
prefill are never evicted. ``capacity`` bounds the bytes held; the engine also makes
the cache give way to reservations (:meth:`evict`), so a request that fits the memory
plan without a cache fits with one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from xspec.models.base import Snapshot
from xspec.spec.block_prefill import HeldRow

ROOT = 0  # the parent id of a prompt's first block


@dataclass(eq=False)
class Entry:
    """One cached boundary: the states after ``end`` prompt tokens."""

    id: int
    key: tuple[int, tuple[int, ...]]  # (parent id, the block's tokens)
    parent: Entry | None
    end: int  # the boundary: tokens before it
    target: Snapshot
    draft: Any  # the drafter's snapshot (None for a drafter without state)
    held: HeldRow  # the row before the boundary, not yet observed by the drafter
    nbytes: int
    children: int = 0
    pins: int = 0

    def chain(self) -> list[Entry]:
        """This entry and its ancestors, from the first block."""
        out: list[Entry] = []
        e: Entry | None = self
        while e is not None:
            out.append(e)
            e = e.parent
        return out[::-1]


@dataclass
class Hit:
    """What admission found for one prompt: its cached prefix (pinned until released)."""

    entries: list[Entry] = field(default_factory=list)  # first block .. deepest

    @property
    def tokens(self) -> int:
        return self.entries[-1].end if self.entries else 0


@dataclass
class CacheStats:
    """Counters since the cache was made (or :meth:`PrefixCache.reset_stats`)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # ... of them served from the cache
    evicted: int = 0  # entries evicted
    inserted: int = 0  # entries inserted

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """Block-boundary states of earlier prompts (see the module docstring)."""

    def __init__(self, block: int, capacity: float) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = block
        self.capacity = capacity  # bytes (math.inf: no own limit)
        self.nbytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], Entry] = OrderedDict()
        self._ids = count(ROOT + 1)

    def __len__(self) -> int:
        return len(self._entries)

    def reset_stats(self) -> CacheStats:
        previous, self.stats = self.stats, CacheStats()
        return previous

    # ---- lookup ---------------------------------------------------------------------

    def match(self, prompt: Sequence[int]) -> Hit:
        """The longest cached prefix of ``prompt`` that leaves at least its last token
        to prefill, pinned (``release`` it after restoring)."""
        chain: list[Entry] = []
        parent = ROOT
        for end in range(self.block, len(prompt), self.block):  # end <= len(prompt) - 1
            entry = self._entries.get((parent, tuple(prompt[end - self.block : end])))
            if entry is None:
                break
            chain.append(entry)
            parent = entry.id
        for e in chain:  # most recently used, the deepest last (evicted after its parents)
            self._entries.move_to_end(e.key)
            e.pins += 1
        return Hit(chain)

    def count(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Record one prefill's lookup: its prompt tokens, those restored from the cache."""
        self.stats.queries += prompt_tokens
        self.stats.hits += hit_tokens

    def release(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            e.pins -= 1

    # ---- insertion ------------------------------------------------------------------

    def key_of(self, parent: Entry | None, prompt: Sequence[int], end: int) -> tuple:
        return (ROOT if parent is None else parent.id, tuple(prompt[end - self.block : end]))

    def cached(self, parent: Entry | None, prompt: Sequence[int], end: int) -> bool:
        """Whether the boundary ``end`` of ``prompt`` after ``parent`` is cached already."""
        return self.key_of(parent, prompt, end) in self._entries

    def insert(
        self,
        parent: Entry | None,
        prompt: Sequence[int],
        end: int,
        target: Snapshot,
        draft: Any,
        held: HeldRow,
        room: float,
    ) -> Entry | None:
        """Cache the states at boundary ``end`` of ``prompt`` (after ``parent``), pinned,
        evicting what it must to stay within ``capacity`` and ``room`` (bytes the engine
        can spare besides what the cache holds); None when it does not fit (nothing is
        inserted) or when the boundary is cached already."""
        key = self.key_of(parent, prompt, end)
        if key in self._entries:
            return None
        nbytes = target.nbytes() + (0 if draft is None else int(draft.nbytes())) + held.nbytes()
        limit = min(self.capacity, self.nbytes + room)
        if self.nbytes + nbytes > limit:
            self.evict(self.nbytes + nbytes - limit)
            if self.nbytes + nbytes > min(self.capacity, self.nbytes + room):
                return None
        entry = Entry(next(self._ids), key, parent, end, target, draft, held, nbytes, pins=1)
        self._entries[key] = entry
        if parent is not None:
            parent.children += 1
        self.nbytes += nbytes
        self.stats.inserted += 1
        return entry

    # ---- eviction -------------------------------------------------------------------

    def evict(self, nbytes: float) -> int:
        """Evict least recently used leaves that nobody pins until ``nbytes`` are freed
        (or nothing more can be); the bytes freed."""
        freed = 0
        while freed < nbytes:
            victim = next(
                (e for e in self._entries.values() if not e.children and not e.pins), None
            )
            if victim is None:
                break
            del self._entries[victim.key]
            if victim.parent is not None:
                victim.parent.children -= 1
            self.nbytes -= victim.nbytes
            freed += victim.nbytes
            self.stats.evicted += 1
        return freed

    def clear(self) -> None:
        """Drop every entry nobody pins (not counted as evictions)."""
        evicted = self.stats.evicted
        self.evict(float("inf"))
        self.stats.evicted = evicted
