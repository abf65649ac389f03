"""How many tokens each sequence drafts and verifies: the one object the step asks.

:func:`xspec.spec.step.decode_step` asks its :class:`DepthPolicy` at three points of
every decode step:

1. ``decide(seqs, caps)``, before drafting: each sequence's depth in ``[0, caps[b]]``
   (``caps[b]``: the drafter's gamma, within what the sequence can still commit);
   ``drafting(depths)`` then names the sequences the draft forward runs for;
2. ``trim(confidence, depths)``, after drafting, when the drafter scored its drafts
   (``confidence [B, width]``): the drafts each sequence verifies, a prefix of its depth;
3. ``observe(seqs, verified, accepted)``, after the step: what was verified and accepted.

``predicted(confidence)`` is the per-position acceptance the step's metrics record as
predicted, and ``summary()`` the plain figures a run reports (results.json, the CLI).

:class:`FixedDepth` (the default) drafts gamma for every sequence, every step.
``spec.adaptive`` / ``spec.gamma_schedule`` build
:class:`~xspec.spec.adaptive.AdaptiveDepth` instead (:mod:`xspec.build` picks one).

A policy's per-request state (e.g. acceptance histories) lives on the running sequence,
in ``depth_state``: an opaque slot the policy owns (None until its first ``decide`` of
that sequence), which ends with the request. Under expert parallelism every rank must
draft the iteration's agreed width for all of its sequences (:mod:`xspec.parallel.lockstep`);
only a policy with ``lockstep_safe`` (its depths are the caps) may run there, and the
engine refuses any other.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch

from xspec.sampling import SamplingParams

__all__ = ["DepthPolicy", "FixedDepth", "PolicySeq"]


class PolicySeq(Protocol):
    """What a policy reads of a running sequence (:class:`xspec.spec.step.RunningSeq`)."""

    depth_state: Any  # the policy's own per-request state (None before its first decide)

    @property
    def params(self) -> SamplingParams: ...

    @property
    def regime(self) -> str: ...  # :func:`xspec.sampling.regime_of` of ``params``


class DepthPolicy(abc.ABC):
    """How deep each sequence drafts and verifies (the module docstring)."""

    lockstep_safe: ClassVar[bool] = False  # its depths are the caps: it can run under EP

    @abc.abstractmethod
    def decide(self, seqs: Sequence[PolicySeq], caps: list[int]) -> list[int]:
        """Before drafting: drafts per sequence, ``0 <= depth <= caps[b]``."""

    def drafting(self, depths: list[int]) -> list[int]:
        """The sequences (indices) the draft forward runs for: those given a depth."""
        return [b for b, d in enumerate(depths) if d > 0]

    def trim(self, confidence: torch.Tensor, depths: list[int]) -> list[int]:
        """After drafting: ``confidence [B, width]`` (the draft's estimates of each
        position's conditional acceptance) -> drafts verified per sequence, each at
        most its depth. The default verifies them all."""
        return depths

    def observe(self, seqs: Sequence[PolicySeq], verified: list[int], accepted: list[int]) -> None:
        """After the step: drafts verified and accepted per sequence (the default
        learns nothing)."""
        return None

    def predicted(self, confidence: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, width]`` the conditional acceptance per verified position this step
        went by (the metrics' "predicted"), or None: the draft's own by default."""
        return confidence

    def summary(self) -> dict[str, Any] | None:
        """Plain figures of what the policy learnt over the run (None: nothing)."""
        return None


class FixedDepth(DepthPolicy):
    """Fixed gamma: every sequence drafts its cap and verifies every draft. All of them
    run the draft forward, also one at its last token (cap 0), so the draft batch is
    the running batch, as lockstep needs."""

    lockstep_safe = True

    def decide(self, seqs: Sequence[PolicySeq], caps: list[int]) -> list[int]:
        return list(caps)

    def drafting(self, depths: list[int]) -> list[int]:
        return list(range(len(depths)))
