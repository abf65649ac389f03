"""Adaptive speculation against its alternatives: ``spec=none`` vs fixed-gamma DSpark vs
``spec.adaptive`` vs ``spec.gamma_schedule``, against concurrency, greedy and sampled; and
(``--simulate``) the per-step plain / drafting choice on a synthetic machine.

    python benchmarks/bench_adaptive.py [--concurrency 1 4 8 16 32 64] [--temperatures 0 0.8]
        [--reps 2] [--max-new 64] [--max-new-spread S] [--min-requests N] [--gamma 5]
        [--schedule '[[1,5],[8,3],[16,0]]'] [--warmup workload|two] [--turns] [--twin]
        [--first-rep K] [--judge tuning|heldout|both] [--configs none fixed adaptive ...]
        [--out FILE.json] [--plot FILE.svg] [--replot FILE.json ...]
        [--quick] [key=value ...]                         # e.g. model=dsv4_tiny
    python benchmarks/bench_adaptive.py --simulate [--seeds 8] [--steps 800] [--batch 32]
        [--draft-bias 1.47] [--tail-every 60] [--tail 10] [--spells 20:1.0 20:1.7 ...]
        [--spell-noise 0.08] [--switch-cost 0.08 0.05]

**The sweep.** Every (configuration, temperature, concurrency, repeat) runs in its own
process (``--child``: build, one unmeasured warm-up, the measured run of the workload;
output tok/s = generated tokens / the run's seconds), and the configurations of a cell
are interleaved (an order rotated every cell), so a slow spell of a shared machine falls
on all of them. With ``--turns`` (what docs/adaptive.md's table uses) the configurations
of a cell are alive at once and stepped in turns over a pipe, a turn being engine
iterations until ``--turn-ms`` of the process's own time; each counts only its own
iterations' time. Repeat i samples with ``sampling.seed=i`` (every configuration alike:
at T > 0 a run's steps depend on the path its samples took). Figures are medians over
``--reps``; ``--twin`` runs fixed gamma twice per cell and prints their ratio (what the
harness itself moves: the floor under every other ratio).

The prompts are ``benchmarks/adaptive_prompts.jsonl``: 24 code prompts from held-out
standard-library files that neither the default workload's prompts nor the shipped
draft's calibration prompts come from. A run has ``max(--requests-per-slot *
concurrency, --min-requests)`` requests of ``--max-new`` tokens (eos ignored);
``--max-new-spread S`` spreads them over ``--max-new +- S`` (the same mean, dealt out of
order), as a served workload's lengths are.

**Judged on prompts it was not tuned on.** The adaptive rule's constants were tuned on
``--prompts``; ``--judge heldout`` runs ``benchmarks/heldout_prompts.jsonl`` instead (the
default workload's prompts and the trained model's evaluation prompts, sharing no line
with the tuning set; ``benchmarks/heldout_prompts.py`` rebuilds it), and ``--judge both``
runs each cell on both sets, interleaved, and prints their ratios side by side.
``--configs`` runs a subset (``none fixed adaptive`` skips the schedule). The warm-up (``--warmup``) runs the workload
once, unmeasured (``workload``: the steady state of a server, whose adaptive decision has
learnt its step costs and acceptance by then), or two requests (``two``: a cold start).

Printed: per temperature the median tok/s of each configuration and adaptive / best and
schedule / best (best: the better of ``spec=none`` and fixed gamma), adaptive / best per
repeat with its median and the 90 % bootstrap interval of the ratio of medians
(``xspec.bench.stats.bootstrap_interval``), then per adaptive run its depths, steps
without drafts and predicted / measured step time, where the time went, and whether greedy
outputs equal ``spec=none``'s. ``--out`` keeps every run as JSON; ``--replot`` prints and
plots saved runs (several pool their repeats); ``--quick`` is a smoke run (concurrency 1
and 8, greedy, one repeat, 16 new tokens).

**--simulate.** :class:`~xspec.spec.adaptive.AdaptiveDepth` driven with step times from
a known law, no model: a plain step of R requests takes 1.0 s by the profile, verifying 5
drafts each 2.0 s, the draft forward 0.5 s; drafting steps of ``--batch`` requests really
take ``--draft-bias`` times that (a cost the profile does not see), tail steps of 2
requests 0.7 times (every ``--tail-every`` steps, ``--tail`` of them); the machine's
speed switches every LEN steps between 1.0 and RATIO (``--spells LEN:RATIO``) with
log-normal noise; each draft position is accepted with probability 0.7; ``--switch-cost
P D``: a step of the other kind than the last costs ``1 + P`` (plain) or ``1 + D``
(drafting) more. Printed per spell pattern: the share of the big-batch steps (after a
warm-up) that drafted, per seed and the mean, against the right answer (0: plain, 1:
drafting), and their tokens per second over the better fixed kind's on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

PROMPTS = Path(__file__).with_name("adaptive_prompts.jsonl")
HELDOUT = Path(__file__).with_name("heldout_prompts.jsonl")
# --judge: the prompt sets a sweep runs; "tuning" is --prompts (the rule was tuned on it)
PROMPT_SETS = {"tuning": None, "heldout": HELDOUT}
CONFIGS = ("none", "fixed", "adaptive", "schedule")
RATIO_CONFIGS = ("none", "fixed", "adaptive")  # what adaptive / best needs
TWIN = "twin"  # --twin: fixed gamma once more, in a process of its own (the noise floor)
DEFAULT_SCHEDULE = "[[1,5],[8,3],[16,0]]"


def requests_for(a: argparse.Namespace, c: int) -> int:
    """Requests of one run at concurrency ``c``: ``max(--requests-per-slot * c,
    --min-requests)`` (2 and 8 when a caller's namespace has no such field)."""
    return max(getattr(a, "requests_per_slot", 2) * c, getattr(a, "min_requests", 8))


def overrides_for(
    config: str, a: argparse.Namespace, temperature: float, c: int, seed: int = 0
) -> dict:
    """The xspec overrides of one configuration at one temperature and concurrency
    (``seed``: the sampling seed, the repeat's index)."""
    o: dict[str, Any] = dict(o.split("=", 1) for o in a.overrides)
    o |= {
        "model": o.get("model", "dsv4_tiny"),
        "workload.prompts_file": str(a.prompts),
        "workload.num_requests": str(requests_for(a, c)),
        "workload.concurrency": str(c),
        # the longest request's (spread_lengths sets each one's in the child)
        "workload.max_new_tokens": str(a.max_new + getattr(a, "max_new_spread", 0)),
        "workload.ignore_eos": "true",
        "sampling.temperature": str(temperature),
        "sampling.seed": str(seed),
    }
    if config == "none":
        o["spec"] = "none"
        return o
    o |= {"spec": "dspark", "spec.num_speculative_tokens": str(a.gamma)}  # fixed, TWIN
    if config == "adaptive":
        o |= {
            "spec.adaptive.enabled": "true",
            # one profile (cached) serves every concurrency of the sweep
            "spec.adaptive.max_requests": str(max(a.concurrency)),
        }
    elif config == "schedule":
        o["spec.gamma_schedule"] = json.loads(a.schedule)
    return o


def spread_lengths(n: int, mean: int, spread: int) -> list[int]:
    """``--max-new-spread``: the new tokens of each of ``n`` requests, evenly spaced over
    ``[mean - spread, mean + spread]`` (mean ``mean``: the same tokens in all as without
    the spread) and dealt out of order (by a stride coprime with ``n`` near ``0.618 n``),
    so that each wave of requests mixes short and long ones."""
    if n < 2 or spread == 0:
        return [mean] * n
    stride = next(
        k for k in sorted(range(1, n), key=lambda k: abs(k - 0.618 * n)) if math.gcd(k, n) == 1
    )
    even = [mean - spread + round(2 * spread * j / (n - 1)) for j in range(n)]
    return [even[i * stride % n] for i in range(n)]


def child(spec: dict[str, Any], turns: TextIO | None = None) -> dict[str, Any]:
    """One measured run (in this process): build, warm up, run; its figures. ``turns``:
    take one engine iteration per line read from it (``--turns``)."""
    import torch

    import xspec
    from xspec.run.workloads import load_workload
    from xspec.sampling import SamplingParams
    from xspec.spec.adaptive import AdaptiveDepth

    torch.set_num_threads(spec["threads"])
    o = dict(spec["overrides"])
    model, method = o.pop("model"), o.pop("spec")
    llm = xspec.LLM(model=model, spec=method, overrides=o)
    built, engine = llm.built, llm.engine
    s, w = built.cfg.sampling, built.cfg.workload
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
    requests = load_workload(w, built.tokenizer, built.target.vocab_size, params).requests
    if spec.get("spread"):  # --max-new-spread: workload.max_new_tokens is the longest's
        lengths = spread_lengths(len(requests), spec["max_new"], spec["spread"])
        requests = [replace(r, max_new_tokens=n) for r, n in zip(requests, lengths)]
    if spec.get("warmup", "workload") == "workload":  # the steady state of a running server
        engine.run(requests, w.concurrency)
    else:  # a cold start: the first calls' one-off costs only
        engine.run(requests[:2], 2)
    engine.reset_metrics()
    if isinstance(engine.policy, AdaptiveDepth):
        engine.policy.reset_report()  # predicted vs measured: the measured run only
    if turns is None:
        gens = engine.run(requests, w.concurrency)
        seconds = engine.run_s
    else:
        gens, seconds = run_in_turns(
            engine, requests, w.concurrency, turns, spec.get("turn_ms", 0.0) / 1e3
        )
    r = engine.metrics.report()
    out: dict[str, Any] = {
        "tok_s": sum(len(g.token_ids) for g in gens) / seconds,
        "tokens_per_step": r.mean_tokens_per_step,
        "acceptance": r.acceptance_rate,
        "target_rows": r.mean_target_rows,
        "depth_histogram": r.depth_histogram,
        "steps": r.num_steps,
        "steps_without_drafts": r.num_steps_without_drafts,
        # the run's seconds inside prefill and inside decode steps (Engine.prefill_s)
        "prefill_s": engine.prefill_s,
        "decode_s": engine.step_s - engine.prefill_s,
        "prefills": engine.prefills,
        "regimes": r.regimes,
        "outputs": [g.token_ids for g in gens] if params.greedy else None,
    }
    figures = engine.policy.summary() or {}
    if figures.get("step_time") is not None:
        out["step_time"] = figures["step_time"]
    return out


def child_spec(
    config: str, a: argparse.Namespace, temperature: float, c: int, seed: int = 0
) -> dict[str, Any]:
    """What ``--child`` is given for one configuration of one cell."""
    return {
        "overrides": overrides_for(config, a, temperature, c, seed),
        "threads": a.threads,
        "warmup": a.warmup,
        "turn_ms": a.turn_ms,
        "max_new": a.max_new,
        "spread": getattr(a, "max_new_spread", 0),
    }


def run_in_turns(
    engine: Any, requests: list[Any], concurrency: int, turns: TextIO, turn_s: float = 0.0
) -> tuple[list[Any], float]:
    """The measured run, one turn per line the parent gives on ``turns``: engine
    iterations until ``turn_s`` seconds of them (at least one), answering ``stepped``
    after each turn and ``done`` after the last; the seconds are the sum of this
    process's own iterations (the waits for a turn excluded)."""
    engine.reset_clock()
    engine.concurrency = concurrency
    gens = [engine.add(i, r, arrived_at=0.0) for i, r in enumerate(requests)]
    print("ready", flush=True)
    seconds = 0.0
    while engine.busy:
        turns.readline()
        turn = 0.0
        while True:  # at least one iteration a turn
            t0 = time.perf_counter()
            engine.step()
            turn += time.perf_counter() - t0
            if not engine.busy or turn >= turn_s:
                break
        seconds += turn
        print("stepped" if engine.busy else "done", flush=True)
    return gens, seconds


def run_cell_in_turns(
    configs: list[str], a: argparse.Namespace, temperature: float, c: int, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """Every configuration of one cell in its own process, all alive at once, stepped in
    turns: one engine iteration of each in a round (the processes start one after the
    other and warm up before the first turn, so a profile measured at build time is not
    measured under the others' load). A slow spell of the machine falls on the
    iterations of every configuration alike, not on whichever ran in that minute."""
    procs: dict[str, subprocess.Popen[str]] = {}
    logs: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(_kill, procs)
        for config in configs:
            spec = child_spec(config, a, temperature, c, seed)
            logs[config] = stack.enter_context(tempfile.TemporaryFile("w+"))
            procs[config] = p = subprocess.Popen(
                [sys.executable, __file__, "--turns", "--child", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logs[config],
                text=True,
            )
            _read_until(p, config, logs[config], ("ready",))
        return drive_turns(procs, logs)


def drive_turns(
    procs: dict[str, subprocess.Popen[str]], logs: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Turns to every process of ``procs`` (ready, in their order) until each is done;
    their JSON figures. A finished child stays alive until every one is done: it exits
    when its stdin closes, after the last one's figures (an exit, freeing memory and
    shutting the interpreter down, would otherwise run beside the turns of those still
    measuring and slow whichever finishes later)."""
    results: dict[str, dict[str, Any]] = {}
    live = list(procs)
    while live:
        for config in list(live):
            p = procs[config]
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
            if _read_until(p, config, logs[config], ("stepped", "done")) == "done":
                results[config] = json.loads(_read_until(p, config, logs[config], None))
                live.remove(config)
    for p in procs.values():  # every one measured: now they may exit
        assert p.stdin is not None
        p.stdin.close()
    return results


def _kill(procs: dict[str, subprocess.Popen[str]]) -> None:
    for p in procs.values():
        p.kill()
        p.wait()


def _read_until(
    p: subprocess.Popen[str], config: str, log: Any, words: tuple[str, ...] | None
) -> str:
    """The next stdout line of ``p`` that is one of ``words`` (None: a JSON object)."""
    assert p.stdout is not None
    while True:
        line = p.stdout.readline()
        if not line:  # the child died: its stderr says why
            log.seek(0)
            raise SystemExit(f"{config} failed:\n{log.read()[-3000:]}")
        line = line.strip()
        if (words is None and line.startswith("{")) or (words is not None and line in words):
            return line


def run_one(
    config: str, a: argparse.Namespace, temperature: float, c: int, seed: int = 0
) -> dict[str, Any]:
    """``child`` in a fresh process; its JSON line back."""
    spec = child_spec(config, a, temperature, c, seed)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{config} T={temperature} c={c} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def paired(
    runs: dict[tuple[str, float, int], list[dict]], config: str, t: float, c: int
) -> list[float]:
    """Per repeat, ``config``'s tok/s over the better of ``spec=none`` and fixed gamma in
    that repeat (the configurations of a repeat ran side by side)."""
    return [
        x["tok_s"] / max(n["tok_s"], f["tok_s"])
        for x, n, f in zip(runs[(config, t, c)], runs[("none", t, c)], runs[("fixed", t, c)])
    ]


def ratio_interval(
    runs: dict[tuple[str, float, int], list[dict]], config: str, t: float, c: int, over: str
) -> tuple[float, float]:
    """The 90 % bootstrap interval (repeats resampled whole) of the ratio of medians of
    ``config`` over ``over`` ("best": the better of ``spec=none`` and fixed gamma)."""
    from xspec.bench.stats import bootstrap_interval

    names = [config, "none", "fixed"] if over == "best" else [config, over]
    rows = list(zip(*(runs[(k, t, c)] for k in names)))

    def ratio(sample: Sequence[tuple[dict, ...]]) -> float:
        med = [statistics.median(row[i]["tok_s"] for row in sample) for i in range(len(names))]
        return med[0] / max(med[1:])

    return bootstrap_interval(rows, ratio)


def new_tokens(a: argparse.Namespace) -> str:
    """The new tokens per request, as the headings give them: ``48``, or ``32-64``."""
    spread = getattr(a, "max_new_spread", 0)
    return f"{a.max_new - spread}-{a.max_new + spread}" if spread else str(a.max_new)


def table(a: argparse.Namespace, runs: dict[tuple[str, float, int], list[dict]]) -> str:
    """The markdown tables (one per temperature) of median tok/s and the ratios (of the
    medians: the goal's figure), then adaptive / best per repeat and, with ``--twin``,
    the second fixed-gamma process over the first (what the harness itself moves)."""

    def med(config: str, t: float, c: int, key: str = "tok_s") -> float:
        return statistics.median(r[key] for r in runs[(config, t, c)])

    configs = [k for k in CONFIGS if any(key[0] == k for key in runs)]
    out = []
    for t in a.temperatures:
        mode = "greedy" if t == 0 else f"T={t:g}"
        sched = "schedule" in configs
        out += [
            f"\n{mode}, output tok/s (median of {a.reps}), {new_tokens(a)} new tokens, "
            f"gamma {a.gamma}" + (f", schedule {a.schedule}:\n" if sched else ":\n"),
            "| concurrency | spec=none | dspark fixed | adaptive "
            + (
                "| schedule | adaptive / best | schedule / best |"
                if sched
                else "| adaptive / best |"
            ),
            "|---|---|---|---|---|" + ("---|---|" if sched else ""),
        ]
        for c in a.concurrency:
            v = {k: med(k, t, c) for k in configs}
            best = max(v["none"], v["fixed"])
            row = f"| {c} | {v['none']:.0f} | {v['fixed']:.0f} | {v['adaptive']:.0f} | "
            if sched:
                row += f"{v['schedule']:.0f} | {v['adaptive'] / best:.2f} | "
                row += f"{v['schedule'] / best:.2f} |"
            else:
                row += f"{v['adaptive'] / best:.2f} |"
            out.append(row)
    out += [
        "\nadaptive / best per repeat (repeat i: sampling.seed=i), their median, and the 90 %"
        " bootstrap interval of the ratio of medians (repeats resampled whole):\n"
    ]
    out += ["| mode | concurrency | per repeat | median | 90 % interval |", "|---|---|---|---|---|"]
    for t in a.temperatures:
        for c in a.concurrency:
            r = paired(runs, "adaptive", t, c)
            mode = "greedy" if t == 0 else f"T={t:g}"
            per = ", ".join(f"{x:.2f}" for x in r)
            lo, hi = ratio_interval(runs, "adaptive", t, c, "best")
            out.append(f"| {mode} | {c} | {per} | {statistics.median(r):.2f} | {lo:.2f}-{hi:.2f} |")
    if any(k[0] == TWIN for k in runs):
        out += ["\nfixed gamma in a second process / in the first, per repeat (the noise floor):\n"]
        for t in a.temperatures:
            for c in a.concurrency:
                r = [
                    x["tok_s"] / f["tok_s"]
                    for x, f in zip(runs[(TWIN, t, c)], runs[("fixed", t, c)])
                ]
                per = ", ".join(f"{x:.2f}" for x in r)
                lo, hi = ratio_interval(runs, TWIN, t, c, "fixed")
                out.append(
                    f"  T={t:g} c={c}: {per} (median {statistics.median(r):.2f}; ratio of "
                    f"medians, 90 % interval {lo:.2f}-{hi:.2f})"
                )
    return "\n".join(out)


def details(a: argparse.Namespace, runs: dict[tuple[str, float, int], list[dict]]) -> str:
    """Per adaptive run: depths chosen, steps without drafts, step time predicted/measured."""
    lines = [
        "\nadaptive: depth histogram (request-steps), steps without drafts, step ms "
        "predicted/measured (mean over the run, last repeat)"
    ]
    for t in a.temperatures:
        for c in a.concurrency:
            r = runs[("adaptive", t, c)][-1]
            st = r.get("step_time") or {}
            pred, meas = st.get("predicted_ms_mean"), st.get("measured_ms_mean")
            ms = f"{pred:.1f}/{meas:.1f}" if pred is not None and meas is not None else "n/a"
            lines.append(
                f"  T={t:g} c={c}: depths {r['depth_histogram']}, "
                f"{r['steps_without_drafts']}/{r['steps']} steps without drafts, ms {ms}"
            )
    lines.append(
        "\nwhere the time went (medians over the repeats): decode steps, ms per decode "
        "step, seconds of decode and of prefill (prefill calls)"
    )
    for t in a.temperatures:
        for c in a.concurrency:
            parts = [
                f"{config} {split}"
                for config in ("fixed", "adaptive")
                if (split := time_split(runs.get((config, t, c), []))) is not None
            ]
            if parts:
                lines.append(f"  T={t:g} c={c}: " + "; ".join(parts))
    return "\n".join(lines)


def time_split(runs: list[dict]) -> str | None:
    """A configuration's decode / prefill split over its repeats (None: not recorded)."""
    runs = [r for r in runs if r.get("decode_s") is not None]
    if not runs:
        return None

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    per_step = statistics.median(1e3 * r["decode_s"] / max(r["steps"], 1) for r in runs)
    return (
        f"{med('steps'):g} steps, {per_step:.1f} ms/step, decode {med('decode_s'):.2f} s, "
        f"prefill {med('prefill_s'):.2f} s ({med('prefills'):g})"
    )


LABELS = {
    "none": "spec=none",
    "fixed": "dspark, fixed gamma",
    "adaptive": "dspark, spec.adaptive",
    "schedule": "dspark, spec.gamma_schedule",
    TWIN: "dspark, fixed gamma (a second process)",
}


def plot(a: argparse.Namespace, runs: dict[tuple[str, float, int], list[dict]], path: Path) -> None:
    """Output tok/s (median) against concurrency, one column per temperature, and below
    it adaptive's and the schedule's ratio to the better of ``spec=none`` and fixed gamma
    (the 0.97 goal drawn), as an SVG with its text kept as text (small and diffable;
    docs/adaptive.md shows it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "xspec"})
    temps = sorted({t for _, t, _ in runs})
    fig, axes = plt.subplots(
        2, len(temps), figsize=(5.2 * len(temps), 6.4), squeeze=False, sharex=True,
        gridspec_kw={"height_ratios": [2, 1]},
    )  # fmt: skip
    styles = {"none": "k--o", "fixed": "C0-s", "adaptive": "C3-^", "schedule": "C2:d"}
    for col, t in enumerate(temps):
        top, bottom = axes[0][col], axes[1][col]
        cs = sorted({c for _, tt, c in runs if tt == t})
        med = {
            cfg: [statistics.median(r["tok_s"] for r in runs[(cfg, t, c)]) for c in cs]
            for cfg in CONFIGS
            if (cfg, t, cs[0]) in runs
        }
        best = [max(n, f) for n, f in zip(med["none"], med["fixed"])]
        for cfg in [k for k in CONFIGS if (k, t, cs[0]) in runs]:
            top.plot(cs, med[cfg], styles[cfg], label=LABELS[cfg], linewidth=1.5, markersize=5)
        for cfg in [k for k in ("adaptive", "schedule") if k in med]:
            ratio = [v / b for v, b in zip(med[cfg], best)]
            bottom.plot(cs, ratio, styles[cfg], label=LABELS[cfg], linewidth=1.5, markersize=5)
        bottom.axhline(1.0, color="k", linewidth=0.8)
        bottom.axhline(0.97, color="C3", linewidth=0.8, linestyle="--", label="goal 0.97")
        top.set_title("greedy" if t == 0 else f"T={t:g}")
        top.set_ylabel("output tokens / s")
        bottom.set_ylabel("/ best of none, fixed")
        bottom.set_xlabel("concurrency (requests in flight)")
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(cs, [str(c) for c in cs])
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=7)
    reps = max(len(v) for v in runs.values())
    fig.suptitle(f"{a.model}: throughput against concurrency (median of {reps})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def load_runs(path: Path, prompts: str = "tuning") -> dict[tuple[str, float, int], list[dict]]:
    """The runs ``--out`` saved, of the prompt set ``prompts`` (files written before the
    sets: the tuning set)."""
    return {
        (e["config"], float(e["temperature"]), int(e["concurrency"])): e["runs"]
        for e in json.loads(path.read_text())
        if e.get("prompts", "tuning") == prompts
    }


def pool_runs(
    saved: list[dict[tuple[str, float, int], list[dict]]],
) -> dict[tuple[str, float, int], list[dict]]:
    """The repeats of several sweeps' runs, per cell and configuration, in order (every
    sweep must hold the same cells and configurations)."""
    keys = set(saved[0])
    for i, runs in enumerate(saved[1:], start=2):
        if set(runs) != keys:
            raise SystemExit(
                f"--replot: file {i} holds other cells or configurations than the first "
                f"({sorted(set(runs) ^ keys)[:4]} ...); pool only sweeps of the same cells"
            )
    return {k: [r for runs in saved for r in runs[k]] for k in saved[0]}


# -- --simulate: the plain / drafting choice on a synthetic machine ---------------------------

SIM_GAMMA = 5
SIM_ACCEPT = 0.7  # each draft position accepted with this probability
SIM_NOISE = 0.08  # log sd of a step's time outside the slow spells
SIM_WARMUP = 120  # steps not counted
SIM_TAIL_REQUESTS = 2
SIM_TAIL_BIAS = 0.7  # a tail's drafting steps: this much of the profile's time


def sim_profile() -> Any:
    """The profile the decision is seeded with, and the machine's law before its biases."""
    from xspec.spec.adaptive.cost import StepCost

    return StepCost(
        requests=[1, 64],
        drafts=[0, SIM_GAMMA],
        seconds=[[1.0, 2.0], [1.0, 2.0]],
        draft_seconds=[0.5, 0.5],
    )


def simulate(
    a: argparse.Namespace, seed: int, spell: int, ratio: float, kind: str = "adaptive"
) -> tuple[float, float]:
    """One run: the share of big-batch steps after the warm-up that drafted, and their
    committed tokens per second. ``kind``: ``adaptive`` (the decision), or every step
    ``plain`` or ``drafting`` (forced: the fixed choices to compare it with). The machine
    (its spells and noise) is the same for every kind of one seed."""
    import random

    from xspec.sampling import SamplingParams
    from xspec.spec.adaptive import AdaptiveDepth
    from xspec.spec.adaptive.online import OnlineStepCost

    machine, accept = random.Random(seed), random.Random(seed + 10_000)
    profile = sim_profile()
    force = None
    if kind != "adaptive":
        force = (lambda caps: caps) if kind == "drafting" else (lambda caps: [0] * len(caps))
    s = AdaptiveDepth(SIM_GAMMA, cost=OnlineStepCost(profile), force=force)
    histories = {r: [s.new_history() for _ in range(r)] for r in (SIM_TAIL_REQUESTS, a.batch)}
    params = [SamplingParams(temperature=0.8)] * a.batch
    speed, drafted, counted, tokens, seconds_total = 1.0, 0, 0, 0, 0.0
    last: dict[int, bool] = {}  # batch size -> whether its last step drafted
    for t in range(a.steps):
        if t % spell == 0:
            speed = machine.choice([1.0, ratio])
        sigma = a.spell_noise if speed != 1.0 else SIM_NOISE
        noise = math.exp(machine.gauss(0.0, sigma))
        tail = t % a.tail_every >= a.tail_every - a.tail
        R = SIM_TAIL_REQUESTS if tail else a.batch
        depths = s.depths(params[:R], histories[R], [SIM_GAMMA] * R)
        drafting = sum(d > 0 for d in depths)
        bias = (SIM_TAIL_BIAS if tail else a.draft_bias) if drafting else 1.0
        seconds = profile.seconds_at(R, R + sum(depths), drafting) * speed * bias * noise
        if last.setdefault(R, drafting > 0) != (drafting > 0):  # a switch: its first step
            seconds *= 1.0 + a.switch_cost[drafting > 0]
        last[R] = drafting > 0
        accepted = []
        for d in depths:
            k = 0
            while k < d and accept.random() < SIM_ACCEPT:
                k += 1
            accepted.append(k)
        s.learn(histories[R], depths, accepted, seconds=seconds)
        if t >= SIM_WARMUP and not tail:
            counted += 1
            drafted += drafting > 0
            tokens += R + sum(accepted)
            seconds_total += seconds
    return drafted / max(counted, 1), tokens / seconds_total


def run_simulation(a: argparse.Namespace, spells: list[tuple[str, int, float]]) -> None:
    """``--simulate``: per spell pattern, the share of drafting steps against the right
    answer, and the tokens per second against the better fixed kind's."""
    profile = sim_profile()
    # a plain step: R tokens in its profiled time; a drafting step: R (1 + sum_j ACCEPT^j)
    tokens = 1 + sum(SIM_ACCEPT**j for j in range(1, SIM_GAMMA + 1))
    drafting = tokens / (profile.seconds_at(a.batch, a.batch * (SIM_GAMMA + 1)) * a.draft_bias)
    value = drafting / (1 / profile.seconds_at(a.batch, a.batch, 0))  # drafting / plain
    better = "drafting" if value > 1 else "plain"
    print(
        f"share of {a.batch}-request steps that drafted; drafting makes {value:.2f}x a plain "
        f"step's value, so {better} is right (share {1 if value > 1 else 0}); per seed and mean"
    )
    for pattern, spell, slow in spells:
        runs = [simulate(a, seed, spell, slow) for seed in range(a.seeds)]
        shares = [share for share, _ in runs]
        best = [
            max(simulate(a, seed, spell, slow, kind)[1] for kind in ("plain", "drafting"))
            for seed in range(a.seeds)
        ]
        ratio = statistics.fmean(v / b for (_, v), b in zip(runs, best))
        per_seed = " ".join(f"{x:.2f}" for x in shares)
        print(
            f"  spells {pattern:>7}: mean {statistics.fmean(shares):.3f}  [{per_seed}]  "
            f"tokens/s {ratio:.3f}x the better fixed kind's"
        )


def simulation_args(ap: argparse.ArgumentParser) -> None:
    """The ``--simulate`` options."""
    g = ap.add_argument_group("--simulate: the decision on a synthetic machine")
    g.add_argument("--simulate", action="store_true", help="run the simulation only")
    g.add_argument("--seeds", type=int, default=8)
    g.add_argument("--steps", type=int, default=800)
    g.add_argument("--batch", type=int, default=32)
    g.add_argument("--draft-bias", type=float, default=1.47)
    g.add_argument("--tail-every", type=int, default=60)
    g.add_argument("--tail", type=int, default=10)
    g.add_argument("--spells", nargs="+", default=["20:1.0", "20:1.7", "8:1.7", "50:1.7"])
    g.add_argument("--spell-noise", type=float, default=SIM_NOISE)
    g.add_argument(
        "--switch-cost",
        type=float,
        nargs=2,
        default=[0.0, 0.0],
        metavar=("PLAIN", "DRAFTING"),
        help="the first step of a kind after the other kind costs 1 + this more",
    )


def simulation_spells(ap: argparse.ArgumentParser, a: argparse.Namespace) -> list:
    """The ``--spells`` patterns, checked with the other ``--simulate`` options."""
    if min(a.switch_cost) < 0:
        ap.error(f"--switch-cost {a.switch_cost} must be >= 0")
    if a.spell_noise < 0:
        ap.error(f"--spell-noise {a.spell_noise} must be >= 0 (a log sd)")
    if not 0 <= a.tail < a.tail_every:
        ap.error(f"--tail {a.tail} must be below --tail-every {a.tail_every}")
    spells = []
    for pattern in a.spells:
        try:
            length, speed = pattern.split(":")
            spell, slow = int(length), float(speed)
        except ValueError:
            ap.error(f"--spells {pattern!r}: expected LEN:RATIO, e.g. 20:1.7")
        if spell < 1 or slow <= 0:
            ap.error(f"--spells {pattern!r}: LEN must be >= 1 and RATIO > 0")
        spells.append((pattern, spell, slow))
    return spells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument(
        "--requests-per-slot",
        type=int,
        default=2,
        help="each run has max(this * concurrency, --min-requests) requests (more: less "
        "of the sample paths' spread at T>0 per run, see the docstring)",
    )
    ap.add_argument(
        "--min-requests",
        type=int,
        default=8,
        help="each run has at least this many requests (at low concurrency the sampled "
        "paths of a few waves set the run's steps, see the docstring)",
    )
    ap.add_argument(
        "--max-new-spread",
        type=int,
        default=0,
        help="each request's new tokens spread evenly over --max-new +- this (the same "
        "mean; 0: every request --max-new, all of a wave ending together)",
    )
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--schedule", default=DEFAULT_SCHEDULE, help="spec.gamma_schedule")
    ap.add_argument("--prompts", type=Path, default=PROMPTS, help="the tuning prompt set")
    ap.add_argument(
        "--judge",
        choices=("tuning", "heldout", "both"),
        default="tuning",
        help="the prompts to judge on: --prompts (what the rule was tuned on), "
        f"{HELDOUT.name} (held out from tuning), or both, interleaved, side by side",
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(CONFIGS),
        help="the configurations to run (spec=none, fixed gamma and adaptive at least)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    ap.add_argument(
        "--warmup",
        choices=("workload", "two"),
        default="workload",
        help="before the measured run: the whole workload once (steady state) or two requests",
    )
    ap.add_argument("--out", type=Path, default=None, help="every run's figures as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="throughput vs concurrency (SVG)")
    ap.add_argument(
        "--replot",
        type=Path,
        nargs="+",
        default=None,
        help="only print the tables of and plot the runs of --out JSON files (several: "
        "their repeats pooled, in order)",
    )
    ap.add_argument(
        "--first-rep",
        type=int,
        default=0,
        help="the first repeat's index (repeat i samples with sampling.seed=i): a second "
        "sweep with --first-rep 8 adds fresh seeds to pool with --replot",
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run (see the docstring)")
    ap.add_argument(
        "--turns",
        action="store_true",
        help="the configurations of a cell alive at once, stepped in turns (each in its own "
        "process): robust to the machine's slow spells",
    )
    ap.add_argument(
        "--turn-ms",
        type=float,
        default=100.0,
        help="with --turns: each turn steps until this many ms of its own (at least one "
        "iteration; 0: one iteration a turn)",
    )
    ap.add_argument(
        "--twin",
        action="store_true",
        help="run fixed gamma twice per cell, in two processes: their ratio is what the "
        "harness itself moves (the noise floor of the others' ratios)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. model=dsv4_tiny")
    simulation_args(ap)
    a = ap.parse_args()
    if a.simulate:
        run_simulation(a, simulation_spells(ap, a))
        return
    if a.requests_per_slot < 1:
        ap.error(f"--requests-per-slot must be at least 1, got {a.requests_per_slot}")
    if a.min_requests < 1:
        ap.error(f"--min-requests must be at least 1, got {a.min_requests}")
    if a.child is not None:
        print(json.dumps(child(json.loads(a.child), sys.stdin if a.turns else None)), flush=True)
        if a.turns:  # exit once every configuration of the cell is done (drive_turns)
            sys.stdin.read()
        return
    a.model = dict(o.split("=", 1) for o in a.overrides).get("model", "dsv4_tiny")
    if a.replot is not None:
        saved = pool_runs(
            [load_runs(p, "heldout" if a.judge == "heldout" else "tuning") for p in a.replot]
        )
        a.temperatures = sorted({t for _, t, _ in saved})
        a.concurrency = sorted({c for _, _, c in saved})
        a.reps = max(len(v) for v in saved.values())
        print(table(a, saved))
        plot(a, saved, a.plot or a.replot[0].with_suffix(".svg"))
        return
    if not set(RATIO_CONFIGS) <= set(a.configs):
        ap.error(f"--configs {a.configs} must include {' '.join(RATIO_CONFIGS)}")
    if a.quick:
        a.concurrency, a.temperatures, a.reps, a.max_new = [1, 8], [0.0], 1, 16
    if not 0 <= a.max_new_spread < a.max_new:
        ap.error(
            f"--max-new-spread must be in [0, --max-new), got {a.max_new_spread} "
            f"(--max-new {a.max_new})"
        )
    configs = tuple(a.configs) + ((TWIN,) if a.twin else ())
    by_set = sweep(a, configs)
    for name, runs in by_set.items():
        if len(by_set) > 1:
            print(f"\n## prompts: {name} ({prompts_of(a, name)})")
        print(table(a, runs))
        print(details(a, runs))
        for t in a.temperatures:
            if t == 0:  # greedy: every configuration must produce the same tokens
                same = all(
                    runs[(cfg, t, c)][0]["outputs"] == runs[("none", t, c)][0]["outputs"]
                    for cfg in configs
                    for c in a.concurrency
                )
                print(f"greedy outputs equal spec=none in every configuration: {same}")
    if len(by_set) > 1:
        print(side_by_side(a, by_set))
    if a.out is not None:
        from xspec import atomic

        body = [
            {"prompts": name, "config": cfg, "temperature": t, "concurrency": c, "runs": rs}
            for name, runs in by_set.items()
            for (cfg, t, c), rs in runs.items()
        ]
        atomic.write_json(a.out, body)
    if a.plot is not None:
        plot(a, next(iter(by_set.values())), a.plot)


def prompts_of(a: argparse.Namespace, name: str) -> Path:
    """The prompts file of the prompt set ``name`` (``tuning``: ``--prompts``)."""
    return PROMPT_SETS[name] or a.prompts


def sweep(
    a: argparse.Namespace, configs: tuple[str, ...]
) -> dict[str, dict[tuple[str, float, int], list[dict]]]:
    """Every run of the sweep, per prompt set (``--judge``): per repeat, temperature,
    concurrency and prompt set, a cell of every configuration, in an order rotated from
    cell to cell (interleaved, so a slow spell falls on all of them)."""
    sets = list(PROMPT_SETS) if a.judge == "both" else [a.judge]
    by_set: dict[str, dict[tuple[str, float, int], list[dict]]] = {n: {} for n in sets}
    cells = len(a.temperatures) * len(a.concurrency) * len(sets)
    t0, k = time.perf_counter(), a.first_rep * cells
    for rep in range(a.first_rep, a.first_rep + a.reps):
        for t in a.temperatures:
            for c in a.concurrency:
                for name in sets:
                    cell_a = argparse.Namespace(**{**vars(a), "prompts": prompts_of(a, name)})
                    turn = k % len(configs)
                    order = configs[turn:] + configs[:turn]  # rotated: interleaved
                    k += 1
                    cell = run_cell_in_turns(list(order), cell_a, t, c, rep) if a.turns else None
                    for config in order:
                        r = cell[config] if cell is not None else run_one(config, cell_a, t, c, rep)
                        by_set[name].setdefault((config, t, c), []).append(r)
                        print(
                            f"rep {rep} T={t:g} c={c:>2} {name:>7} {config:>8}: "
                            f"{r['tok_s']:7.1f} tok/s ({time.perf_counter() - t0:.0f} s)",
                            flush=True,
                        )
    return by_set


def side_by_side(
    a: argparse.Namespace, by_set: dict[str, dict[tuple[str, float, int], list[dict]]]
) -> str:
    """Adaptive / best (the median of the per-repeat ratios) and adaptive / fixed gamma,
    per prompt set, side by side: the judged figure next to the tuned one."""
    names = list(by_set)
    head = " | ".join(f"{n}: / best | {n}: / fixed" for n in names)
    out = [
        "\nadaptive / best and / fixed gamma (medians of the per-repeat ratios), per prompt set:\n",
        f"| mode | concurrency | {head} |",
        "|---|---|" + "---|---|" * len(names),
    ]
    for t in a.temperatures:
        for c in a.concurrency:
            cells = []
            for n in names:
                runs = by_set[n]
                over_fixed = [
                    x["tok_s"] / f["tok_s"]
                    for x, f in zip(runs[("adaptive", t, c)], runs[("fixed", t, c)])
                ]
                best = statistics.median(paired(runs, "adaptive", t, c))
                cells.append(f"{best:.2f} | {statistics.median(over_fixed):.2f}")
            mode = "greedy" if t == 0 else f"T={t:g}"
            out.append(f"| {mode} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
