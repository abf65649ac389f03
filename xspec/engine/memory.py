"""The memory planner and the engine's reservation pool.

**Plan** (before any sequence runs): the budget (``engine.memory_budget``: bytes, or a
fraction of the device memory free *before* the weights were loaded) minus the weights
(parameter and buffer bytes of target and drafter, shared tensors once) is what KV
caches and step workspaces may use. Per sequence, the target and the drafter each
report analytic :class:`~xspec.models.base.KvBytes` (``fixed`` + ``per_token``); the
verify step adds a workspace per running sequence (:func:`verify_workspace`). A request
of ``P`` prompt and ``N`` new tokens is charged for ``P + N + gamma`` tokens:

    seq_bytes = target.at(P + N + gamma) + draft.at(P + N + gamma) + workspace

**Pool** (:class:`ReservationPool`): admission reserves ``seq_bytes`` and completion
frees it; the engine admits a request only when its reservation fits, so the sum of
reservations never exceeds ``budget - weights``. What is *reserved* is that worst case;
what is *allocated* grows lazily inside it: states are built with
``new_state(max_tokens=P + N + gamma)``, which caps their growing buffers at that
length, so a state's allocated bytes never exceed its reservation (tested within 2% at
full length).

**Before loading** (:class:`LayoutPlan`): the same plan per expert-parallel rank, with
the weights counted from the checkpoints' safetensors headers instead of the loaded
modules (:class:`~xspec.models.base.Footprint`: stored bytes per format, quantised
weights with their scales; routed experts split among the ``parallel.ep`` ranks as
:mod:`xspec.parallel.expert` shards them, everything else replicated). ``build.check``
refuses a run whose weights plus one sequence do not fit before any tensor is read, and
``python -m xspec.plan`` prints it for a DP x EP layout without loading anything.

Not covered by the plan (documented, not hidden): the prefill's transient activations
(not its logits: one row per prompt, ``ForwardBatch.logit_rows``), the allocator's own
fragmentation, and a DeepSeek-V4 ring stack that outlives a finished sequence until its
batch-mates restack (``state.Ring``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from xspec.errors import ConfigError, MemoryBudgetError
from xspec.models.base import Footprint, KvBytes, TargetModel, modules_of
from xspec.parallel.expert import expert_of
from xspec.parallel.topology import expert_range
from xspec.spec.drafter import Drafter

# Verify-step activations kept per scored row besides the vocabulary-wide rows: fp32
# hidden-size vectors (DeepSeek-V4 keeps hc_mult=4 residual streams, plus attention and
# MoE temporaries). An estimate, deliberately generous.
HIDDEN_COPIES_PER_ROW = 16
FP32 = 4
GIB = 1 << 30


def verify_workspace(vocab_size: int, hidden_size: int, gamma: int) -> int:
    """Bytes one sequence adds to a verify step at full gamma (an estimate).

    Per scored row (gamma + 1 of them): fp32 logits, their probabilities and the padded
    ``p [B, gamma+1, V]`` copy (3 x V x 4 B) plus ``HIDDEN_COPIES_PER_ROW`` fp32 hidden
    rows; per draft (gamma): the draft's full distribution q ``[V]`` fp32 (sampled
    drafts)."""
    rows = gamma + 1
    return rows * (3 * vocab_size + HIDDEN_COPIES_PER_ROW * hidden_size) * FP32 + (
        gamma * vocab_size * FP32
    )


def weight_bytes(*objects: Any) -> int:
    """Parameter and buffer bytes of every ``nn.Module`` among ``objects`` and their
    attributes (a drafter holds its modules as attributes); shared tensors count once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for module in modules_of(objects):
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_meta:  # shape-only modules hold no memory
                continue
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def allocated_bytes(state: Any) -> int:
    """Bytes a target or draft state holds now (0 for a method without state)."""
    return 0 if state is None else int(state.nbytes_allocated())


def context_problem(
    prompt_len: int, max_new_tokens: int, gamma: int, max_context: int
) -> str | None:
    """Why a request can never fit the model's context (its draft rows included), or None."""
    if prompt_len + max_new_tokens + gamma <= max_context:
        return None
    return (
        f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} (+ {gamma} draft "
        f"rows) exceeds the model context of {max_context} tokens; shorten the prompt, lower "
        f"max_new_tokens, or raise model.max_context"
    )


@dataclass(frozen=True)
class MemoryPlan:
    budget: int  # bytes for weights + caches + workspace
    weights: int  # target + drafter parameters and buffers
    target: KvBytes  # per sequence
    draft: KvBytes  # per sequence
    workspace: int  # verify step at full gamma, per running sequence
    gamma: int
    max_context: int

    @property
    def available(self) -> int:
        """Bytes for the reservations (caches + workspace): budget minus weights."""
        return self.budget - self.weights

    def seq_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        """Tokens a request is charged for: prompt + max_new_tokens + gamma draft rows."""
        return prompt_len + max_new_tokens + self.gamma

    def seq_kv_bytes(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache bytes (target + draft) of a request at its full length."""
        n = self.seq_tokens(prompt_len, max_new_tokens)
        return self.target.at(n) + self.draft.at(n)

    def seq_bytes(self, prompt_len: int, max_new_tokens: int) -> int:
        """A request's reservation: its caches at full length + its verify workspace."""
        return self.seq_kv_bytes(prompt_len, max_new_tokens) + self.workspace

    def max_seqs(self, prompt_len: int, max_new_tokens: int) -> int:
        """Concurrent sequences of this length the budget holds."""
        return max(0, self.available) // self.seq_bytes(prompt_len, max_new_tokens)

    def problem(self, prompt_len: int, max_new_tokens: int) -> str | None:
        """Why a request of this length can never run (None: it fits when the pool is free)."""
        n = self.seq_tokens(prompt_len, max_new_tokens)
        if problem := context_problem(prompt_len, max_new_tokens, self.gamma, self.max_context):
            return problem
        need = self.seq_bytes(prompt_len, max_new_tokens)
        if need > self.available:
            return (
                f"needs {need} bytes of KV cache and workspace ({n} tokens) but the memory plan "
                f"has {max(0, self.available)} bytes after the weights; shorten the prompt, "
                f"lower max_new_tokens, or raise engine.memory_budget"
            )
        return None

    def block_bytes(self, block: int) -> int:
        """Bytes one prefix-cache block holds at most: a sequence's state (target and
        draft) of ``block`` tokens, its fixed-size parts included."""
        return self.target.at(block) + self.draft.at(block)

    def check_one_sequence(self) -> None:
        """MemoryBudgetError unless one minimal sequence (1 prompt + 1 new token) fits."""
        need = self.weights + self.seq_bytes(1, 1)
        if need > self.budget:
            raise MemoryBudgetError(
                f"engine.memory_budget: {self.budget} bytes available but at least {need} are "
                f"needed (weights {self.weights} + one sequence {self.seq_bytes(1, 1)}); raise "
                f"engine.memory_budget (bytes, or a fraction of free memory in (0, 1])"
            )

    def describe(self, prompt_len: int, max_new_tokens: int, concurrency: int) -> str:
        """The compact start-up block."""
        n = self.seq_tokens(prompt_len, max_new_tokens)
        seqs = self.max_seqs(prompt_len, max_new_tokens)
        t, d = self.target, self.draft
        return "\n".join(
            [
                f"memory plan: budget {_b(self.budget)} = weights {_b(self.weights)} "
                f"+ {_b(max(0, self.available))} for caches and workspace",
                f"  per sequence: fixed {_b(t.fixed + d.fixed)} (target {_b(t.fixed)}, draft "
                f"{_b(d.fixed)}) + {t.per_token + d.per_token:.0f} B/token (target "
                f"{t.per_token:.0f}, draft {d.per_token:.0f}) + verify workspace "
                f"{_b(self.workspace)} (gamma {self.gamma})",
                f"  workload: {prompt_len} prompt + {max_new_tokens} new + {self.gamma} draft = "
                f"{n} tokens -> {_b(self.seq_bytes(prompt_len, max_new_tokens))}/sequence, "
                f"at most {seqs} concurrent sequences ({seqs * n} tokens); concurrency "
                f"{concurrency}",
            ]
        )


PREFIX_CACHE_SHARE = 0.25  # of the plan's memory for caches, when prefix_cache_gib is null


def cache_capacity(engine: Any, plan: MemoryPlan) -> int:
    """Bytes the prefix cache may hold (``engine.prefix_cache_gib``, else a share of the
    plan's memory for caches and workspace)."""
    if engine.prefix_cache_gib is not None:
        return int(engine.prefix_cache_gib * GIB)
    return int(PREFIX_CACHE_SHARE * max(0, plan.available))


def _b(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def resolve_budget(value: float | None, free_bytes: int, weights: int, default: float) -> int:
    """Bytes from ``engine.memory_budget``: > 1 is bytes; (0, 1] a fraction of the memory
    free before the weights were loaded (``free_bytes`` now + ``weights``); None the
    platform's default fraction."""
    if value is None:
        value = default
    if value <= 0:
        raise ConfigError(f"engine.memory_budget must be > 0 (got {value})")
    if value <= 1:
        return int(value * (free_bytes + weights))
    return int(value)


def budget_of(engine: Any, free_before: int, default: float) -> tuple[int, str]:
    """(bytes, where they come from) of the ``engine`` section's budget: bytes as given
    (``memory_budget`` > 1), else a fraction (null: the platform's ``default``) of
    ``device_memory_gib`` when set, else of ``free_before`` (the memory free before the
    weights were loaded)."""
    value, device = engine.memory_budget, engine.device_memory_gib
    if value is not None and value > 1:
        return int(value), f"engine.memory_budget={value:.0f}"
    total = free_before if device is None else int(device * GIB)
    fraction = default if value is None else value
    setting = "engine.memory_budget" if value is not None else "the platform's default"
    what = "the free memory" if device is None else f"engine.device_memory_gib={device:g}"
    budget = resolve_budget(fraction, total, 0, default)
    return budget, f"{setting} {fraction:g} x {what} ({_b(total)})"


class LayoutPlan:
    """The memory plan of every EP rank of a ``dp`` x ``ep`` layout over ``world`` ranks,
    before anything is loaded: weights from the headers (``target`` and ``draft``
    :class:`~xspec.models.base.Footprint`), KV and verify workspace analytic, the same
    ``budget`` per rank. Rank ``r`` of the world is EP rank ``r % ep``; the ranks of a DP
    replica decode the same sequences, so each holds their KV. ``draft`` None: the
    drafter's share is not known before loading (counted as nothing)."""

    def __init__(
        self,
        target: Footprint,
        draft: Footprint | None,
        *,
        gamma: int,
        budget: int,
        budget_source: str,
        dp: int = 1,
        ep: int = 1,
        world: int | None = None,
    ) -> None:
        self.target, self.draft, self.gamma = target, draft, gamma
        self.budget, self.budget_source = budget, budget_source
        self.dp, self.ep = dp, ep
        self.world = world if world is not None else math.lcm(dp, ep)
        self.replicated: dict[str, int] = {}  # format -> bytes every rank holds
        self.experts: list[dict[str, int]] = [{} for _ in range(ep)]  # per EP rank
        for part in [target] if draft is None else [target, draft]:
            ranks = self._rank_of_expert(part.num_experts)
            for name, (fmt, nbytes) in part.tensors.items():
                expert = expert_of(name)
                held = self.replicated if expert is None else self.experts[ranks[expert]]
                held[fmt] = held.get(fmt, 0) + nbytes

    def _rank_of_expert(self, num_experts: int | None) -> dict[int, int]:
        if not num_experts:
            return {}
        return {e: r for r in range(self.ep) for e in expert_range(r, self.ep, num_experts)}

    def weights(self, ep_rank: int) -> dict[str, int]:
        """Bytes by format EP rank ``ep_rank`` holds: the replicated tensors + its experts."""
        out = dict(self.replicated)
        for fmt, nbytes in self.experts[ep_rank].items():
            out[fmt] = out.get(fmt, 0) + nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def routed_experts(self) -> int:
        """Bytes of every routed expert (all EP ranks together)."""
        return sum(sum(held.values()) for held in self.experts)

    def rank_plan(self, ep_rank: int) -> MemoryPlan:
        """:class:`MemoryPlan` of EP rank ``ep_rank`` (its weights counted from headers)."""
        t = self.target
        return MemoryPlan(
            budget=self.budget,
            weights=sum(self.weights(ep_rank).values()),
            target=t.kv,
            draft=self.draft.kv if self.draft is not None else KvBytes(),
            workspace=verify_workspace(t.vocab_size, t.hidden_size, self.gamma),
            gamma=self.gamma,
            max_context=t.max_context,
        )

    def heaviest(self) -> int:
        """The EP rank holding the most weight bytes (the one that fits last)."""
        return max(range(self.ep), key=lambda r: sum(self.weights(r).values()))

    def problem(self, dtype: str) -> str | None:
        """Why the heaviest rank cannot hold its weights plus one short sequence (1 prompt
        + 1 new token + gamma draft rows, KV + verify workspace), or None. ``dtype``: the
        model dtype, named in the advice."""
        r = self.heaviest()
        plan = self.rank_plan(r)
        one = plan.seq_bytes(1, 1)
        need = plan.weights + one
        if need <= self.budget:
            return None
        t, d = plan.target, plan.draft
        fixes = []
        if self.routed_experts:
            fixes.append(
                f"raise parallel.ep (now {self.ep}; the routed experts are "
                f"{_b(self.routed_experts)} of the weights, divided among the EP ranks)"
            )
        fixes += [
            "raise engine.memory_budget (bytes, or a fraction of engine.device_memory_gib / "
            "the free memory)",
            f"or use a narrower model.dtype (now {dtype}: KV caches and float weights)",
        ]
        rank = f" on EP rank {r} of {self.ep}" if self.ep > 1 else ""
        return (
            f"engine.memory_budget: {self.budget} bytes available but at least {need} are "
            f"needed{rank}, so the run is refused before any tensor is read: weights "
            f"{_b(plan.weights)} counted from the checkpoint headers ({_formats(self.weights(r))})"
            f" + one sequence {_b(one)} (KV {t.per_token + d.per_token:.0f} B/token: target "
            f"{t.per_token:.0f}, draft {d.per_token:.0f}; fixed {_b(t.fixed + d.fixed)}; verify "
            f"workspace {_b(plan.workspace)}); budget {_b(self.budget)} = {self.budget_source}. "
            f"To fix: {', '.join(fixes)}"
        )

    def ranks(self, context: int) -> list[dict[str, Any]]:
        """Per EP rank, JSON-ready: the world ranks it stands for, weights by format, what
        is left for KV, bytes per sequence and the most sequences at ``context`` tokens
        (prompt + generated; each is charged ``context + gamma``)."""
        out = []
        for r in range(self.ep):
            plan = self.rank_plan(r)
            out.append(
                {
                    "ep_rank": r,
                    "ranks": list(range(r, self.world, self.ep)),
                    "weights": self.weights(r),
                    "weights_total": plan.weights,
                    "available": max(0, plan.available),
                    "seq_bytes": plan.seq_bytes(context, 0),
                    "max_sequences": plan.max_seqs(context, 0),
                }
            )
        return out

    def to_json(self, context: int) -> dict[str, Any]:
        """The plan as data (``python -m xspec.plan --json``)."""
        ranks = self.ranks(context)
        t, d = self.target.kv, self.draft.kv if self.draft is not None else KvBytes()
        per_replica = min(row["max_sequences"] for row in ranks)
        return {
            "layout": {"world": self.world, "dp": self.dp, "ep": self.ep},
            "budget": self.budget,
            "budget_source": self.budget_source,
            "gamma": self.gamma,
            "context": context,
            "kv": {
                "target": {"fixed": t.fixed, "per_token": t.per_token},
                "draft": {"fixed": d.fixed, "per_token": d.per_token},
                "draft_known": self.draft is not None,
            },
            "verify_workspace": self.rank_plan(0).workspace,
            "routed_experts": self.routed_experts,
            "ranks": ranks,
            "max_sequences_per_replica": per_replica,
            "max_sequences": per_replica * self.dp,
        }

    def describe(self, context: int) -> str:
        """The printed plan: layout, budget, KV per sequence, one row per EP rank."""
        data = self.to_json(context)
        t, d = self.target.kv, self.draft.kv if self.draft is not None else KvBytes()
        replica = self.world // self.dp
        experts = self.target.num_experts
        share = f" (each {experts // self.ep} of {experts} routed experts)" if experts else ""
        lines = [
            "memory plan before loading (config.json and safetensors headers; no tensor read)",
            f"  layout: {self.world} ranks = {self.dp} DP replica(s) x {replica} rank(s); EP "
            f"groups of {self.ep}{share}",
            f"  budget per rank: {_b(self.budget)} ({self.budget_source})",
            f"  KV per sequence: {t.per_token + d.per_token:.0f} B/token (target "
            f"{t.per_token:.0f}, draft {d.per_token:.0f}) + fixed {_b(t.fixed + d.fixed)} "
            f"(target {_b(t.fixed)}, draft {_b(d.fixed)})"
            + ("" if self.draft is not None else " [draft weights and KV unknown before loading]"),
            f"  verify workspace {_b(data['verify_workspace'])} per sequence (gamma {self.gamma})",
            f"  at {context} tokens per sequence (+ {self.gamma} draft rows): "
            f"{_b(data['ranks'][0]['seq_bytes'])} per sequence",
        ]
        for row in data["ranks"]:
            ranks = row["ranks"]
            which = ", ".join(map(str, ranks[:4])) + (", ..." if len(ranks) > 4 else "")
            lines.append(
                f"  EP rank {row['ep_rank']} (ranks {which}): weights "
                f"{_b(row['weights_total'])} = {_formats(row['weights'])}; "
                f"{_b(row['available'])} left -> at most {row['max_sequences']} sequences"
            )
        lines.append(
            f"  largest concurrency at {context} tokens: {data['max_sequences_per_replica']} "
            f"per DP replica, {data['max_sequences']} in all ({self.dp} replica(s))"
        )
        return "\n".join(lines)


def _formats(weights: dict[str, int]) -> str:
    return ", ".join(f"{fmt} {_b(n)}" for fmt, n in weights.items()) or "none"


def plan_memory(target: TargetModel, drafter: Drafter, budget: int, weights: int) -> MemoryPlan:
    """The plan for this target + drafter under ``budget`` bytes (weights included)."""
    return MemoryPlan(
        budget=budget,
        weights=weights,
        target=target.kv_bytes(),
        draft=drafter.kv_bytes(),
        workspace=verify_workspace(target.vocab_size, target.hidden_size, drafter.gamma),
        gamma=drafter.gamma,
        max_context=target.max_context,
    )


class ReservationPool:
    """Bytes reserved by the running requests; never more than ``capacity``."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity  # math.inf: no limit
        self.held: dict[Hashable, int] = {}  # request id -> bytes
        self.reserved = 0
        self.peak = 0

    def try_reserve(self, key: Hashable, nbytes: int) -> bool:
        if self.reserved + nbytes > self.capacity:
            return False
        self.held[key] = nbytes
        self.reserved += nbytes
        self.peak = max(self.peak, self.reserved)
        return True

    def release(self, key: Hashable) -> None:
        self.reserved -= self.held.pop(key)
