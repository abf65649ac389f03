"""The step-cost profile ``spec.adaptive`` decides with: seconds per decode step against
verify rows and drafting requests, measured on this platform and cached
(:class:`~.cost.StepCost`), then corrected online (:class:`~.online.OnlineStepCost`).

**What is timed**, per point (R requests, x drafts each, ``B = R (x + 1)`` rows), on
dummy sequences of ``context`` random committed tokens (the workload's mean prompt length
plus half its ``max_new_tokens``, or ``spec.adaptive.profile_context``), sampling as the
workload does: the drafter's ``propose`` for the R requests at full gamma on its own
(``draft_seconds``: a step where D requests draft pays the draft forward of D, none
where none does), and the target's verify forward of the B rows with ``logits_to_probs``
and the rejection sampler (``seconds``). The median of ``spec.adaptive.profile_reps``
runs of each point, interleaved (:func:`median_interleaved`), after a warm-up pass; R
over powers of two up to ``min(spec.adaptive.max_requests, the memory plan's
sequences)``, x over ``{0, 1, gamma // 2, gamma}``. Each R's drafting points become their
robust line (:func:`line_fit`); a smaller batch is never slower than a larger one
(:func:`monotone_in_requests`).

**Where it comes from**: ``spec.adaptive.profile=<file>`` reuses a saved profile (refused
when measured for another model, draft, gamma, dtype, platform, context, sampling, xspec
or torch version); null looks for the cached profile of this key and of this xspec's
source (:func:`source_digest`) under ``$XSPEC_CACHE_DIR/step_cost/``, else measures it in
``build`` (never counted in TTFT / TPOT / throughput) and caches it.
"""

from __future__ import annotations

import dataclasses
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
from xspec.jsonfile import JSONFileError, read_json
from xspec.models.base import CapturePoint, ForwardBatch, TargetModel
from xspec.sampling import SamplingParams, logits_to_probs
from xspec.spec.adaptive.cost import StepCost
from xspec.spec.drafter import CommittedRows, Drafter, DraftRequest
from xspec.spec.verify import rejection_sample

FORMAT = "xspec.step_cost.v4"  # v4: medians of interleaved runs; v3: the fastest
DEFAULT_CONTEXT = 64  # committed tokens of each dummy sequence when the workload says nothing


@dataclass(frozen=True)
class Profile:
    """A run's step-cost profile: the table, where it came from, and its file."""

    cost: StepCost
    source: str  # "measured in 1.2 s, cached to ..." / "loaded from ..."
    path: Path | None  # the file it was read from or written to

    def describe(self) -> str:
        """The start-up lines printed under the memory plan."""
        cost = self.cost
        lines = [
            f"step-cost profile ({self.source}): ms per step, requests x drafts each "
            "(verify), and the draft forward of that many drafting requests"
        ]
        head = "  requests " + "".join(f"{f'x={x}':>9}" for x in cost.drafts) + f"{'draft':>9}"
        lines.append(head)
        drafts = cost.draft_seconds or [0.0] * len(cost.requests)
        for r, row, d in zip(cost.requests, cost.seconds, drafts):
            lines.append(f"  {r:>8} " + "".join(f"{s * 1e3:>9.2f}" for s in [*row, d]))
        return "\n".join(lines)


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def profile_key(cfg: Any, platform: Any, gamma: int, context: int | None) -> dict[str, Any]:
    """What a profile was measured for (torch-free, read from the config and config.json
    files only): model checkpoint and its config hash, draft, gamma, dtype, platform,
    device, the dummy context (None: left out, for checks before the tokenizer is
    loaded), the sampling, the xspec and torch versions."""
    from importlib.metadata import version

    from xspec.version import __version__

    model, spec = cfg.model, cfg.spec
    ckpt = Path(model.path).resolve() if model.path else None
    draft = Path(spec.draft_path).resolve() if spec.draft_path else None
    key = {
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
        "context": context,
        "sampling": {**dataclasses.asdict(_sampling(cfg)), "seed": None},
        "xspec_version": __version__,
        "torch_version": version("torch"),
    }
    if context is None:
        del key["context"]
    # as a saved file reads back (tuples such as SamplingParams.logit_bias become lists),
    # so that a key compares equal to the one its file was saved with
    return json.loads(json.dumps(key))


def _sampling(cfg: Any) -> SamplingParams:
    """The workload's sampling (what the profile samples with; the seed does not matter)."""
    s = cfg.sampling
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=0)


@functools.cache
def source_digest() -> str:
    """sha256 of this xspec's modules (names and bytes): part of a cached profile's name,
    so that a change of the step's code (a checkout, an edit) measures afresh."""
    return tree_digest(Path(__file__).resolve().parents[2])  # the xspec package


def tree_digest(root: Path) -> str:
    """sha256 over the ``*.py`` files under ``root``: each one's relative path and bytes."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cached_profile_path(key: dict[str, Any]) -> Path:
    """Where the cache keeps the profile of ``key`` measured by this source."""
    from xspec.cache import cache_root

    named = json.dumps({**key, "source": source_digest()}, sort_keys=True)
    digest = hashlib.sha256(named.encode()).hexdigest()[:16]
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
        "draft_seconds": cost.draft_seconds,
    }
    atomic.write_json(path, body)  # a failed write leaves the previous file as it was


def read_profile(path: Path, key: dict[str, Any]) -> StepCost:
    """The profile in ``path`` for ``key``; ConfigError (what, where, how to fix) when it
    is unreadable or was measured for something else."""
    where = f"spec.adaptive.profile={path}"
    fix = "delete it, or set spec.adaptive.profile=null to measure one for this run"
    try:
        raw = read_json(path)
    except JSONFileError as e:
        raise ConfigError(f"{where}: {e}; {fix}") from None
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
        return StepCost(raw["requests"], raw["drafts"], raw["seconds"], raw["draft_seconds"])
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
    target: TargetModel,
    states: list[Any],
    capture: list[CapturePoint],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    context: int,
    block: torch.Tensor,
) -> None:
    """The verify side of a step for ``block [R, x+1]`` (any tokens will do): the target
    forward, its processed probabilities and the rejection sampler (one-hot drafts);
    then every state is rolled back to the dummy context."""
    R, width = block.shape
    out = target.forward(ForwardBatch(block.reshape(-1), [width] * R, states, capture))
    rows = [p for p in params for _ in range(width)]
    probs = logits_to_probs(out.logits, rows).reshape(R, width, -1)
    rejection_sample(probs, block[:, 1:], None, generators, check_tokens=False)
    for s in states:
        target.truncate(s, context)


def median_interleaved(
    fns: list[Callable[[], Any]], reps: int, synchronize: Callable[[], None]
) -> list[float]:
    """The median of ``reps`` timed runs of each of ``fns`` after one untimed warm-up of
    each (allocations, first-call dispatch). The runs are interleaved, one of each per
    round, so a slow spell of a shared machine falls on every point alike instead of on
    one, which would tilt the line through them (the per-row cost Algorithm 1 trims
    with). The median, not the fastest: the decision needs the ratio between steps of
    different shapes, and the fastest run of each is an outlier of its own; the online
    model scales the profile to what the running workload sees."""
    for fn in fns:
        fn()
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            synchronize()
            t0 = time.perf_counter()
            fn()
            synchronize()
            runs[i].append(time.perf_counter() - t0)
    return [statistics.median(r) for r in runs]


@torch.no_grad()
def measure_step_cost(
    target: TargetModel,
    drafter: Drafter,
    capture: list[CapturePoint],
    *,
    max_requests: int,
    reps: int,
    synchronize: Callable[[], None],
    context: int = DEFAULT_CONTEXT,
    sampling: SamplingParams | None = None,
) -> StepCost:
    """Time the step on dummy sequences (module docstring); rolls every state back."""
    gamma, device = drafter.gamma, target.device
    drafts = sorted({0, min(1, gamma), gamma // 2, gamma})
    gen = torch.Generator().manual_seed(0)
    params = sampling if sampling is not None else SamplingParams()
    seconds, draft_seconds = [], []
    grid = request_grid(max_requests)
    for i, R in enumerate([grid[0], *grid]):  # the first pass only warms up
        n = context + gamma + 1
        states = [target.new_state(n) for _ in range(R)]
        dstates = [drafter.new_state(n) for _ in range(R)]
        ids = torch.randint(0, target.vocab_size, (R, context + 1), generator=gen).to(device)
        out = target.forward(
            ForwardBatch(
                ids[:, :context].reshape(-1), [context] * R, states, capture, logit_rows=[]
            )
        )  # the context only: no logits
        rows = CommittedRows(
            ids[:, :context].reshape(-1),  # [R*context]
            ids[:, 1:].reshape(-1),
            out.hidden,
            out.aux_hidden,
            seq_lens=[context] * R,
            starts=[0] * R,
        )
        drafter.observe(dstates, rows)
        del out, rows
        anchors = ids[:, context].tolist()
        generators = [
            None if params.greedy else torch.Generator(device=device).manual_seed(i)
            for i in range(R)
        ]
        requests = [
            DraftRequest(a, params, g, max_drafts=gamma) for a, g in zip(anchors, generators)
        ]
        verify = functools.partial(
            _verify, target, states, capture, [params] * R, generators, context
        )
        fns: list[Callable[[], Any]] = [
            functools.partial(verify, ids[:, context - x :]) for x in drafts
        ]
        if gamma > 0:
            fns.append(functools.partial(drafter.propose, dstates, requests, gamma))
        times = median_interleaved(fns, reps, synchronize)
        row, t_draft = times[: len(drafts)], (times[-1] if gamma > 0 else 0.0)
        if i == 0:
            continue
        seconds.append(line_fit(drafts, row))
        draft_seconds.append(t_draft)
    return StepCost(grid, drafts, *monotone_in_requests(seconds, draft_seconds))


def line_fit(xs: list[int], ys: list[float]) -> list[float]:
    """``ys`` measured at drafts per request ``xs`` (ascending) -> the robust straight line
    through the drafting points (``x >= 1``), evaluated at ``xs``: the median of the
    pairwise slopes (Theil-Sen, at least 0: more rows never make a step faster) and the
    median intercept. One timing spike moves neither, where a running maximum would carry
    it to every larger x. A plain step (``x = 0``) keeps its own time, at most the line's
    at ``x = 1``: it skips the rejection sampler, so it sits below the drafting line, and
    a line through it would overstate what each further draft row costs (and Algorithm 1
    would trim drafts that pay for themselves)."""
    plain = [(x, y) for x, y in zip(xs, ys) if x == 0]
    pts = [(x, y) for x, y in zip(xs, ys) if x > 0]
    if len(pts) < 2:
        return list(ys)
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(pts, 2)]
    slope = max(0.0, statistics.median(slopes))
    intercept = statistics.median(y - slope * x for x, y in pts)
    line = [max(intercept + slope * x, 1e-6) for x, _ in pts]
    if not plain:
        return line
    return [min(plain[0][1], line[0]), *line]


def monotone_in_requests(
    seconds: list[list[float]], draft_seconds: list[float]
) -> tuple[list[list[float]], list[float]]:
    """More requests never make a step (or a draft forward) faster: each value becomes
    the minimum of itself and every larger batch's, so a spike at a small batch (the
    first forwards, another process) is cut to what a larger batch measured."""
    rows, draft = [list(r) for r in seconds], list(draft_seconds)
    for i in range(len(rows) - 2, -1, -1):
        rows[i] = [min(a, b) for a, b in zip(rows[i], rows[i + 1])]
        draft[i] = min(draft[i], draft[i + 1])
    return rows, draft


def step_cost_profile(
    cfg: Any,
    platform: Any,
    target: TargetModel,
    drafter: Drafter,
    capture: list[CapturePoint],
    max_requests: int,
    context: int = DEFAULT_CONTEXT,
) -> Profile:
    """The profile for this run: the given file, the cached one, or a fresh measurement
    (then cached). ``max_requests``: the most requests per step the run can have;
    ``context``: the committed tokens of each dummy sequence (the workload's)."""
    a = cfg.spec.adaptive
    key = profile_key(cfg, platform, drafter.gamma, context)
    if a.profile is not None:
        path = Path(a.profile)
        return Profile(read_profile(path, key), f"loaded from {path}", path)
    path = cached_profile_path(key)
    if path.is_file():
        try:
            cost = read_profile(path, key)
            reps = read_json(path).get("reps", 0)
            # reused when it covers this run's batch sizes at least as carefully
            if cost.requests[-1] >= max_requests and reps >= a.profile_reps:
                return Profile(cost, f"cached, loaded from {path}", path)
        except (ConfigError, JSONFileError):
            pass  # a stale or damaged cache entry: measure again
    t0 = time.perf_counter()
    cost = measure_step_cost(
        target,
        drafter,
        capture,
        max_requests=max_requests,
        reps=a.profile_reps,
        synchronize=platform.synchronize,
        context=context,
        sampling=_sampling(cfg),
    )
    spent = time.perf_counter() - t0
    save_profile(path, key, cost, spent, a.profile_reps)
    return Profile(cost, f"measured in {spent:.1f} s (not in any figure), cached to {path}", path)


def workload_context(w: Any, encode: Callable[[str], list[int]], limit: int) -> int:
    """The context a profile should be measured at for workload ``w``: its mean prompt
    length (text prompts, a prompts file's lines, or synthetic ``input_len``) plus half
    its new tokens, within ``limit`` (the model's context). A prompts file that cannot be
    read here counts as :data:`DEFAULT_CONTEXT` (the workload check reports it)."""
    half = w.max_new_tokens // 2
    if w.kind.value == "synthetic":
        lengths, half = [w.input_len], w.output_len // 2
    elif w.prompts_file is not None:
        try:
            lines = [json.loads(x) for x in Path(w.prompts_file).read_text().splitlines() if x]
            lengths = [
                len(x["prompt_token_ids"]) if "prompt_token_ids" in x else len(encode(x["prompt"]))
                for x in lines
            ]
        except (OSError, ValueError, KeyError, TypeError):
            lengths = [DEFAULT_CONTEXT - half]
    else:
        lengths = [len(encode(p)) for p in w.prompts] or [DEFAULT_CONTEXT - half]
    mean = round(sum(lengths) / len(lengths)) + half
    return max(1, min(mean, limit))
