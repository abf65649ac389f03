"""Speculative-decoding metrics: Prometheus counters and the acceptance report.

Every method, the no-spec baseline included, records a decode step the same way: from
the committed output matrix the verifier returned (``[B, gamma+1]``, -1 padded) and the
number of draft tokens each row carried. Deriving everything from what was committed
avoids the per-method bookkeeping bugs peers have (a correction token counted as an
accepted draft, per-position counters never updated for one method).

Semantics follow vLLM's ``vllm:spec_decode_*`` counters:

- ``num_drafts``: verify rows that carried >= 1 draft token;
- ``num_draft_tokens``: draft tokens sent to verification;
- ``num_accepted_tokens``: accepted draft tokens = committed - 1 per row (the
  correction/bonus token is never counted, rejected or not);
- ``num_committed_tokens``: every committed token (accepted + 1 per row);
- ``num_accepted_tokens_per_pos{position=k}``: rows whose accepted prefix has >= k+1
  tokens, so ``per_pos[k] / num_drafts`` is the survival probability through k;
- gauge ``mean_tokens_per_step``: committed tokens / row-steps so far;
- gauge ``acceptance_length``: :func:`acceptance_length` so far, vLLM's and SGLang's
  figure (SGLang exports it as ``sglang:spec_accept_length``; vLLM derives it from
  ``1 + num_accepted_tokens / num_drafts``);
- ``num_target_rows``: rows the target scored in verification (anchor + verified drafts
  per row; xspec's, for adaptive verification), ``num_wasted_target_rows``: verified
  drafts that were rejected (draft tokens - accepted tokens).

A baseline row (0 draft tokens) commits one token: it adds to committed tokens and
row-steps, never to drafts.

Two "lengths" differ by exactly 1, and dashboards mean the second one:
``mean_accepted_length`` = accepted / drafts (xspec's: draft tokens a drafting row keeps)
and ``acceptance_length`` = 1 + accepted / drafts (vLLM's and SGLang's: tokens a drafting
row commits per step, the correction/bonus token included). docs/metrics.md has the table.

The speculation decision (``spec.adaptive`` / ``spec.gamma_schedule``, docs/adaptive.md)
adds: ``speculation_depth{depth=k}``, request-steps whose depth was decided as k before
drafting (0: it drafted nothing); ``num_steps_without_drafts``, decode steps where no
request drafted (no draft forward ran); and per sampling regime
``regime_{draft_tokens,predicted_accepted,accepted}_tokens{regime=...}``: the verified
draft tokens, the acceptance predicted for them (the sum over verified positions of
``prod c_i``) and the accepted ones.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge
from torch import Tensor

from xspec.acceptance import SpecCounts, acceptance_length

__all__ = ["AcceptanceReport", "SpecDecodeMetrics", "acceptance_length"]

_PREFIX = "xspec_spec_decode"


def _ratio(num: float, den: float) -> float:
    """num / den, defined as 0.0 when nothing was drafted (den == 0): no NaN in reports."""
    return num / den if den else 0.0


@dataclass(frozen=True)
class AcceptanceReport:
    """Totals and derived rates. Rates over drafts are 0.0 when there were no drafts."""

    num_steps: int  # observe_step calls (decode steps)
    num_row_steps: int  # verify rows over all steps (requests x steps)
    num_drafts: int  # rows that carried >= 1 draft token
    num_draft_tokens: int
    num_accepted_tokens: int  # bonus/correction excluded
    num_committed_tokens: int  # accepted + 1 per row
    num_full_blocks: int  # rows with drafts that accepted all of them
    num_zero_accepts: int  # rows with drafts that accepted none
    accepted_per_position: list[int]  # [k] rows whose accepted prefix has >= k+1 tokens
    acceptance_rate: float  # accepted / draft tokens
    mean_accepted_length: float  # accepted / drafts (bonus excluded; vLLM's "length" is this + 1)
    acceptance_length: float  # 1 + accepted / drafts: vLLM's / SGLang's (bonus included)
    mean_tokens_per_step: float  # committed / row-steps: tokens per request per step
    survival: list[float]  # accepted_per_position[k] / drafts
    full_block_fraction: float  # full blocks / drafts
    zero_accept_fraction: float  # zero accepts / drafts
    # per position k, over rows whose draft had a confidence head and >= k+1 drafts:
    # (mean predicted survival prod_{i<=k} c_i, realised fraction accepting >= k+1); empty
    # when no draft reported confidences
    calibration: list[tuple[float, float]] = field(default_factory=list)
    # target rows verification scored: the anchor + the verified drafts of every row
    num_target_rows: int = 0
    mean_target_rows: float = 0.0  # target rows per row-step (1.0 without drafts)
    # verified drafts the target rejected: rows that bought nothing (drafts - accepted)
    num_wasted_target_rows: int = 0
    # over rows with confidences: the draft's expected accepted tokens (sum of prod c_i over
    # the verified positions) and the realised ones, per draft token; None without a head
    predicted_acceptance_rate: float | None = None
    realised_acceptance_rate: float | None = None
    # request-steps per decided speculation depth (index = depth; 0 = drafted nothing)
    depth_histogram: list[int] = field(default_factory=list)
    num_steps_without_drafts: int = 0  # decode steps in which no request drafted
    # per sampling regime: {draft_tokens, predicted_rate, realised_rate}
    regimes: dict[str, dict[str, float]] = field(default_factory=dict)

    def format(self) -> str:
        """A small aligned two-column table (each line is explained in docs/metrics.md)."""
        rows: list[tuple[str, str]] = [
            ("decode steps", str(self.num_steps)),
            ("verify rows", str(self.num_row_steps)),
            ("drafts (rows with drafts)", str(self.num_drafts)),
            ("draft tokens", str(self.num_draft_tokens)),
            ("accepted tokens", str(self.num_accepted_tokens)),
            ("committed tokens", str(self.num_committed_tokens)),
            ("acceptance rate", f"{self.acceptance_rate:.4f}"),
            ("mean accepted length", f"{self.mean_accepted_length:.4f}"),
            ("acceptance length (vLLM)", f"{self.acceptance_length:.4f}"),
            ("mean tokens per step", f"{self.mean_tokens_per_step:.4f}"),
            ("full-block fraction", f"{self.full_block_fraction:.4f}"),
            ("zero-accept fraction", f"{self.zero_accept_fraction:.4f}"),
            ("target rows per request-step", f"{self.mean_target_rows:.4f}"),
            ("wasted target rows", str(self.num_wasted_target_rows)),
        ]
        if self.predicted_acceptance_rate is not None:
            rows.append(
                (
                    "acceptance predicted/realised",
                    f"{self.predicted_acceptance_rate:.4f} / {self.realised_acceptance_rate:.4f}",
                )
            )
        if self.depth_histogram:
            rows.append(("speculation depth (request-steps)", _histogram(self.depth_histogram)))
            rows.append(("steps without drafts", str(self.num_steps_without_drafts)))
        rows += [
            (
                f"acceptance {name} predicted/realised",
                f"{r['predicted_rate']:.4f} / {r['realised_rate']:.4f}",
            )
            for name, r in sorted(self.regimes.items())
        ]
        rows += [
            (f"survival[{k}]", f"{s:.4f}  ({c})")
            for k, (s, c) in enumerate(zip(self.survival, self.accepted_per_position))
        ]
        rows += [
            (f"confidence[{k}]", f"predicted {p:.4f}  realised {r:.4f}")
            for k, (p, r) in enumerate(self.calibration)
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


class SpecDecodeMetrics:
    """Counters for one engine. Owns its registry unless one is given, so several
    engines (or tests) in one process never collide on metric names."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        reg = self.registry
        # prometheus_client appends "_total" to counter names in the exposition.
        self._drafts = Counter(
            f"{_PREFIX}_num_drafts", "Verify rows with >= 1 draft token", registry=reg
        )
        self._draft_tokens = Counter(
            f"{_PREFIX}_num_draft_tokens", "Draft tokens verified", registry=reg
        )
        self._accepted = Counter(
            f"{_PREFIX}_num_accepted_tokens", "Accepted draft tokens (bonus excluded)", registry=reg
        )
        self._committed = Counter(
            f"{_PREFIX}_num_committed_tokens",
            "Committed tokens (accepted + 1 per row)",
            registry=reg,
        )
        self._per_pos = Counter(
            f"{_PREFIX}_num_accepted_tokens_per_pos",
            "Rows whose accepted prefix has >= position+1 tokens",
            ["position"],
            registry=reg,
        )
        self._predicted_per_pos = Counter(
            f"{_PREFIX}_predicted_accepted_tokens_per_pos",
            "Sum of the draft's predicted survival prod_{i<=position} c_i (confidence head)",
            ["position"],
            registry=reg,
        )
        self._target_rows = Counter(
            f"{_PREFIX}_num_target_rows",
            "Target rows scored by verification (anchor + verified drafts per row)",
            registry=reg,
        )
        self._wasted_rows = Counter(
            f"{_PREFIX}_num_wasted_target_rows",
            "Verified draft rows the target rejected (draft tokens - accepted tokens)",
            registry=reg,
        )
        self._depth = Counter(
            f"{_PREFIX}_speculation_depth",
            "Request-steps whose speculation depth was decided as depth (0: no draft)",
            ["depth"],
            registry=reg,
        )
        self._no_draft_steps = Counter(
            f"{_PREFIX}_num_steps_without_drafts",
            "Decode steps in which no request drafted (no draft forward)",
            registry=reg,
        )
        self._regime_counters = {
            key: Counter(
                f"{_PREFIX}_regime_{key}_tokens",
                doc,
                ["regime"],
                registry=reg,
            )
            for key, doc in (
                ("draft", "Verified draft tokens, per sampling regime"),
                ("predicted_accepted", "Predicted accepted draft tokens, per sampling regime"),
                ("accepted", "Accepted draft tokens, per sampling regime"),
            )
        }
        self._tokens_per_step = Gauge(
            f"{_PREFIX}_mean_tokens_per_step",
            "Committed tokens per verify row so far",
            registry=reg,
        )
        self._acceptance_length = Gauge(
            f"{_PREFIX}_acceptance_length",
            "1 + accepted tokens / drafts so far (vLLM's and SGLang's acceptance length)",
            registry=reg,
        )
        # the prefix cache, in prompt tokens (as vLLM's prefix_cache_queries / _hits)
        self._prefix_queries = Counter(
            "xspec_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=reg,
        )
        self._prefix_hits = Counter(
            "xspec_prefix_cache_hits", "Prompt tokens restored from the prefix cache", registry=reg
        )
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Python totals mirror the counters: the report reads these, not the registry.
        self._steps = 0
        self._row_steps = 0
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted = 0
        self._num_committed = 0
        self._num_full = 0
        self._num_zero = 0
        self._num_target_rows = 0
        self._per_position: list[int] = []
        # calibration, per position: rows with a confidence, sum of predicted survival,
        # rows that really accepted >= k+1
        self._calib: list[list[float]] = []
        self._depths: list[int] = []  # request-steps per decided depth
        self._no_draft = 0
        self._regimes: dict[str, list[float]] = {}  # regime -> [draft, predicted, accepted]
        self._children: dict[tuple[Any, ...], Any] = {}  # (counter, labels) -> its child

    def observe_step(
        self,
        output_tokens: Tensor,
        num_draft_tokens: Tensor,
        confidence: Tensor | None = None,
        *,
        depths: list[int] | None = None,
        regimes: list[str] | None = None,
    ) -> None:
        """Record one decode step.

        output_tokens: [B, gamma+1] int64, committed tokens per row then -1 padding
        num_draft_tokens: [B] int64, draft tokens each row carried (0 = baseline row)
        confidence: [B, >= max drafts] the conditional acceptance estimates c_k the step
          predicted (a confidence head, or the adaptive decision's estimates), or None
        depths: [B] the speculation depth decided before drafting (None: not recorded)
        regimes: [B] each row's sampling regime label (None: not recorded)
        """
        # on the host once, as lists: a step's few rows cost ~10x more as tensor ops
        # (0.43 ms of an 18 ms step at one request)
        committed, drafted = _check_step(output_tokens, num_draft_tokens)  # [B], [B]
        accepted = [c - 1 for c in committed]  # the last committed token: correction/bonus
        gamma = output_tokens.shape[1] - 1
        per_pos = [0] * gamma
        for a in accepted:
            for k in range(a):
                per_pos[k] += 1
        rows = len(committed)
        counts = SpecCounts()  # the one definition of a draft (xspec.acceptance)
        for d, a in zip(drafted, accepted):
            counts.add_row(d, a)
        num_drafts, draft_tokens = counts.num_drafts, counts.num_draft_tokens
        num_accepted, num_committed = counts.num_accepted_tokens, sum(committed)

        self._steps += 1
        self._row_steps += rows
        self._num_drafts += num_drafts
        self._num_draft_tokens += draft_tokens
        self._num_accepted += num_accepted
        self._num_committed += num_committed
        self._num_target_rows += draft_tokens + rows
        self._num_full += sum(d > 0 and a == d for d, a in zip(drafted, accepted))
        self._num_zero += sum(d > 0 and a == 0 for d, a in zip(drafted, accepted))
        self._per_position += [0] * (gamma - len(self._per_position))
        for k, count in enumerate(per_pos):
            self._per_position[k] += count
            self._child(self._per_pos, position=str(k)).inc(count)

        survival = None  # [B][<= max drafts] predicted prod_{i<=k} c_i per row
        if confidence is not None:
            survival = _survivals(confidence, max(drafted, default=0))
            self._observe_confidence(survival, accepted, drafted)
        if depths is not None:
            self._observe_depths(depths)
        if regimes is not None:
            self._observe_regimes(regimes, survival, accepted, drafted)

        self._drafts.inc(num_drafts)
        self._draft_tokens.inc(draft_tokens)
        self._accepted.inc(num_accepted)
        self._committed.inc(num_committed)
        self._target_rows.inc(draft_tokens + rows)
        self._wasted_rows.inc(draft_tokens - num_accepted)
        self._tokens_per_step.set(_ratio(self._num_committed, self._row_steps))
        self._acceptance_length.set(acceptance_length(self._num_accepted, self._num_drafts))

    def _child(self, counter: Counter, **labels: str) -> Any:
        """``counter.labels(**labels)``, looked up once per label set (a lookup per
        position, depth and regime a step cost more than the counting)."""
        key = (id(counter), *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = counter.labels(**labels)
        return child

    def _observe_confidence(
        self, survival: list[list[float]], accepted: list[int], drafted: list[int]
    ) -> None:
        """Predicted survival ``prod_{i<=k} c_i`` vs realised acceptance, per position.
        A row whose prediction is not finite (a NaN confidence head) is left out of it."""
        width = max((len(row) for row in survival), default=0)
        self._calib += [[0.0, 0.0, 0.0] for _ in range(width - len(self._calib))]
        for k in range(width):
            n, total, hits = 0, 0.0, 0
            for row, d, a in zip(survival, drafted, accepted):
                if d > k and math.isfinite(row[k]):  # drafted position k
                    n, total, hits = n + 1, total + row[k], hits + (a > k)
            entry = self._calib[k]
            entry[0] += n
            entry[1] += total
            entry[2] += hits
            self._child(self._predicted_per_pos, position=str(k)).inc(total)

    def _observe_depths(self, depths: list[int]) -> None:
        top = max(depths, default=0)
        self._depths += [0] * (top + 1 - len(self._depths))
        for d, count in collections.Counter(depths).items():  # one counter update per depth
            self._depths[d] += count
            self._child(self._depth, depth=str(d)).inc(count)
        if not any(depths):
            self._no_draft += 1
            self._no_draft_steps.inc()

    def _observe_regimes(
        self,
        regimes: list[str],
        survival: list[list[float]] | None,
        accepted: list[int],
        drafted: list[int],
    ) -> None:
        """Verified drafts, predicted and realised accepted tokens per sampling regime
        (summed over the step's rows first: one counter update per regime and step)."""
        if max(drafted, default=0) <= 0:
            return
        step: dict[str, list[float]] = {}
        for b, (name, k, a) in enumerate(zip(regimes, drafted, accepted)):
            if k > 0:
                p = 0.0
                if survival is not None:
                    p = sum(x for x in survival[b][:k] if math.isfinite(x))
                t = step.get(name) or step.setdefault(name, [0.0, 0.0, 0.0])
                t[0], t[1], t[2] = t[0] + k, t[1] + p, t[2] + a
        for name, values in step.items():
            entry = self._regimes.setdefault(name, [0.0, 0.0, 0.0])
            for i, (key, v) in enumerate(zip(("draft", "predicted_accepted", "accepted"), values)):
                entry[i] += v
                self._child(self._regime_counters[key], regime=name).inc(v)

    def observe_prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        """One prefill's prefix-cache lookup: its prompt tokens, those restored."""
        self.prefix_queries += prompt_tokens
        self.prefix_hits += cached_tokens
        self._prefix_queries.inc(prompt_tokens)
        self._prefix_hits.inc(cached_tokens)

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens restored from the prefix cache / looked up (None: no lookup)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    def totals(self) -> dict[str, Any]:
        """Every count so far (plain values: picklable for another rank's :meth:`absorb`)."""
        return {
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
            "steps": self._steps,
            "row_steps": self._row_steps,
            "drafts": self._num_drafts,
            "draft_tokens": self._num_draft_tokens,
            "accepted": self._num_accepted,
            "committed": self._num_committed,
            "full": self._num_full,
            "zero": self._num_zero,
            "target_rows": self._num_target_rows,
            "per_position": list(self._per_position),
            "calibration": [list(c) for c in self._calib],
            "depths": list(self._depths),
            "no_draft": self._no_draft,
            "regimes": {k: list(v) for k, v in self._regimes.items()},
        }

    def absorb(self, t: dict[str, Any]) -> None:
        """Add another engine's :meth:`totals` (a DP replica's): counts add, so every
        derived rate is the one a single engine over all the requests would report."""
        self.observe_prefix(t.get("prefix_queries", 0), t.get("prefix_hits", 0))
        self._steps += t["steps"]
        self._row_steps += t["row_steps"]
        self._num_drafts += t["drafts"]
        self._num_draft_tokens += t["draft_tokens"]
        self._num_accepted += t["accepted"]
        self._num_committed += t["committed"]
        self._num_full += t["full"]
        self._num_zero += t["zero"]
        self._num_target_rows += t["target_rows"]
        self._per_position += [0] * (len(t["per_position"]) - len(self._per_position))
        for k, count in enumerate(t["per_position"]):
            self._per_position[k] += count
            self._per_pos.labels(position=str(k)).inc(count)
        for k, (rows, predicted, realised) in enumerate(t["calibration"]):
            if len(self._calib) <= k:
                self._calib.append([0.0, 0.0, 0.0])
            self._calib[k] = [a + b for a, b in zip(self._calib[k], (rows, predicted, realised))]
            self._predicted_per_pos.labels(position=str(k)).inc(predicted)
        self._depths += [0] * (len(t.get("depths", [])) - len(self._depths))
        for d, count in enumerate(t.get("depths", [])):
            self._depths[d] += count
            self._depth.labels(depth=str(d)).inc(count)
        self._no_draft += t.get("no_draft", 0)
        self._no_draft_steps.inc(t.get("no_draft", 0))
        for name, values in t.get("regimes", {}).items():
            entry = self._regimes.setdefault(name, [0.0, 0.0, 0.0])
            for i, key in enumerate(("draft", "predicted_accepted", "accepted")):
                entry[i] += values[i]
                self._regime_counters[key].labels(regime=name).inc(values[i])
        self._drafts.inc(t["drafts"])
        self._draft_tokens.inc(t["draft_tokens"])
        self._accepted.inc(t["accepted"])
        self._committed.inc(t["committed"])
        self._target_rows.inc(t["target_rows"])
        self._wasted_rows.inc(t["draft_tokens"] - t["accepted"])
        self._tokens_per_step.set(_ratio(self._num_committed, self._row_steps))
        self._acceptance_length.set(acceptance_length(self._num_accepted, self._num_drafts))

    def report(self) -> AcceptanceReport:
        drafts = self._num_drafts
        scored, predicted, realised = (sum(e[i] for e in self._calib) for i in range(3))
        return AcceptanceReport(
            num_steps=self._steps,
            num_row_steps=self._row_steps,
            num_drafts=drafts,
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_tokens=self._num_accepted,
            num_committed_tokens=self._num_committed,
            num_full_blocks=self._num_full,
            num_zero_accepts=self._num_zero,
            accepted_per_position=list(self._per_position),
            acceptance_rate=_ratio(self._num_accepted, self._num_draft_tokens),
            mean_accepted_length=_ratio(self._num_accepted, drafts),
            acceptance_length=acceptance_length(self._num_accepted, drafts),
            mean_tokens_per_step=_ratio(self._num_committed, self._row_steps),
            survival=[_ratio(c, drafts) for c in self._per_position],
            full_block_fraction=_ratio(self._num_full, drafts),
            zero_accept_fraction=_ratio(self._num_zero, drafts),
            calibration=[(_ratio(p, n), _ratio(r, n)) for n, p, r in self._calib],
            num_target_rows=self._num_target_rows,
            mean_target_rows=_ratio(self._num_target_rows, self._row_steps),
            num_wasted_target_rows=self._num_draft_tokens - self._num_accepted,
            predicted_acceptance_rate=_ratio(predicted, scored) if self._calib else None,
            realised_acceptance_rate=_ratio(realised, scored) if self._calib else None,
            depth_histogram=list(self._depths),
            num_steps_without_drafts=self._no_draft,
            regimes={
                name: {
                    "draft_tokens": v[0],
                    "predicted_rate": _ratio(v[1], v[0]),
                    "realised_rate": _ratio(v[2], v[0]),
                }
                for name, v in self._regimes.items()
            },
        )

    def exposition(self) -> str:
        """The registry in Prometheus text format."""
        return prometheus_client.generate_latest(self.registry).decode("utf-8")


def _histogram(counts: list[int]) -> str:
    """``[5, 0, 7]`` -> ``0:5 1:0 2:7`` (depth: request-steps)."""
    return " ".join(f"{d}:{c}" for d, c in enumerate(counts))


def _check_step(output_tokens: Tensor, num_draft_tokens: Tensor) -> tuple[list[int], list[int]]:
    """Validate one step's matrix; return (committed [B], drafted [B]) as host lists.

    Catches caller bugs early (ValueError): a row must commit 1..drafts+1 tokens as a
    prefix, i.e. no token after the first -1.
    """
    if output_tokens.dim() != 2 or output_tokens.shape[1] < 1:
        raise ValueError(f"output_tokens must be [B, gamma+1], got {tuple(output_tokens.shape)}")
    out = output_tokens.detach().to("cpu", torch.long).tolist()  # [B][gamma+1]
    drafted = num_draft_tokens.detach().to("cpu", torch.long).reshape(-1).tolist()  # [B]
    if len(drafted) != len(out):
        raise ValueError(f"num_draft_tokens has {len(drafted)} rows, output_tokens {len(out)}")
    committed = []
    for row, (tokens, d) in enumerate(zip(out, drafted)):
        n = sum(t >= 0 for t in tokens)
        if not 1 <= n <= d + 1 or any(t < 0 for t in tokens[:n]):
            raise ValueError(
                f"output_tokens row {row} = {tokens} with {d} drafts: a row must commit "
                "1..drafts+1 tokens, left-aligned, then -1 padding"
            )
        committed.append(n)
    return committed, drafted


def _survivals(confidence: Tensor, width: int) -> list[list[float]]:
    """``confidence [B, >= width]`` -> per row the predicted survivals ``prod_{i<=k} c_i``
    of its first ``width`` positions (float64 products, on the host)."""
    rows = confidence.detach()[:, :width].to("cpu", torch.float64).tolist()
    return [list(itertools.accumulate(row, operator.mul)) for row in rows]
