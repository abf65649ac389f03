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

Not covered by the plan (documented, not hidden): the prefill's transient logits
``[prompt chunk rows, V]`` and activations, the allocator's own fragmentation, and a
DeepSeek-V4 ring stack that outlives a finished sequence until its batch-mates restack
(``state.Ring``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from xspec.errors import ConfigError, MemoryBudgetError
from xspec.models.base import KvBytes, TargetModel, modules_of
from xspec.spec.drafter import Drafter

# Verify-step activations kept per scored row besides the vocabulary-wide rows: fp32
# hidden-size vectors (DeepSeek-V4 keeps hc_mult=4 residual streams, plus attention and
# MoE temporaries). An estimate, deliberately generous.
HIDDEN_COPIES_PER_ROW = 16
FP32 = 4


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
