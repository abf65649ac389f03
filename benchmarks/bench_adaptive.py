"""Speculation that never loses: ``spec=none`` vs fixed-gamma DSpark vs ``spec.adaptive``
vs ``spec.gamma_schedule``, against concurrency, greedy and sampled.

    python benchmarks/bench_adaptive.py [--concurrency 1 4 8 16 32 64] [--temperatures 0 0.8]
        [--reps 2] [--max-new 64] [--gamma 5] [--schedule '[[1,5],[8,3],[16,0]]']
        [--warmup workload|two] [--out FILE.json] [--plot FILE.svg] [--replot FILE.json ...]
        [--turns] [--twin] [--quick]
        [key=value ...]                                   # e.g. model=dsv4_tiny

Every (configuration, temperature, concurrency, repeat) runs in **its own process**
(``--child``: build, one unmeasured warm-up, then the measured run of the workload;
output tok/s = generated tokens / wall time of ``Engine.run``), and the
configurations are **interleaved**: per repeat, temperature and concurrency the four
run back to back, in an order rotated every time, so a slow spell of a shared machine
falls on all of them. Figures are medians over ``--reps``. Repeat i samples with
``sampling.seed=i`` (every configuration of the repeat alike): at T=0.8 a run's
acceptance depends on the path its samples took, and one plain step changes every later
sample, so with one seed for every repeat a configuration measured one path three times
(at concurrency 4, tokens per drafting step moved from 11.0 to 12.7 between seeds; with
seed 0 adaptive decided the same steps in every repeat and made 0.82x of fixed gamma in
each, 0.90-1.03x over seeds 1-3).

The prompts are ``benchmarks/adaptive_prompts.jsonl``: 24 code prompts (``corpus.prompts``,
seed 23) from held-out standard-library files that neither the default workload's prompts
(``tty``, ``tracemalloc``, ``encodings/utf_16_le``, ``encodings/utf_32_le``) nor the
shipped draft's calibration prompts come from: ``asyncio/taskgroups``,
``asyncio/windows_utils``, ``ctypes/_endian``, ``enum``, ``importlib/_bootstrap``,
``importlib/metadata/_meta``, ``importlib/resources/readers``,
``lib2to3/fixes/fix_itertools``, ``lib2to3/fixes/fix_paren``, ``re/_compiler`` (the tiny
model never trained on any held-out file: ``xspec/train/corpus.py``). Each run has
``max(2 * concurrency, 8)`` requests of ``--max-new`` tokens (eos ignored;
``--requests-per-slot`` sets the 2, ``--min-requests`` the 8). At T>0 and low
concurrency, give more (``--min-requests 32``): a run of 8 requests at 4 is two waves,
about 34 steps, 30-42 over seeds with the paths the samples took, and adaptive and fixed
gamma never share a path (the trim changes which draws a request makes): over 24 seeds
in one process adaptive took 34.0 steps and fixed gamma 33.6, at the same batch
occupancy, where four repeats of a sweep had it 9-12 % ahead. ``--max-new-spread S`` gives
the requests ``--max-new - S .. --max-new + S`` new tokens instead, evenly spaced, dealt
out of order (the same tokens in all): without it, every request of a wave ends at the
same step under ``spec=none`` (one batched prefill refills the batch, nothing runs at
part occupancy), while a drafting run's requests end where their acceptance took them (a
prefill iteration per newcomer, a tail of the last few). At 16 requests, T=0.8, in one
process, a spread of 8 took ``spec=none`` from 484 to 459 tok/s and fixed gamma from 479
to 479 (seeds 700-703): how much of ``spec=none``'s lead there is the lockstep of equal
lengths, which a served workload does not have.

The warm-up (``--warmup``): ``workload`` (default) runs the same workload once, unmeasured,
in every configuration: what a server under this load has learnt by the time anyone
measures it (``spec.adaptive`` learns its step costs, value checks and acceptance online,
and a measured run of 10-20 decode steps per wave would otherwise weigh its first
steps' exploration as if a server restarted every few seconds); ``two``: two requests at
concurrency 2 (the first calls' one-off costs only: a cold start).

Printed: the markdown tables of docs/adaptive.md (tok/s per configuration, and the
ratios adaptive / best-of(none, fixed) and schedule / best-of(none, fixed); the issue's
bar is >= 0.97 everywhere), then per adaptive run the depth histogram, the steps that
drafted nothing and the cost model's predicted vs measured step time, and for fixed
gamma and adaptive where the time went: decode steps, ms per decode step, seconds of
decode and of prefill (at T=0.8 and 4 requests, in turns of one iteration, the gap was
in the steps: adaptive took 37.8 against 33.9 over seeds 400-407, its steps 0.5-1 ms
cheaper; in turns of 100 ms, 33.5 against 33). ``--out`` keeps
every run's figures as JSON, ``--plot FILE.svg`` draws output tok/s against concurrency
(``--replot FILE.json --plot FILE.svg`` prints the tables of a saved run and redraws it;
give it the run's ``--max-new``, ``--gamma`` and ``--schedule`` for the headings; several
files pool their repeats, e.g. a second sweep run with ``--first-rep 8``, whose repeats
sample with seeds 8 and up, so that at T=0.8 the pooled repeats follow fresh paths).
``--quick``: concurrency 1 and 8, greedy only, one repeat, 16 new tokens (a smoke run,
minutes).

The tables give adaptive / best as the ratio of the medians (the goal's figure), per
repeat, and the 90 % bootstrap interval of the ratio of medians (the repeats resampled
whole, ``xspec.bench.stats.bootstrap_interval``): how far the figure could move with
other repeats of the same machine. ``--twin`` runs fixed gamma a second time in each
cell, in a process of its own, and prints its ratio to the first: the same
configuration, so whatever that ratio moves is the harness's own noise (a process's speed
differs from another's by a few percent for the whole run, whatever it runs), the floor
under every other ratio.

``--turns``: the configurations of a cell alive at once, each in its own process, stepped
in turns over a pipe; a turn is engine iterations until ``--turn-ms`` (100) of the
process's own time, at least one. Each counts only its own iterations' time, and a slow
spell of the machine (seconds long) falls on every configuration alike. A turn of one
iteration (``--turn-ms 0``, the harness before 2026-12-05) charged every step the
switch between processes, about 6 ms at 4 requests (the others' data in the caches, their
threads' wake-ups): fixed depths 1..5 took 22.2-26.9 ms a step there against 16.3-21.8 in
a process of its own, so it favoured fewer, larger steps and made a row look cheap
against a step (``spec=none`` at T=0.8 and 4 requests: 207 tok/s in turns of one
iteration, 271 in turns of 100 ms, the same seeds). A child done early stays alive
until the last one is done (:func:`drive_turns`): until 2026-12-05 its exit ran beside
the others' last turns and made four identical processes differ by up to 45 %.
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
CONFIGS = ("none", "fixed", "adaptive", "schedule")
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
    from xspec.metrics import SpecDecodeMetrics
    from xspec.run.workloads import load_workload
    from xspec.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    o = dict(spec["overrides"])
    model, method = o.pop("model"), o.pop("spec")
    llm = xspec.LLM(model=model, spec=method, overrides=o)
    built, engine = llm._built, llm._built.engine
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
    engine.metrics = SpecDecodeMetrics()
    if engine.speculation is not None and engine.speculation.cost is not None:
        engine.speculation.cost.reset_report()  # predicted vs measured: the measured run
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
    speculation = engine.speculation
    if speculation is not None and speculation.cost is not None:
        out["step_time"] = speculation.cost.summary()
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
    when its stdin closes, and that comes after the last one's figures. Until
    2026-12-05 a child exited as soon as it was done, and its exit (freeing its memory,
    the interpreter's shutdown) ran beside the turns of those still measuring, so
    whichever finished in a later turn paid for the exits before it. Four processes of
    fixed gamma (greedy, 4 requests, seeds 616-619) took 21.8-22.5 ms a decode step
    first in the turn order and 27.2-31.8 ms last on one core (``taskset -c 1``),
    21.3-26.8 ms on the two, where their median steps were the same (23.7-24.2 ms): the
    run's last steps took 12-17 ms in the first process and 30-66 ms in the others,
    after its exit. Now 21.3-22.4 ms on one core and on two, whatever the position."""
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

    out = []
    for t in a.temperatures:
        mode = "greedy" if t == 0 else f"T={t:g}"
        out += [
            f"\n{mode}, output tok/s (median of {a.reps}), {new_tokens(a)} new tokens, "
            f"gamma {a.gamma}, schedule {a.schedule}:\n",
            "| concurrency | spec=none | dspark fixed | adaptive | schedule "
            "| adaptive / best | schedule / best |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in a.concurrency:
            v = {k: med(k, t, c) for k in CONFIGS}
            best = max(v["none"], v["fixed"])
            out.append(
                f"| {c} | {v['none']:.0f} | {v['fixed']:.0f} | {v['adaptive']:.0f} | "
                f"{v['schedule']:.0f} | {v['adaptive'] / best:.2f} | {v['schedule'] / best:.2f} |"
            )
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
    """A configuration's decode / prefill split over its repeats (None: not recorded, a
    run saved before 2026-12-05)."""
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
        }
        best = [max(n, f) for n, f in zip(med["none"], med["fixed"])]
        for cfg in CONFIGS:
            top.plot(cs, med[cfg], styles[cfg], label=LABELS[cfg], linewidth=1.5, markersize=5)
        for cfg in ("adaptive", "schedule"):
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


def load_runs(path: Path) -> dict[tuple[str, float, int], list[dict]]:
    """The runs ``--out`` saved."""
    return {
        (e["config"], float(e["temperature"]), int(e["concurrency"])): e["runs"]
        for e in json.loads(path.read_text())
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
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
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
    a = ap.parse_args()
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
        saved = pool_runs([load_runs(p) for p in a.replot])
        a.temperatures = sorted({t for _, t, _ in saved})
        a.concurrency = sorted({c for _, _, c in saved})
        a.reps = max(len(v) for v in saved.values())
        print(table(a, saved))
        plot(a, saved, a.plot or a.replot[0].with_suffix(".svg"))
        return
    if a.quick:
        a.concurrency, a.temperatures, a.reps, a.max_new = [1, 8], [0.0], 1, 16
    if not 0 <= a.max_new_spread < a.max_new:
        ap.error(
            f"--max-new-spread must be in [0, --max-new), got {a.max_new_spread} "
            f"(--max-new {a.max_new})"
        )
    configs = (*CONFIGS, TWIN) if a.twin else CONFIGS
    runs: dict[tuple[str, float, int], list[dict]] = {}
    t0, k = time.perf_counter(), a.first_rep * len(a.temperatures) * len(a.concurrency)
    for rep in range(a.first_rep, a.first_rep + a.reps):
        for t in a.temperatures:
            for c in a.concurrency:
                turn = k % len(configs)
                order = configs[turn:] + configs[:turn]  # rotated: interleaved
                k += 1
                cell = run_cell_in_turns(list(order), a, t, c, rep) if a.turns else None
                for config in order:
                    r = cell[config] if cell is not None else run_one(config, a, t, c, rep)
                    runs.setdefault((config, t, c), []).append(r)
                    print(
                        f"rep {rep} T={t:g} c={c:>2} {config:>8}: {r['tok_s']:7.1f} tok/s "
                        f"({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
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
    if a.out is not None:
        from xspec import atomic

        body = [
            {"config": cfg, "temperature": t, "concurrency": c, "runs": rs}
            for (cfg, t, c), rs in runs.items()
        ]
        atomic.write_json(a.out, body)
    if a.plot is not None:
        plot(a, runs, a.plot)


if __name__ == "__main__":
    main()
