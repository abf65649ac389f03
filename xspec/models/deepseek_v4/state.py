"""Per-sequence decoding state of DeepSeek-V4, with exact rollback.

Organised by cache kind (docs/architecture.md, "KV state and rollback"), one :class:`LayerCache` per layer:

* **SWA ring** (every layer): raw K=V rows ``[window + max_rollback, D]``, position
  ``p`` in slot ``p % ring_size``. The ``max_rollback`` extra slots mean a rollback of up
  to ``max_rollback`` rows never needs a row that was overwritten.
* **Compressor state as per-position rows** (the xLLM approach, CSA/HCA layers and the
  CSA indexer): the per-token ``[kv | score]`` rows (fp32, ``score`` already includes
  the ``ape`` position bias) of the last ``coff*m + max_rollback`` positions, in a ring
  indexed by position. Compressed entry ``w`` is (re)computed from those rows when
  position ``(w+1)*m - 1`` is processed. Nothing rolling is kept (unlike the official /
  transformers ``kv_state``/``score_state``), so rollback needs no snapshot.
* **Compressed KV / indexer keys**: growing buffers of entries (capacity doubles,
  bounded by ``max_context // m``) plus an entry count, invariant
  ``n_entries == num_tokens // m``.

``truncate(n)`` therefore only resets counters: ring slots and rows of positions ``>= n``
are simply overwritten when those positions are scored again, and entries ``>= n // m``
are dropped by the count. It is exact as long as every row the continuation reads is
still in its ring: ``n >= high_water - max_rollback``, where ``high_water`` is the most
tokens the state ever held (equal to ``num_tokens`` unless the state was already
rolled back and not re-extended past that point).

Byte accounting: :meth:`DeepseekV4State.nbytes_fixed` (rings, rows) and
:meth:`DeepseekV4State.nbytes_per_token` (entry growth) measure the allocated tensors;
:func:`kv_bytes` gives the same numbers analytically, for the memory planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.layout import BatchLayout

_MIN_ENTRY_CAPACITY = 16
_ROW_DTYPE = torch.float32  # compressor rows are fp32, as the official kv/score state


class Ring:
    """One sequence's fixed-size ring ``data [size, C]`` (position ``p`` in slot ``p % size``).

    A batched forward reads and writes the rings of all its sequences at once through
    :func:`stack_rings`, which makes each ring a row of one ``[B, size, C]`` tensor. The
    rings stay rows of that stack until a forward with another batch composition
    restacks them, so steady decoding copies nothing and writes with one scatter. (A
    stack lives while any ring views it: the row of a finished sequence is freed at the
    next restack of its former batch-mates.)
    """

    __slots__ = ("data", "row", "stack")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.stack: torch.Tensor | None = None  # the [B, size, C] tensor data is row `row` of
        self.row = -1


def stack_rings(rings: list[Ring]) -> torch.Tensor:
    """``[B, size, C]`` tensor whose row ``b`` is ``rings[b].data`` (restacked, one copy,
    only when these rings are not already exactly the rows of one stack, in order)."""
    stack = rings[0].stack
    if (
        stack is None
        or stack.shape[0] != len(rings)
        or any(r.stack is not stack or r.row != b for b, r in enumerate(rings))
    ):
        stack = torch.stack([r.data for r in rings])
        for b, (ring, view) in enumerate(zip(rings, stack.unbind(0))):
            ring.data, ring.stack, ring.row = view, stack, b
    return stack


def scatter_rows(
    stack: torch.Tensor, rows: torch.Tensor, where: tuple[torch.Tensor | None, torch.Tensor]
) -> None:
    """Write new rows into a ring stack ``[B, size, C]`` in one op: ``rows [T, C]``,
    ``where = (picked rows or None for all, flat slots)`` from ``BatchLayout.ring_slots``."""
    picked, slots = where
    stack.view(-1, stack.shape[-1]).index_put_((slots,), rows if picked is None else rows[picked])


class CompressorCache:
    """One compressor's state for one sequence (the main KV compressor or the indexer's).

    ``rows [coff*m + max_rollback, 2*coff*width]`` fp32 per-position rows ``[kv | score]``
    (one ring, so a token is one write); ``entries [capacity, width]`` (model dtype)
    compressed entries, ``n_entries`` valid.
    """

    def __init__(
        self,
        *,
        ratio: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_rollback: int,
        max_context: int,
    ) -> None:
        self.ratio = ratio
        self.width = width
        self.coff = 2 if ratio == 4 else 1  # CSA windows overlap: two series per token
        self.ring_size = self.coff * ratio + max_rollback
        self.max_entries = max_context // ratio
        shape = (self.ring_size, 2 * self.coff * width)
        self.ring = Ring(torch.zeros(shape, dtype=_ROW_DTYPE, device=device))
        self.entries = torch.zeros(0, width, dtype=dtype, device=device)
        self.n_entries = 0

    @property
    def rows(self) -> torch.Tensor:
        """``[ring_size, 2*coff*width]`` the per-position ``[kv | score]`` rows."""
        return self.ring.data

    def reserve(self, num_tokens: int) -> None:
        """Grow ``entries`` so that ``num_tokens // ratio`` entries fit (doubling)."""
        needed = num_tokens // self.ratio
        capacity = self.entries.shape[0]
        if needed <= capacity:
            return
        new_cap = min(max(needed, 2 * capacity, _MIN_ENTRY_CAPACITY), max(self.max_entries, needed))
        grown = self.entries.new_zeros(new_cap, self.width)
        grown[: self.n_entries] = self.entries[: self.n_entries]
        self.entries = grown

    def put_entries(self, first: int, entries: torch.Tensor) -> None:
        """Write entries ``first..first+k-1`` (``entries [k, width]``); they become the last."""
        end = first + entries.shape[0]
        self.reserve(end * self.ratio)
        self.entries[first:end] = entries.to(self.entries.dtype)
        self.n_entries = end

    def valid_entries(self) -> torch.Tensor:
        """``[n_entries, width]`` view of the valid entries."""
        return self.entries[: self.n_entries]

    def truncate(self, num_tokens: int) -> None:
        self.n_entries = num_tokens // self.ratio

    def snapshot(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(copies of) the rows ring and the entries made since token ``start``."""
        return self.rows.clone(), self.entries[start // self.ratio : self.n_entries].clone()

    def restore(self, rows: torch.Tensor, entries: list[torch.Tensor]) -> None:
        """Take the rows ring and the consecutive entries from the first (empty cache)."""
        self.ring.data.copy_(rows)
        if entries:
            self.put_entries(0, torch.cat(entries))

    def nbytes_fixed(self) -> int:
        return _nbytes(self.rows)

    def nbytes_per_token(self) -> float:
        return self.width * self.entries.element_size() / self.ratio

    def nbytes_allocated(self) -> int:
        return self.nbytes_fixed() + _nbytes(self.entries)


class TokenCount:
    """Tokens held, and the exact-rollback bound, of a layer cache or a sequence state.

    ``high_water`` is the most tokens ever held: rings stay valid back to
    ``high_water - max_rollback`` (see the module docstring). ``truncate`` cuts every part
    returned by :meth:`parts` too.
    """

    def __init__(self, max_rollback: int) -> None:
        self.max_rollback = max_rollback
        self.num_tokens = 0
        self.high_water = 0

    def parts(self) -> Sequence[Any]:
        return ()

    def advance(self, n: int) -> None:
        """Record ``n`` rows appended by a forward."""
        self.num_tokens += n
        self.high_water = max(self.high_water, self.num_tokens)

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens (ValueError outside the exact range)."""
        check_truncate(self.num_tokens, self.high_water, self.max_rollback, num_tokens)
        self.num_tokens = num_tokens
        for part in self.parts():
            part.truncate(num_tokens)


class LayerCache(TokenCount):
    """Everything one attention layer keeps for one sequence.

    ``swa [window + max_rollback, head_dim]``; ``compressor`` (ratio 4/128) and
    ``indexer`` (ratio 4) are :class:`CompressorCache` or None.
    """

    def __init__(
        self,
        args: DeepseekV4Args,
        compress_ratio: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_rollback: int,
        max_context: int,
    ) -> None:
        super().__init__(max_rollback)
        self.window = args.sliding_window
        self.compress_ratio = compress_ratio
        self.ring_size = args.sliding_window + max_rollback
        self.swa_ring = Ring(torch.zeros(self.ring_size, args.head_dim, dtype=dtype, device=device))
        common = dict(
            dtype=dtype, device=device, max_rollback=max_rollback, max_context=max_context
        )
        self.compressor = (
            CompressorCache(ratio=compress_ratio, width=args.head_dim, **common)  # type: ignore[arg-type]
            if compress_ratio
            else None
        )
        self.indexer = (
            CompressorCache(ratio=compress_ratio, width=args.index_head_dim, **common)  # type: ignore[arg-type]
            if compress_ratio == 4
            else None
        )

    @property
    def swa(self) -> torch.Tensor:
        """``[ring_size, head_dim]`` raw K=V rows, position ``p`` in slot ``p % ring_size``."""
        return self.swa_ring.data

    def compressors(self) -> list[CompressorCache]:
        return [c for c in (self.compressor, self.indexer) if c is not None]

    def window_rows(self, start: int) -> torch.Tensor:
        """Raw rows a chunk starting at ``start`` still needs from earlier chunks:
        positions ``[max(0, start - window + 1), start)`` -> ``[P, head_dim]``."""
        first = max(0, start - self.window + 1)
        slots = torch.arange(first, start, device=self.swa.device) % self.ring_size
        return self.swa[slots]

    def reserve(self, num_tokens: int) -> None:
        for c in self.compressors():
            c.reserve(num_tokens)

    def snapshot(self, start: int) -> LayerSnapshot:
        """What a prefix-cache snapshot keeps of this layer at ``num_tokens``: the SWA
        ring and the compressor rows (fixed size), the entries made since ``start``."""
        parts = [c.snapshot(start) for c in self.compressors()]
        return LayerSnapshot(
            self.num_tokens,
            self.swa.clone(),
            tuple(rows for rows, _ in parts),
            tuple(entries for _, entries in parts),
        )

    def restore(self, chain: Sequence[LayerSnapshot]) -> None:
        """Hold the state ``chain`` (one layer's snapshots of consecutive blocks from 0)
        was taken of; this cache must be empty."""
        if self.high_water:
            raise ValueError(f"restore into a layer cache holding {self.num_tokens} tokens")
        if not chain:
            return
        last = chain[-1]
        self.swa_ring.data.copy_(last.swa)
        for k, c in enumerate(self.compressors()):
            c.restore(last.rows[k], [s.entries[k] for s in chain])
        self.num_tokens = self.high_water = last.end

    def parts(self) -> list[CompressorCache]:
        return self.compressors()

    def nbytes_fixed(self) -> int:
        return _nbytes(self.swa) + sum(c.nbytes_fixed() for c in self.compressors())

    def nbytes_per_token(self) -> float:
        return sum(c.nbytes_per_token() for c in self.compressors())

    def nbytes_allocated(self) -> int:
        return _nbytes(self.swa) + sum(c.nbytes_allocated() for c in self.compressors())


@dataclass(frozen=True, eq=False)
class LayerSnapshot:
    """One layer of a prefix-cache snapshot: at ``end`` tokens, the SWA ring
    ``[ring_size, head_dim]`` and each compressor's rows ring, and each compressor's
    entries of the block (``[block // ratio, width]``: the block is a multiple of the
    ratio)."""

    end: int
    swa: torch.Tensor
    rows: tuple[torch.Tensor, ...]  # one per compressor (main, indexer)
    entries: tuple[torch.Tensor, ...]

    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in (self.swa, *self.rows, *self.entries))


@dataclass(frozen=True, eq=False)
class StateSnapshot:
    """A prefix-cache snapshot of a :class:`DeepseekV4State`: one per layer."""

    end: int
    layers: tuple[LayerSnapshot, ...]

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class DeepseekV4State(TokenCount):
    """Decoding state of one sequence: one :class:`LayerCache` per target layer."""

    def __init__(self, layers: list[LayerCache], max_rollback: int) -> None:
        super().__init__(max_rollback)
        self.layers = layers

    def snapshot(self, start: int) -> StateSnapshot:
        """Every layer's :meth:`LayerCache.snapshot` since the boundary ``start``."""
        return StateSnapshot(self.num_tokens, tuple(c.snapshot(start) for c in self.layers))

    def restore(self, chain: Sequence[StateSnapshot]) -> None:
        """Hold the state ``chain`` (consecutive blocks from 0) was taken of (empty state)."""
        for i, layer in enumerate(self.layers):
            layer.restore([s.layers[i] for s in chain])
        self.num_tokens = self.high_water = chain[-1].end if chain else 0

    def parts(self) -> list[LayerCache]:
        return self.layers

    def reserve(self, num_tokens: int) -> None:
        for layer in self.layers:
            layer.reserve(num_tokens)

    def nbytes_fixed(self) -> int:
        """Bytes of the fixed-size tensors (SWA rings, compressor rows)."""
        return sum(layer.nbytes_fixed() for layer in self.layers)

    def nbytes_per_token(self) -> float:
        """Bytes the growing buffers need per token (compressed entries, indexer keys)."""
        return sum(layer.nbytes_per_token() for layer in self.layers)

    def nbytes_allocated(self) -> int:
        """Bytes of every tensor currently allocated (growth capacity included)."""
        return sum(layer.nbytes_allocated() for layer in self.layers)


def check_truncate(num_tokens: int, high_water: int, max_rollback: int, target: int) -> None:
    """ValueError unless ``high_water - max_rollback <= target <= num_tokens``."""
    lowest = max(0, high_water - max_rollback)
    if not lowest <= target <= num_tokens:
        raise ValueError(
            f"cannot truncate a DeepSeek-V4 state holding {num_tokens} tokens to {target}: "
            f"the exact range is [{lowest}, {num_tokens}] (max_rollback={max_rollback} rows "
            f"behind the furthest position {high_water}); build the model with a larger "
            f"max_rollback to roll back further"
        )


def new_layer_cache(
    args: DeepseekV4Args,
    compress_ratio: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    max_rollback: int,
    max_context: int,
) -> LayerCache:
    """State of one stand-alone block (e.g. an MTP / DSpark stage with ratio 0)."""
    return LayerCache(
        args,
        compress_ratio,
        dtype=dtype,
        device=device,
        max_rollback=max_rollback,
        max_context=max_context,
    )


def layer_kv_bytes(
    args: DeepseekV4Args, compress_ratio: int, dtype: torch.dtype, max_rollback: int
) -> tuple[int, float]:
    """Analytic ``(fixed_bytes, bytes_per_token)`` of one :class:`LayerCache`."""
    es = torch.empty(0, dtype=dtype).element_size()
    row_es = torch.empty(0, dtype=_ROW_DTYPE).element_size()
    fixed = (args.sliding_window + max_rollback) * args.head_dim * es
    per_token = 0.0
    widths = [args.head_dim] if compress_ratio else []
    if compress_ratio == 4:
        widths.append(args.index_head_dim)
    coff = 2 if compress_ratio == 4 else 1
    for width in widths:
        fixed += 2 * (coff * compress_ratio + max_rollback) * coff * width * row_es  # kv + score
        per_token += width * es / compress_ratio
    return fixed, per_token


def kv_bytes(args: DeepseekV4Args, dtype: torch.dtype, max_rollback: int) -> tuple[int, float]:
    """Analytic ``(fixed_bytes_per_seq, bytes_per_token)`` of a target state."""
    fixed, per_token = 0, 0.0
    for ratio in args.target_compress_ratios:
        f, p = layer_kv_bytes(args, ratio, dtype, max_rollback)
        fixed += f
        per_token += p
    return fixed, per_token


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class BlockContext:
    """What a block needs besides its input rows: the ragged batch layout and its caches.

    ``input_ids [T]`` (hash routing), ``positions [T]`` (rope), ``seq_lens`` rows per
    sequence, ``starts`` tokens each sequence held before this forward, ``caches`` this
    block's :class:`LayerCache` of each sequence (empty until :meth:`for_block`).
    ``memo`` holds the :class:`BatchLayout` built on first use; :meth:`for_block`
    copies share it, so every layer of a forward reuses the same index tensors.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: list[int]
    starts: list[int]
    caches: list[LayerCache] = field(default_factory=list)
    memo: dict[str, BatchLayout] = field(default_factory=dict, repr=False, compare=False)

    def for_block(self, caches: list[LayerCache]) -> BlockContext:
        """The same batch with the caches of another block."""
        return replace(self, caches=caches)

    def layout(self) -> BatchLayout:
        """The batch's index tensors (built once per forward)."""
        if "layout" not in self.memo:
            self.memo["layout"] = BatchLayout(self.positions, self.seq_lens, self.starts)
        return self.memo["layout"]

    def live_caches(self) -> list[LayerCache]:
        """Caches of the sequences with rows (``layout().live`` order), checked against
        ``starts``; all must share one ring size (they come from one model)."""
        caches = [self.caches[b] for b in self.layout().live]
        if len({id(c) for c in caches}) < len(caches):
            raise ValueError(
                "the same layer cache appears twice in one batch; pass each sequence once"
            )
        for cache, start in zip(caches, self.layout().starts, strict=True):
            if cache.num_tokens != start:
                raise ValueError(
                    f"layer cache holds {cache.num_tokens} tokens but the batch appends at "
                    f"position {start}; pass each sequence's own state, once per forward"
                )
        if len({c.ring_size for c in caches}) > 1:
            raise ValueError(
                "caches of one batch have different ring sizes (max_rollback); build every "
                "sequence's state with the same model / max_rollback"
            )
        return caches
