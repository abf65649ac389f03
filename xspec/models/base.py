"""The contract every target (and draft) model implements.

A model runs a *ragged batch*: several sequences, each contributing some rows (new
tokens) appended at the end of its own decoding state. Rows are flattened into one
token dimension ``T`` (the "TND" layout engines use), ``seq_lens`` says how many rows
each sequence contributes, and the positions of sequence ``i``'s rows are
``states[i].num_tokens, ..., states[i].num_tokens + seq_lens[i] - 1``.

After ``forward`` each state has advanced by its row count. ``truncate(state, n)``
rolls a state back to its first ``n`` tokens *exactly*: continuing afterwards gives
the same results as if the dropped rows had never been scored. Speculative
verification relies on that (score gamma+1 rows, keep the accepted prefix).

Hidden-state capture: ``capture`` is a list of :class:`CapturePoint` (already mapped
by the platform from checkpoint layer ids, see ``Platform.capture_point``); the model
returns the hidden state at each point, concatenated in list order, as
``aux_hidden [T, K*d]``. Core code never adds +1 to a layer id itself.

Prefix snapshots (the engine's prefix cache, :mod:`xspec.engine.prefix_cache`): at a
block boundary ``end`` (a multiple of ``prefix_granularity``) ``snapshot(state, start)``
copies what the state gained since the previous boundary ``start`` (append-only rows:
KV, compressed entries) and what a continuation reads of its fixed-size parts at ``end``
(rings, compressor rows). ``restore(fresh, chain)`` rebuilds, in an empty state, the
state after ``chain[-1].end`` tokens from the snapshots of every block up to it; a
forward continuing from it gives bit for bit what the state that was snapshotted gives.

Logits: ``logit_rows`` names the rows whose logits the caller reads (a prefill needs
only each prompt's last row); the model scores only those, so a prompt chunk of
``T`` rows never holds ``[T, V]`` logits (at DeepSeek-V4's 129k vocabulary, 0.5 MiB of
fp32 a row: 1 GiB for one 2048-row chunk). ``None``: every row (verification, parity).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from xspec.capture import CapturePoint
from xspec.capture import CaptureSite as CaptureSite  # re-exported
from xspec.models.ops import EAGER_STEPS as EAGER_STEPS  # re-exported
from xspec.models.ops import StepOptions as StepOptions


@dataclass
class ForwardBatch:
    """One ragged batch of rows to score. Shapes: ``input_ids [T]`` (int64)."""

    input_ids: torch.Tensor  # [T]
    seq_lens: list[int]  # rows per sequence, sum == T
    states: list[Any]  # one model-specific decoding state per sequence
    capture: list[CapturePoint] = field(default_factory=list)
    logit_rows: list[int] | None = None  # the rows to score (ascending); None: all T

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.states):
            raise ValueError("seq_lens and states must have one entry per sequence")
        rows = self.input_ids.shape[0]
        if sum(self.seq_lens) != rows:
            raise ValueError(f"seq_lens sum to {sum(self.seq_lens)}, input_ids has {rows} rows")
        picked = self.logit_rows
        if picked is not None and any(
            not 0 <= r < rows or (i and r <= picked[i - 1]) for i, r in enumerate(picked)
        ):
            raise ValueError(
                f"logit_rows must be ascending row indices in [0, {rows}), got {picked}"
            )

    def scored(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` (``[T, ...]``) whose logits are wanted: ``logit_rows``."""
        if self.logit_rows is None:
            return x
        return x[torch.tensor(self.logit_rows, dtype=torch.long, device=x.device)]

    def positions(self) -> torch.Tensor:
        """Absolute position of every row: ``[T]`` int64."""
        parts = [
            torch.arange(s.num_tokens, s.num_tokens + n, dtype=torch.long)
            for s, n in zip(self.states, self.seq_lens)
        ]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [T, vocab] float32; [len(logit_rows), vocab] when the batch names them
    hidden: (
        torch.Tensor
    )  # [T, ...] pre-head hidden: DSv4 [T, hc, d] (before hc_head); Qwen3 [T, d] (before norm)
    aux_hidden: torch.Tensor | None = None  # [T, K*d] at the requested capture points, else None


@dataclass(frozen=True)
class KvBytes:
    """Cache bytes one sequence needs, analytically: ``fixed`` whatever its length (SWA
    rings, compressor rows) plus ``per_token`` for every token it holds (full-attention
    K/V, compressed entries, indexer keys). The memory planner adds target and draft."""

    fixed: int = 0
    per_token: float = 0.0

    def at(self, num_tokens: int) -> int:
        """Bytes of a sequence holding ``num_tokens`` tokens."""
        return self.fixed + math.ceil(self.per_token * num_tokens)

    def __add__(self, other: KvBytes) -> KvBytes:
        return KvBytes(self.fixed + other.fixed, self.per_token + other.per_token)


@dataclass(frozen=True)
class Footprint:
    """What one part of a run (the target, or a drafter) will hold, known from config.json
    and the safetensors headers alone, before any tensor is read (the memory planner's
    input: :mod:`xspec.engine.memory`).

    ``tensors``: checkpoint tensor -> (format, bytes it holds once loaded): a quantised
    weight its stored bytes with its scale / offset siblings (``fp8``, ``mxfp4``,
    ``w8a8``), a float tensor at the model dtype (``bf16``, ``fp32``), an index table as
    stored (``int``). Tensors shared with the target (a drafter's embedding and head) are
    not listed again. ``kv``: the analytic per-sequence cache bytes, as ``kv_bytes()``
    of the loaded model reports them. ``num_experts``: routed experts per MoE layer
    (``parallel.ep`` ranks split the ``ffn.experts.{e}.`` tensors), None without MoE.
    The target's also carries what the verify workspace and the context depend on.
    """

    tensors: dict[str, tuple[str, int]] = field(default_factory=dict)
    kv: KvBytes = field(default_factory=KvBytes)
    num_experts: int | None = None
    vocab_size: int = 0
    hidden_size: int = 0
    max_context: int = 0


class Snapshot(Protocol):
    """What a state gained over one prefix block, and its fixed-size parts at the block's
    end (see the module docstring)."""

    @property
    def end(self) -> int:
        """Tokens the state held when it was taken (the block's end boundary)."""
        ...

    def nbytes(self) -> int:
        """Bytes of the tensors it holds."""
        ...


@runtime_checkable
class DecodeState(Protocol):
    """Per-sequence decoding state (KV caches, compressor state...)."""

    num_tokens: int  # tokens currently held (== position of the next row)


class SpecialTokens(Protocol):
    """The token ids a checkpoint's config names (a model's ``args``)."""

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | list[int] | None: ...


@runtime_checkable
class TargetModel(Protocol):
    """What the engine needs from a target model."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    max_context: int  # longest sequence (prompt + generated) a state can hold
    checkpoint_dir: Path | None  # where it was loaded from (tokenizer.json, drafters beside it)

    @property
    def args(self) -> SpecialTokens:
        """The parsed config (bos / eos ids for the tokenizer and the stop set)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the weights live: the speculative step keeps drafts, verify rows and
        probabilities here and synchronises with the host once per step."""
        ...

    def new_state(self, max_tokens: int | None = None) -> DecodeState:
        """An empty state; ``max_tokens`` (the engine's reservation for the request) caps
        how far its growing buffers may allocate (None: up to ``max_context``). States
        expose ``nbytes_allocated()``: bytes of the tensors they hold now."""
        ...

    def kv_bytes(self) -> KvBytes:
        """Analytic per-sequence cache bytes of :meth:`new_state` (for the planner)."""
        ...

    def forward(self, batch: ForwardBatch) -> ModelOutput: ...

    @property
    def prefix_granularity(self) -> int:
        """Prefix-cache blocks must be a multiple of this many tokens (DeepSeek-V4: its
        compression ratios, so a block's compressed entries are whole)."""
        ...

    def snapshot(self, state: Any, start: int) -> Snapshot:
        """A copy of what ``state`` gained since the boundary ``start`` (see the module
        docstring); ``state`` holds exactly its boundary's tokens and is left unchanged."""
        ...

    def restore(self, state: Any, chain: Sequence[Any]) -> None:
        """Fill the empty ``state`` (from :meth:`new_state`) with ``chain``: the snapshots
        of consecutive blocks from token 0 to ``chain[-1].end``."""
        ...

    def truncate(self, state: Any, num_tokens: int) -> None:
        """Roll ``state`` (one this model made) back to its first ``num_tokens`` tokens."""
        ...


def modules_of(parts: Iterable[Any]) -> list[torch.nn.Module]:
    """The modules of ``parts``: each part that is one, and the modules a part holds as
    attributes (a drafter holds its modules so)."""
    out: list[torch.nn.Module] = []
    for part in parts:
        if isinstance(part, torch.nn.Module):
            out.append(part)
        elif part is not None and hasattr(part, "__dict__"):
            out += [v for v in vars(part).values() if isinstance(v, torch.nn.Module)]
    return out
