"""What a CLI run leaves on disk: ``results.json`` per job, and a summary per invocation.

Layout (Hydra's conventions; ``hydra.run.dir=`` / ``hydra.sweep.dir=`` move them)::

    outputs/<date>/<time>/results.json        a single run (+ summary.{json,md,png})
    multirun/<date>/<time>/<job>/results.json  each job of a multirun (-m)
    multirun/<date>/<time>/summary.json        every job's headline figures + speedups
    multirun/<date>/<time>/summary.md          the same table as printed
    multirun/<date>/<time>/summary.png         TPOT per job and the acceptance profile

Figures of a job are medians over its ``workload.repeats`` measured runs (each run's
own figures are under ``repeats``); see xspec/run/report.py for the timing rules.
Speedups compare a job with the ``spec=none`` job of the same model, platform and
concurrency in the same invocation (null when there is none).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from xspec import atomic
from xspec.build import Built
from xspec.config import WorkloadConfig
from xspec.engine.engine import Generation
from xspec.run.report import served, spread

RESULTS_FILE = "results.json"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
SUMMARY_PNG = "summary.png"

# the per-run figures; a job's figure is the median over its repeats
FIGURES = (
    "input_tokens_mean",
    "output_tokens_mean",
    "ttft_ms_mean",
    "tpot_ms_mean",
    "e2e_ms_mean",
    "queue_ms_mean",
    "output_tok_s",
)


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def run_figures(gens: list[Generation]) -> dict[str, Any]:
    """One measured run: means over its requests (TPOT: requests with >= 2 tokens).
    TTFT, TPOT and e2e count from each request's admission, queue from the run's start."""
    ok = served(gens)  # latencies of the requests that were served
    tpots = [g.tpot_s * 1e3 for g in ok if g.tpot_s is not None]
    output_tokens = sum(len(g.token_ids) for g in gens)
    wall_s = max(g.finished_at for g in gens)
    return {
        "input_tokens_mean": _mean([len(g.prompt_ids) for g in gens]),
        "output_tokens_mean": _mean([len(g.token_ids) for g in gens]),
        "ttft_ms_mean": _mean([g.ttft_s * 1e3 for g in ok]),
        "tpot_ms_mean": _mean(tpots),
        "e2e_ms_mean": _mean([g.latency_s * 1e3 for g in ok]),
        "queue_ms_mean": _mean([g.queue_s * 1e3 for g in ok]),
        "output_tok_s": output_tokens / wall_s if wall_s > 0 else None,
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "errors": sum(g.error is not None for g in gens),
    }


def _request(g: Generation, repeat: int) -> dict[str, Any]:
    return {
        "repeat": repeat,
        "prompt_tokens": len(g.prompt_ids),
        "output_token_ids": list(g.token_ids),
        "ttft_ms": g.ttft_s * 1e3,
        "tpot_ms": g.tpot_s * 1e3 if g.tpot_s is not None else None,
        "e2e_ms": g.latency_s * 1e3,
        "queue_ms": g.queue_s * 1e3,
        "error": g.error,
    }


def _prefix_cache(built: Built) -> dict[str, Any] | None:
    """The prefix cache's figures of the run (prompt tokens), None when it is off."""
    cache, m = built.engine.prefix_cache, built.engine.metrics
    if cache is None:
        return None
    return {
        "queries": m.prefix_queries,
        "hits": m.prefix_hits,
        "hit_rate": m.prefix_hit_rate,
        "bytes_held": cache.nbytes,
        "entries": len(cache),
        "evicted": cache.stats.evicted,
        "block": cache.block,
    }


def job_results(
    built: Built, w: WorkloadConfig, runs: list[list[Generation]], model_option: str
) -> dict[str, Any]:
    """A job's results.json content (plain JSON types only) for the runs of workload ``w``."""
    cfg, gamma = built.cfg, built.drafter.gamma
    per_run = [run_figures(gens) for gens in runs]
    medians: dict[str, Any] = {}
    half_ranges: dict[str, Any] = {}
    for key in FIGURES:
        s = spread([r[key] for r in per_run])
        medians[key] = s.median if s is not None else None
        half_ranges[key] = s.half_range if s is not None else None
    rep = built.engine.metrics.report()
    acceptance = None
    if gamma > 0:
        acceptance = {
            "aggregate": rep.acceptance_rate,
            # vLLM's / SGLang's acceptance length (bonus included) and xspec's (excluded)
            "acceptance_length": rep.acceptance_length,
            "mean_accepted_length": rep.mean_accepted_length,
            "per_position": rep.survival,
            "full_block": rep.full_block_fraction,
            "zero_accept": rep.zero_accept_fraction,
        }
        if rep.calibration:
            acceptance["calibration"] = [
                {"predicted": p, "realised": r} for p, r in rep.calibration
            ]
            acceptance["predicted_rate"] = rep.predicted_acceptance_rate
            acceptance["realised_rate"] = rep.realised_acceptance_rate
            acceptance["calibrated"] = built.drafter.calibration_file is not None
        if rep.regimes:  # predicted vs realised acceptance per sampling regime
            acceptance["regimes"] = rep.regimes
        acceptance["depth_histogram"] = rep.depth_histogram
        acceptance["steps_without_drafts"] = rep.num_steps_without_drafts
    return {
        "model": model_option,
        "arch": cfg.model.arch,
        "spec": cfg.spec.method,
        "platform": built.platform.name,
        "gamma": gamma,
        "concurrency": w.concurrency,
        "num_requests": w.num_requests,
        **medians,
        "mean_committed_per_step": rep.mean_tokens_per_step,
        "mean_target_rows_per_step": rep.mean_target_rows,  # per request (anchor + drafts)
        "wasted_target_rows": rep.num_wasted_target_rows,  # verified, then rejected
        "adaptive": _adaptive(built),
        "gamma_schedule": cfg.spec.gamma_schedule,
        "acceptance": acceptance,
        "spec_decode": asdict(rep),  # the counters the Prometheus export serves
        "prefix_cache": _prefix_cache(built),
        "num_repeats": len(runs),
        "half_range": half_ranges,  # (max - min) / 2 over the repeats
        "repeats": per_run,
        "requests": [_request(g, k) for k, gens in enumerate(runs) for g in gens],
        "parallel": parallel_figures(built),
    }


def parallel_figures(built: Built) -> dict[str, Any]:
    """The launch layout and the routed-expert bytes each rank holds (docs/parallel.md)."""
    topo, p = built.parallel.topology, built.cfg.parallel
    return {
        "world": topo.world,
        "dp": topo.dp,
        "ep": topo.ep,
        "moe_exchange": built.parallel.exchange if topo.ep > 1 else None,
        "expert_bytes_per_rank": built.expert_bytes,
        "timeout_s": p.timeout_s,
    }


def _adaptive(built: Built) -> dict[str, Any] | None:
    """``spec.adaptive``: the profile and calibration the scheduler used (None when off)."""
    if built.profile is None:
        return None
    calibration = built.drafter.calibration_file
    cal = built.drafter.calibration
    figures = built.engine.policy.summary() or {}
    return {
        "profile": str(built.profile.path) if built.profile.path else None,
        "profile_source": built.profile.source,
        "calibration": str(calibration) if calibration is not None else None,
        "calibrated": calibration is not None,
        "calibration_regimes": [f.fitted_regime() for f in cal.fits()] if cal else [],
        # the step-cost model's predicted vs measured decode-step time over the run
        "step_time": figures.get("step_time"),
        # realised / expected committed tokens of drafting steps (the yield check)
        "yield_check": figures.get("yield_check"),
    }


def _baseline(row: dict[str, Any], jobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    same = ("model", "platform", "concurrency")
    return next(
        (j for j in jobs if j["spec"] == "none" and all(j[k] == row[k] for k in same)), None
    )


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def summary_rows(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per job: its headline figures and speedups vs spec=none."""
    rows = []
    for j in jobs:
        base = _baseline(j, jobs)
        acc = j["acceptance"]
        rows.append(
            {
                **{k: j[k] for k in ("model", "spec", "platform", "gamma", "concurrency")},
                "adaptive": j.get("adaptive") is not None,
                "mean_target_rows_per_step": j.get("mean_target_rows_per_step"),
                **{k: j[k] for k in ("num_requests", "num_repeats", *FIGURES)},
                "half_range": j["half_range"],
                "acceptance": acc["aggregate"] if acc is not None else None,
                "acceptance_length": acc.get("acceptance_length") if acc is not None else None,
                "mean_committed_per_step": j["mean_committed_per_step"],
                "speedup_tpot": _ratio(
                    None if base is None else base["tpot_ms_mean"], j["tpot_ms_mean"]
                ),
                "speedup_tok_s": _ratio(
                    j["output_tok_s"], None if base is None else base["output_tok_s"]
                ),
            }
        )
    return rows


def _fmt(row: dict[str, Any], key: str, spec: str) -> str:
    value = row[key]
    if value is None:
        return "n/a"
    half = row.get("half_range", {}).get(key)
    if row.get("num_repeats", 1) > 1 and half is not None:
        return f"{value:{spec}} ±{half:{spec}}"
    return f"{value:{spec}}"


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    """The combined table (GitHub markdown; also what the CLI prints)."""
    repeats = sorted({r["num_repeats"] for r in rows})
    head = [
        "model", "spec", "gamma", "conc", "tok/s", "TTFT ms", "queue ms", "TPOT ms",
        "accept", "tok/step", "speedup TPOT", "speedup tok/s",
    ]  # fmt: skip
    lines = [
        f"figures: median ±half the min-max range over {'/'.join(map(str, repeats))} "
        "repeat(s); TPOT over requests with >= 2 output tokens; speedups vs spec=none "
        "at the same model, platform and concurrency (ratios of medians)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    for r in rows:
        cells = [
            r["model"], r["spec"] + ("+adaptive" if r.get("adaptive") else ""),
            str(r["gamma"]), str(r["concurrency"]),
            _fmt(r, "output_tok_s", ".1f"), _fmt(r, "ttft_ms_mean", ".1f"),
            _fmt(r, "queue_ms_mean", ".1f"), _fmt(r, "tpot_ms_mean", ".2f"),
            f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-",
            f"{r['mean_committed_per_step']:.3f}",
            _fmt(r, "speedup_tpot", ".3f"), _fmt(r, "speedup_tok_s", ".3f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(jobs: list[dict[str, Any]], path: Path) -> bool:
    """TPOT per job and the acceptance profile (survival per draft position); False when
    matplotlib is not installed (``pip install 'xspec[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{j['model']}\n{j['spec']} g={j['gamma']} c={j['concurrency']}" for j in jobs]
    fig, (ax_tpot, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_tpot.bar(range(len(jobs)), [j["tpot_ms_mean"] or 0.0 for j in jobs])
    ax_tpot.set_xticks(range(len(jobs)), labels, fontsize=7)
    ax_tpot.set_ylabel("TPOT ms (median)")
    ax_tpot.set_title("time per output token")
    for j, label in zip(jobs, labels):
        if j["acceptance"] is not None:
            survival = j["acceptance"]["per_position"]
            ax_acc.plot(range(1, len(survival) + 1), survival, marker="o", label=label)
    ax_acc.xaxis.get_major_locator().set_params(integer=True)
    ax_acc.set_xlabel("draft position")
    ax_acc.set_ylabel("survival (accepted through position)")
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_title("acceptance profile")
    if ax_acc.lines:
        ax_acc.legend(fontsize=7)
    fig.tight_layout()
    try:
        with atomic.atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=100, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return True


def write_summary(
    jobs: list[dict[str, Any]], directory: Path, failed: list[dict[str, Any]] | None = None
) -> str:
    """summary.json / summary.md into ``directory``; returns the table. ``failed``: the
    multirun jobs that crashed (job number, overrides, error), listed after the table and
    in summary.json as rows with ``"status": "failed"``."""
    failed = failed or []
    rows = summary_rows(jobs) if jobs else []
    table = summary_markdown(rows) if rows else "no job finished"
    if failed:
        table += "\n\nfailed jobs:\n" + "\n".join(
            f"- job {f['job']} ({' '.join(f['overrides']) or 'defaults'}): "
            + (f["error"].splitlines() or [""])[0]
            for f in failed
        )
    status = [{"status": "ok", **r} for r in rows]
    status += [
        {"status": "failed", **{k: f[k] for k in ("job", "overrides", "error")}} for f in failed
    ]
    atomic.write_json(directory / SUMMARY_JSON, status)
    atomic.write_text(directory / SUMMARY_MD, table + "\n")
    return table
