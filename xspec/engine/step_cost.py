"""The step-cost profile ``spec.adaptive`` schedules with: seconds per decode step against
verify rows, measured on this platform (:class:`~xspec.spec.schedule.StepCost`).

**What is timed**, per point (R requests, x drafts each, ``B = R (x + 1)`` rows), on
dummy sequences of :data:`CONTEXT` random committed tokens: the drafter's ``propose``
for the R requests at full gamma (its cost does not depend on x: adaptive drafts gamma
and verifies fewer) plus the target's verify forward of the B rows and their
``logits_to_probs``. The median of ``spec.adaptive.profile_reps`` timed runs after one
untimed warm-up; R runs over powers of two up to ``min(spec.adaptive.max_requests, the
memory plan's sequences)``, x over ``{0, gamma // 2, gamma}`` (the time is close to linear
in the rows; :class:`StepCost` interpolates; a row is made non-decreasing in x, since a
dip is timing noise). Not timed: the rejection sampler and the
drafter's context write, both small next to a forward.

**Where it comes from**: ``spec.adaptive.profile=<file>`` reuses a saved profile (refused
when it was measured for another model, draft, gamma, dtype, platform or xspec version);
null looks for the cached profile of this key under ``$XSPEC_CACHE_DIR/step_cost/`` and
otherwise measures at engine start and caches it. Profiling happens in ``build``, before
any measured run, so it never counts in TTFT / TPOT / throughput; its duration is printed
with the memory plan.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xspec import atomic
from xspec.errors import ConfigError
from xspec.models.base import CapturePoint, ForwardBatch, TargetModel
from xspec.sampling import SamplingParams, logits_to_probs
from xspec.spec.drafter import CommittedRows, Drafter, DraftRequest
from xspec.spec.schedule import StepCost

FORMAT = "xspec.step_cost.v1"
CONTEXT = 16  # committed tokens of each dummy sequence


@dataclass(frozen=True)
class Profile:
    cost: StepCost
    source: str  # "measured in 1.2 s, cached to ..." / "loaded from ..."
    path: Path | None  # the file it was read from or written to


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def profile_key(cfg: Any, platform: Any, gamma: int) -> dict[str, Any]:
    """What a profile was measured for (torch-free, read from the config and config.json
    files only): model checkpoint and its config hash, draft, gamma, dtype, platform,
    device and xspec version."""
    from xspec import __version__

    model, spec = cfg.model, cfg.spec
    ckpt = Path(model.path).resolve() if model.path else None
    draft = Path(spec.draft_path).resolve() if spec.draft_path else None
    return {
        "arch": model.arch,
        "checkpoint": str(ckpt) if ckpt else f"preset:{model.preset}",
        "config_sha256": _sha256(ckpt / "config.json") if ckpt else None,
        "max_context": model.max_context,
        "dtype": model.dtype.value,
        "spec": spec.method,
        "draft": str(draft) if draft else "default",
        "draft_config_sha256": _sha256(draft / "config.json") if draft else None,
        "gamma": gamma,
        "platform": platform.name,
        "device": str(platform.device()),
        "xspec_version": __version__,
    }


def cached_profile_path(key: dict[str, Any]) -> Path:
    from xspec.cache import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "step_cost" / f"{digest}.json"


def save_profile(
    path: Path, key: dict[str, Any], cost: StepCost, seconds: float, reps: int
) -> None:
    body = {
        "format": FORMAT,
        "key": key,
        "profile_seconds": seconds,
        "reps": reps,
        "requests": cost.requests,
        "drafts": cost.drafts,
        "seconds": cost.seconds,
    }
    atomic.write_json(path, body)  # a failed write leaves the previous file as it was


def read_profile(path: Path, key: dict[str, Any]) -> StepCost:
    """The profile in ``path`` for ``key``; ConfigError (what, where, how to fix) when it
    is unreadable or was measured for something else."""
    where = f"spec.adaptive.profile={path}"
    fix = "delete it, or set spec.adaptive.profile=null to measure one for this run"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file; {fix}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: not a readable JSON file ({e}); {fix}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(f"{where}: not an xspec step-cost profile ({FORMAT}); {fix}")
    theirs = raw.get("key")
    theirs = theirs if isinstance(theirs, dict) else {}
    diff = [
        f"{k}: file {theirs.get(k)!r}, this run {v!r}" for k, v in key.items() if theirs.get(k) != v
    ]
    if diff:
        raise ConfigError(f"{where} was measured for another setup ({'; '.join(diff)}); {fix}")
    try:
        return StepCost(raw["requests"], raw["drafts"], raw["seconds"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: malformed table ({e}); {fix}") from None


def request_grid(max_requests: int) -> list[int]:
    """1, 2, 4, ... below ``max_requests``, then ``max_requests`` itself."""
    grid, r = [], 1
    while r < max_requests:
        grid.append(r)
        r *= 2
    return [*grid, max(1, max_requests)]


def _verify(
    target: TargetModel, states: list[Any], capture: list[CapturePoint], block: torch.Tensor
) -> None:
    """The verify forward of ``block [R, x+1]`` (any tokens will do) and its processed
    probabilities; then every state is rolled back to the dummy context."""
    R, width = block.shape
    out = target.forward(ForwardBatch(block.reshape(-1), [width] * R, states, capture))
    logits_to_probs(out.logits, [SamplingParams()] * out.logits.shape[0])
    for s in states:
        target.truncate(s, CONTEXT)


def _median_seconds(fn: Callable[[], Any], reps: int, synchronize: Callable[[], None]) -> float:
    fn()  # warm-up (allocations, first-call dispatch)
    times = []
    for _ in range(reps):
        synchronize()
        t0 = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def measure_step_cost(
    target: TargetModel,
    drafter: Drafter,
    capture: list[CapturePoint],
    *,
    max_requests: int,
    reps: int,
    synchronize: Callable[[], None],
) -> StepCost:
    """Time the step on dummy sequences (module docstring); rolls every state back."""
    gamma, device = drafter.gamma, target.device
    drafts = sorted({0, gamma // 2, gamma})
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams()
    seconds = []
    for R in request_grid(max_requests):
        n = CONTEXT + gamma + 1
        states = [target.new_state(n) for _ in range(R)]
        dstates = [drafter.new_state(n) for _ in range(R)]
        ids = torch.randint(0, target.vocab_size, (R, CONTEXT + 1), generator=gen).to(device)
        out = target.forward(
            ForwardBatch(ids[:, :CONTEXT].reshape(-1), [CONTEXT] * R, states, capture)
        )
        rows = CommittedRows(
            ids[:, :CONTEXT].reshape(-1),  # [R*CONTEXT]
            ids[:, 1:].reshape(-1),
            out.hidden,
            out.aux_hidden,
            seq_lens=[CONTEXT] * R,
            starts=[0] * R,
        )
        drafter.observe(dstates, rows)
        anchors = ids[:, CONTEXT].tolist()
        requests = [DraftRequest(a, greedy, None, max_drafts=gamma) for a in anchors]
        t_draft = _median_seconds(
            functools.partial(drafter.propose, dstates, requests, gamma), reps, synchronize
        )
        verify = functools.partial(_verify, target, states, capture)
        row = [
            _median_seconds(functools.partial(verify, ids[:, CONTEXT - x :]), reps, synchronize)
            for x in drafts
        ]
        # more rows never make a step faster: a measured dip is noise, flattened
        seconds.append([t_draft + t for t in itertools.accumulate(row, max)])
    return StepCost(request_grid(max_requests), drafts, seconds)


def step_cost_profile(
    cfg: Any,
    platform: Any,
    target: TargetModel,
    drafter: Drafter,
    capture: list[CapturePoint],
    max_requests: int,
) -> Profile:
    """The profile for this run: the given file, the cached one, or a fresh measurement
    (then cached). ``max_requests``: the most requests per step the run can have."""
    a = cfg.spec.adaptive
    key = profile_key(cfg, platform, drafter.gamma)
    if a.profile is not None:
        path = Path(a.profile)
        return Profile(read_profile(path, key), f"loaded from {path}", path)
    path = cached_profile_path(key)
    if path.is_file():
        try:
            cost = read_profile(path, key)
            reps = json.loads(path.read_text(encoding="utf-8")).get("reps", 0)
            # reused when it covers this run's batch sizes at least as carefully
            if cost.requests[-1] >= max_requests and reps >= a.profile_reps:
                return Profile(cost, f"cached, loaded from {path}", path)
        except ConfigError:
            pass  # a stale or damaged cache entry: measure again
    t0 = time.perf_counter()
    cost = measure_step_cost(
        target,
        drafter,
        capture,
        max_requests=max_requests,
        reps=a.profile_reps,
        synchronize=platform.synchronize,
    )
    spent = time.perf_counter() - t0
    save_profile(path, key, cost, spent, a.profile_reps)
    return Profile(cost, f"measured in {spent:.1f} s (not in any figure), cached to {path}", path)


def describe(profile: Profile) -> str:
    """The start-up lines printed under the memory plan."""
    cost = profile.cost
    lines = [f"step-cost profile ({profile.source}): ms per step, requests x drafts each"]
    head = "  requests " + "".join(f"{f'x={x}':>9}" for x in cost.drafts)
    lines.append(head)
    for r, row in zip(cost.requests, cost.seconds):
        lines.append(f"  {r:>8} " + "".join(f"{s * 1e3:>9.2f}" for s in row))
    return "\n".join(lines)
