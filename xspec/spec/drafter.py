"""What a speculative method (drafter) provides to the speculative step.

A drafter keeps its own per-sequence state. The step talks to it twice per decode step:

* ``propose(states, requests, num_tokens)``: ``num_tokens`` draft tokens per sequence
  (``1 <= num_tokens <= self.gamma``: the step asks for fewer when no request in the
  batch can use ``gamma``, see ``DraftRequest.max_drafts``), and their full draft
  distributions q when the drafts were sampled, starting after the anchor (the last
  committed token, not yet seen by the target). Tokens and q live on the target's
  device (``TargetModel.device``). Any speculative rows it appends to its own state
  while drafting it must roll back itself before returning.
* ``observe``: the context committed since the last call. For every target row that
  was kept (the prompt after prefill; anchor + accepted drafts after a verify step) it
  gets the row's input token, the *next* token (the one at position + 1, the last of
  which is the new anchor), and the target's hidden rows (pre-head hidden, and the aux
  hidden captured at ``capture_layer_ids`` when the drafter asked for any), for all
  sequences at once as one flat ragged batch (:class:`CommittedRows`): the step gathers
  the kept rows of the target's forward with one index, the drafter consumes them flat.

Structured output: a drafter with ``masks_inside`` gets, for each request under a
grammar (while ``spec.mask_drafts`` is on), a :class:`~xspec.spec.constrained.DraftGuide`
in ``DraftRequest.guide``: at each draft position it masks the logits with
:func:`~xspec.spec.constrained.guided_logits` before the request's sampling and pushes
the draft with :func:`~xspec.spec.constrained.advance`, so the next position conditions
on an allowed token. Other drafters propose freely; the step masks afterwards.

Penalties, ``logit_bias`` and ``min_tokens``: ``DraftRequest.processors`` (while
``process_drafts``) carries the request's :class:`~xspec.spec.processors.Processors`; a
drafter that proposes under them passes each position's logits through
:class:`~xspec.spec.processors.DraftProcessors` before the grammar mask and sampling.

Memory: ``kv_bytes()`` gives the analytic per-sequence bytes of ``new_state`` (fixed +
per token; the engine's planner adds them to the target's) and ``new_state(max_tokens)``
caps a state's growing buffers at the engine's reservation, so the bytes a state
allocates (``nbytes_allocated()``) never exceed what was planned for it.

Every drafter subclasses :class:`Drafter`: the instance API above is abstract, and the
class declares what :mod:`xspec.build` reads before anything is loaded, with defaults:
``preflight(spec_cfg, model_cfg) -> list[str]`` (checkpoint problems from headers),
``draft_depth(spec_cfg, model_cfg) -> DraftDepth`` (its default gamma, the most it can
draft, the depth it was trained for: :func:`xspec.build.resolve_gamma` resolves and checks
a run's gamma from it, once), ``footprint(spec_cfg, model_cfg, gamma)`` (its weights and cache from headers, for the
memory check before loading),
``supports_adaptive`` (it can score its drafts for ``spec.adaptive``), and
``calibration`` / ``calibration_file`` (a loaded confidence calibration and its file).

Expert parallelism (``parallel.ep > 1``, refused unless ``supports_expert_parallel``):
ranks without work run the same MoE forwards (:mod:`xspec.parallel.lockstep`), so the
drafter declares ``moe_module`` (the draft model, or None), ``observe_forwards`` (its
forwards per ``observe``) and ``propose_forwards(num_tokens)``.

A drafter is constructed as ``cls(spec_cfg, *, target, model_cfg, platform, steps)``
with ``spec_cfg.num_speculative_tokens`` set to the resolved gamma (never null: build
resolves it before ``preflight`` and the constructor see the spec section), and passes ``steps`` (the platform's :class:`~xspec.models.base.StepOptions`: its ops and
compiler) to the constructors of the modules it builds. Its model family comes from
``xspec.registry.family_named(model_cfg.arch)``; a drafter never names a family.

Prefix caching (:mod:`xspec.engine.prefix_cache`): every drafter states what a cached
prompt boundary keeps of its state, through the abstract ``snapshot(state, start)`` (a
copy of what the state gained since the boundary ``start`` and of what its continuation
reads at the current one: MTP its last row's hidden state and logits and its own SWA
ring, DSpark its context rings and held-back captures, DFlash its context K/V) and
``restore(state, chain)``. A hit must continue exactly as the cold run: a drafter that
forgets a part of its state proposes other drafts (the engine tests compare them).

Checkpoint layer ids in ``capture_layer_ids`` are raw: the platform maps them to capture
points; drafters never add +1 themselves.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from xspec.models.base import Footprint, KvBytes
from xspec.sampling import SamplingParams

if TYPE_CHECKING:
    from xspec.models.base import StepOptions, TargetModel
    from xspec.platforms.base import Platform
    from xspec.spec.adaptive.calibration import ConfidenceCalibration
    from xspec.spec.constrained import DraftGuide
    from xspec.spec.processors import Processors


@dataclass(frozen=True)
class DraftDepth:
    """What a drafter states about gamma (draft tokens per step) before anything is loaded;
    :func:`xspec.build.resolve_gamma` resolves a run's gamma from it and checks it."""

    default: int  # drafted when spec.num_speculative_tokens is null
    maximum: int | None = None  # the most it can draft (0: never drafts; None: no own limit)
    trained: int | None = None  # what its weights were trained to draft per step, if known


@dataclass
class DraftProposal:
    """``num_tokens`` drafts per sequence, on the target's device."""

    tokens: torch.Tensor  # [B, num_tokens] int64
    probs: torch.Tensor | None = (
        None  # [B, num_tokens, V] float32 full q; None = deterministic drafts (one-hot q)
    )
    # [B, gamma] float32: the draft's own estimate of P(draft k accepted | drafts < k
    # accepted) (a confidence head); None when the method has none
    confidence: torch.Tensor | None = None


@dataclass
class CommittedRows:
    """The target rows committed since the last ``observe``, of every sequence, as one
    ragged batch (the layout of :class:`~xspec.models.base.ForwardBatch`): sequence b's
    ``seq_lens[b]`` rows are ``offsets[b] .. offsets[b+1]-1``, at positions
    ``starts[b] .. starts[b] + seq_lens[b] - 1``. A sequence may have no rows."""

    input_ids: torch.Tensor  # [N] tokens the target consumed at these positions
    next_ids: torch.Tensor  # [N] token at position + 1 (a sequence's last is its new anchor)
    hidden: torch.Tensor  # [N, ...] target pre-head hidden (DSv4: [N, hc, d])
    aux_hidden: torch.Tensor | None  # [N, K*d] at the drafter's capture layers, in order
    seq_lens: list[int]  # [B] rows per sequence, sum == N
    starts: list[int]  # [B] position of each sequence's first row (its state's num_tokens)

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.starts):
            raise ValueError("seq_lens and starts must have one entry per sequence")
        n = sum(self.seq_lens)
        rows = [self.input_ids, self.next_ids, self.hidden, self.aux_hidden]
        if any(t is not None and t.shape[0] != n for t in rows):
            raise ValueError(f"seq_lens sum to {n}; every row tensor needs {n} rows")

    @property
    def offsets(self) -> list[int]:
        """``[B+1]``: sequence b's rows are ``offsets[b] .. offsets[b+1]-1``."""
        return [0, *itertools.accumulate(self.seq_lens)]

    def positions(self) -> torch.Tensor:
        """Absolute position of every row: ``[N]`` int64 on the host."""
        parts = [
            torch.arange(p, p + n, dtype=torch.long) for p, n in zip(self.starts, self.seq_lens)
        ]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


@dataclass
class DraftRequest:
    """What ``propose`` needs to know about one running sequence."""

    anchor: int  # last committed token; the target has not seen it yet
    params: SamplingParams
    generator: torch.Generator | None  # the request's own generator (None: greedy)
    # Drafts this request can still use (its remaining token budget - 1): the step
    # verifies at most this many, so a drafter may stop early for it; informational.
    max_drafts: int
    # structured output, to a drafter that ``masks_inside``: the request's grammar along
    # the drafts (mask each position's logits with it, push each draft); None: free text
    guide: DraftGuide | None = None
    # penalties / logit_bias / min_tokens, caught up with the committed tokens: a drafter
    # that reads them proposes under them (:class:`~xspec.spec.processors.DraftProcessors`)
    processors: Processors | None = None


class Drafter(abc.ABC):
    """A speculative method: see the module docstring."""

    gamma: int  # draft tokens per step; 0 = no speculation
    capture_layer_ids: list[int]  # raw checkpoint layer ids of the aux hidden it consumes

    supports_adaptive: ClassVar[bool] = False  # spec.adaptive can schedule with it
    # structured output: it masks its own proposals with ``DraftRequest.guide``, position
    # by position (:mod:`xspec.spec.constrained`); else the step masks them afterwards
    masks_inside: ClassVar[bool] = False
    # spec.mask_drafts: drafts follow the grammar (false: proposed unmasked; the verify
    # rows stay masked, outputs are the same). A drafter sets it from its spec section.
    mask_drafts: bool = True
    # drafts proposed under the request's processors (``DraftRequest.processors``); false:
    # without them, as before (outputs are the same; tests and benchmarks compare)
    process_drafts: bool = True
    calibration: ConfidenceCalibration | None = None  # its confidence calibration, if any
    calibration_file: Path | None = None  # where ``calibration`` was read from

    @abc.abstractmethod
    def __init__(
        self,
        spec_cfg: Any,
        *,
        target: TargetModel,
        model_cfg: Any,
        platform: Platform,
        steps: StepOptions,
    ) -> None:
        """Load the draft for ``target`` (the ``spec`` and ``model`` config sections);
        ``platform`` answers device questions, ``steps`` is the platform's
        :class:`~xspec.models.base.StepOptions`, shared with the target."""

    # -- before anything is loaded (xspec.build.check) ---------------------------------

    @classmethod
    def preflight(cls, spec_cfg: Any, model_cfg: Any) -> list[str]:
        """Every problem of this method for this model, from configs and headers only."""
        return []

    @classmethod
    def draft_depth(cls, spec_cfg: Any, model_cfg: Any) -> DraftDepth:
        """Its default gamma (1 unless a drafter says otherwise), the most it can draft and
        the depth it was trained for, from configs and headers only."""
        return DraftDepth(default=1)

    @classmethod
    def footprint(cls, spec_cfg: Any, model_cfg: Any, gamma: int) -> Footprint | None:
        """The draft's own tensors and per-sequence cache at ``gamma``, from headers only
        (:class:`~xspec.models.base.Footprint`; the memory check before loading). None:
        not known before loading (the check counts the target alone; the plan after
        loading counts everything). Called only when :meth:`preflight` found nothing."""
        return None

    # -- expert parallelism: MoE forwards per call (xspec/parallel/lockstep.py) ----------

    supports_expert_parallel: ClassVar[bool] = False  # declares the three members below
    observe_forwards: ClassVar[int] = 0  # MoE forwards of ``moe_module`` per observe

    @staticmethod
    def propose_forwards(num_tokens: int) -> int:
        """MoE forwards of ``moe_module`` per ``propose(..., num_tokens)``."""
        return 0

    @property
    def moe_module(self) -> torch.nn.Module | None:
        """The module whose MoE layers its forwards run (None: no draft model)."""
        return None

    # -- the decode loop -----------------------------------------------------------------

    @abc.abstractmethod
    def new_state(self, max_tokens: int | None = None) -> Any:
        """A sequence's empty draft state (``None`` when the method keeps none);
        ``max_tokens`` caps its growing buffers like ``TargetModel.new_state``. A state
        that is not None exposes ``nbytes_allocated()``."""

    @abc.abstractmethod
    def kv_bytes(self) -> KvBytes:
        """Analytic per-sequence bytes of :meth:`new_state` (``KvBytes()`` for none)."""

    @abc.abstractmethod
    def snapshot(self, state: Any, start: int) -> Any:
        """A prefix-cache snapshot of ``state`` at a prompt block boundary ``b``, having
        observed the rows before ``b - 1`` (the last row waits: its next token is not
        part of the prefix): a copy of what it gained since it had observed ``start`` rows
        (the previous snapshot's) and of everything a continuation reads; ``state`` is
        left unchanged. None for a method without state; else an object with ``nbytes()``."""

    @abc.abstractmethod
    def restore(self, state: Any, chain: Sequence[Any]) -> Any:
        """Fill the empty ``state`` (from :meth:`new_state`) with ``chain``, the snapshots
        of consecutive blocks from position 0, and return it: the state the last one was
        taken of, bit for bit."""

    @abc.abstractmethod
    def observe(self, states: list[Any], rows: CommittedRows) -> None:
        """Take in the rows committed since the last call (see the module docstring)."""

    @abc.abstractmethod
    def propose(
        self, states: list[Any], requests: list[DraftRequest], num_tokens: int
    ) -> DraftProposal:
        """``num_tokens`` drafts per sequence (see the module docstring)."""
