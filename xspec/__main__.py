"""``python -m xspec model=... spec=... platform=... key=value ...``

Hydra's usual features work (``--help``, ``--cfg job``, ``-m`` multirun). Every
override set (every job of a sweep) is composed and checked up front (config values,
registry names, checkpoint headers, platform limits, drafter fit: ``build.check``), so
a user error in any job prints one message listing the problems of every job and exits
with code 2 before any job runs, never a Python traceback.

Each job writes ``results.json`` into its Hydra directory (``outputs/<date>/<time>/``,
a multirun ``multirun/<date>/<time>/<job_num>/``); the invocation ends with
``summary.{md,json,png}`` beside them (xspec/run/results.py). A job in which every
request failed (NaN logits) still writes them, and the invocation exits with code 1
(:data:`NOTHING_SERVED_EXIT`); one where some failed says how many under its figures. ``metrics.port``
serves Prometheus text for the whole invocation (xspec/run/exporter.py).

Under ``torchrun`` (docs/parallel.md) every rank runs this entry point; rank 0 alone
prints the report and writes the files. A rank whose peer died or hangs exits with
code 3 (:data:`~xspec.parallel.runtime.PEER_FAILURE_EXIT`) and a message naming it.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig

from xspec.compose import compose_run, typed
from xspec.config import RunConfig, config_dir, register_configs, validate
from xspec.errors import ConfigError, OutputError, UserError
from xspec.parallel.topology import launch

if TYPE_CHECKING:
    from xspec.engine.engine import Generation


def _fail(e: UserError | OutputError) -> int:
    """Print a user error (exit 2) or an output error (exit 1) as one message."""
    print(f"xspec: error: {e}", file=sys.stderr)
    return e.exit_code


def _override_sets(args: list[str]) -> list[list[str]]:
    """Every combination a (multi)run will compose, for the up-front check."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = overrides_of(args)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:  # hydra raises OverrideParseException with a clear text
        raise UserError(f"cannot parse overrides: {e}") from None
    choices = []
    for text, o in zip(overrides, parsed):
        key = text.split("=", 1)[0]
        values = (
            list(o.sweep_string_iterator())
            if o.is_sweep_override()
            else [text.split("=", 1)[1] if "=" in text else ""]
        )
        choices.append([f"{key}={v}" if "=" in text else text for v in values])
    return [list(c) for c in itertools.product(*choices)]


# Hydra flags followed by a value that is not an override (``--cfg job``, ``-p model``).
_FLAGS_WITH_VALUE = frozenset(
    {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
     "--config-dir", "-cd", "--experimental-rerun"}
)  # fmt: skip


def overrides_of(args: list[str]) -> list[str]:
    """The ``key=value`` overrides among Hydra's command-line arguments."""
    out, skip = [], False
    for a in args:
        if skip or a.startswith("-"):
            skip = not skip and a in _FLAGS_WITH_VALUE
            continue
        out.append(a)
    return out


def is_multirun(args: list[str]) -> bool:
    """Whether Hydra runs these arguments as a sweep (``-m``, ``--multirun``)."""
    return any(a in ("-m", "--multirun") for a in args) or "hydra.mode=MULTIRUN" in args


def config_dirs_of(args: list[str]) -> list[str]:
    """The user's ``--config-dir DIR`` / ``-cd DIR`` / ``--config-dir=DIR`` arguments."""
    out = [a.split("=", 1)[1] for a in args if a.startswith("--config-dir=")]
    out += [b for a, b in itertools.pairwise(args) if a in ("--config-dir", "-cd")]
    return out


def check_jobs(
    override_sets: list[list[str]],
    *,
    full: bool = True,
    search: list[str] | None = None,
    multirun: bool | None = None,
) -> list[RunConfig]:
    """Compose and check every job (config, names, checkpoints, platform limits, drafter
    fit) before the first one runs; one ConfigError lists the problems of every job.
    ``full=False`` (``--cfg``: only printing the config) checks the values alone;
    ``search``: the user's ``--config-dir`` directories; ``multirun``: whether Hydra
    writes into ``hydra.sweep.dir`` or ``hydra.run.dir``, which must then take a new
    directory (None: not tried). Returns every job's config."""
    from xspec.build import check
    from xspec.run.fit import context_fit
    from xspec.run.workloads import workload_problems

    if missing := [d for d in search or [] if not Path(d).is_dir()]:
        raise ConfigError(f"--config-dir {missing[0]}: not a directory")
    if full and override_sets and (bad := output_dir_problems(override_sets[0], multirun=multirun)):
        raise ConfigError("the output directory cannot be created:", problems=bad)
    failures: list[tuple[list[str], list[str]]] = []
    configs: list[RunConfig] = []
    for overrides in override_sets:
        try:
            cfg = compose_run(overrides, search or [])
            configs.append(cfg)
            if full:  # the workload's context is checked on a config that can be built
                problems = check(cfg)
                problems += workload_problems(cfg.workload, None if problems else context_fit(cfg))
            else:
                validate(cfg)
                problems = []
        except UserError as e:
            problems = e.problems or [str(e)]
        if problems:
            failures.append((overrides, problems))
    if not failures and len({(c.metrics.host, c.metrics.port) for c in configs}) > 1:
        raise ConfigError("metrics.port / metrics.host must be the same for every job of a sweep")
    if not failures:
        return configs
    if len(override_sets) == 1:
        raise ConfigError("this run cannot be built:", problems=failures[0][1])
    lines = []
    for overrides, problems in failures:
        lines.append(f"job {' '.join(overrides) or '(defaults)'}:")
        lines += [_indent(f"  - {p}", "      ") for p in problems]
    raise ConfigError(
        f"{len(failures)} of {len(override_sets)} jobs cannot run (no job was started):\n"
        + "\n".join(f"  {line}" for line in lines)
    )


# Hydra's output directories (run: one job; sweep: a multirun): key -> an example value
_OUTPUT_DIRS = {"hydra.run.dir": "outputs/my_run", "hydra.sweep.dir": "multirun/my_sweep"}


def output_dir_problems(overrides: list[str], *, multirun: bool | None = None) -> list[str]:
    """``hydra.run.dir`` / ``hydra.sweep.dir`` (given, or conf/config.yaml's defaults)
    naming an existing file, or a path under one; and, for the one this invocation uses
    (``multirun``; None: neither), a directory in which no directory can be created (a
    read-only or full file system, no permission), tried with a directory made and
    removed at once. Hydra could not create the output directory in either case. Only
    the part before the first ``${...}`` interpolation (e.g. ``${now:...}``) is checked."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    hydra_yaml = OmegaConf.to_container(OmegaConf.load(config_dir() / "config.yaml").hydra)
    assert isinstance(hydra_yaml, dict)  # unresolved: ${now:...} stays text
    values = {key: str(hydra_yaml[key.split(".")[1]]["dir"]) for key in _OUTPUT_DIRS}
    given = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in _OUTPUT_DIRS]
    parsed = {
        o.key_or_group: str(o.value()) for o in OverridesParser.create().parse_overrides(given)
    }
    values.update(parsed)
    used = None if multirun is None else ("hydra.sweep.dir" if multirun else "hydra.run.dir")
    problems = []
    for key, value in values.items():
        if why := _output_dir_problem(value, probe=key == used):
            source = "" if key in parsed else " (the default)"
            problems.append(
                f"{key}={value}{source}: {why}, so the output directory cannot be created; "
                f"pick a directory you can write (created if missing), e.g. "
                f"{key}={_OUTPUT_DIRS[key]}"
            )
    return problems


def _output_dir_problem(value: str, *, probe: bool) -> str | None:
    """Why Hydra could not make the directory ``value`` (its static part), or None."""
    static = value.split("${", 1)[0]
    if "${" in value:  # the directory part before the interpolation
        static = static.rpartition("/")[0]
    path = Path(static or ".")
    blocker = next((p for p in [path, *path.parents] if p.exists()), None)
    if blocker is None:
        return None
    if not blocker.is_dir():
        return (
            f"{path} is an existing file"
            if blocker == path
            else f"{path} is under the file {blocker}"
        )
    if not probe:
        return None
    try:  # what Hydra will do first: make a directory there
        os.rmdir(tempfile.mkdtemp(prefix=".xspec-probe-", dir=blocker))
    except OSError as e:
        return f"no directory can be made in {blocker} ({e.strerror or e})"
    return None


def _indent(text: str, prefix: str) -> str:
    first, *rest = text.splitlines() or [""]
    return "\n".join([first, *(prefix + line for line in rest)])


# A job ran but every request of it failed (NaN logits, a failed step): nothing was
# measured. 1, as a crash or an output file that could not be written (2 stays the
# user's input, found before the run), and as ``xspec.bench serve`` with no success.
NOTHING_SERVED_EXIT = 1


@dataclass
class _Invocation:
    """What one ``main()`` keeps across the jobs Hydra runs in this process (one, or every
    job of a multirun): Hydra calls the job function without arguments, so it lives here."""

    results: list[dict] = field(default_factory=list)  # one results.json content per job
    failed: list[dict[str, Any]] = field(default_factory=list)  # jobs failed at run time
    summary_dir: Path | None = None  # where the summary goes: the sweep dir, or the run dir
    exporter: Any = None  # the MetricsExporter of this process, when metrics.port is set


_STATE = _Invocation()  # main() starts it afresh


def run(cfg: RunConfig, choices: dict[str, str] | None = None, out_dir: Path | None = None) -> None:
    """The main job: generate for the workload's requests, report timings and acceptance,
    and write ``results.json`` into ``out_dir`` (Hydra's job directory)."""
    from xspec import atomic
    from xspec.build import build
    from xspec.run.report import failed_requests, plan_summary, run_workload
    from xspec.run.results import RESULTS_FILE, job_results

    built = build(cfg)
    main = built.parallel.topology.is_main  # rank 0 reports; the other ranks only compute
    if main:  # flushed: a log file shows the plan at once, not when the run ends
        print(plan_summary(built), flush=True)
    model = (choices or {}).get("model", cfg.model.arch)
    exporter = _STATE.exporter if main else None
    if exporter is not None:
        exporter.follow(built.engine)

    def on_run(gens: list[Generation]) -> None:  # each measured run, as it finishes
        if exporter is not None:
            exporter.observe(gens, model, cfg.spec.method)

    runs = run_workload(built, cfg.workload, cfg.sampling, model_option=model, on_run=on_run)
    if not main:
        return
    result = job_results(built, cfg.workload, runs, model)
    _STATE.results.append(result)
    if out_dir is not None:
        atomic.write_json(out_dir / RESULTS_FILE, result)
        print(f"xspec: results in {out_dir / RESULTS_FILE}")
    if (line := failed_requests(runs)) is not None:  # last: under the figures it qualifies
        print(line, file=sys.stderr, flush=True)


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def _hydra_entry(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from xspec.parallel.runtime import PEER_FAILURE_EXIT, PeerFailure

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if _STATE.summary_dir is None:
        _STATE.summary_dir = Path(hc.sweep.dir if multirun else hc.runtime.output_dir)
    out_dir = Path(hc.runtime.output_dir)
    try:
        run(typed(cfg), dict(hc.runtime.choices), out_dir)
    except PeerFailure as e:  # another rank died or hangs: leave now, never wait on it again
        print(f"xspec: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(PEER_FAILURE_EXIT)
    except (UserError, OutputError) as e:
        if not multirun:
            sys.exit(_fail(e))
        _job_failed(hc, out_dir, e, traceback_text=None)
    except Exception as e:  # a crash in one job of a sweep: the others still run
        if not multirun:
            raise
        _job_failed(hc, out_dir, e, traceback_text=traceback.format_exc())


def _job_failed(hc: Any, out_dir: Path, e: Exception, traceback_text: str | None) -> None:
    """Record a failed multirun job (the summary marks it; the invocation exits non-zero)
    and print one line; a crash's traceback goes to ``<job dir>/error.txt``."""
    from xspec import atomic

    overrides = list(hc.overrides.task)
    message = str(e) if isinstance(e, UserError | OutputError) else f"{type(e).__name__}: {e}"
    where = ""
    if traceback_text is not None:
        try:
            atomic.write_text(out_dir / "error.txt", traceback_text)
            where = f" (traceback in {out_dir / 'error.txt'})"
        except OutputError:
            pass
    _STATE.failed.append(
        {
            "job": hc.job.num,
            "overrides": overrides,
            "error": message,
            "exit_code": getattr(e, "exit_code", 1),
        }
    )
    print(
        f"xspec: error: job {hc.job.num} ({' '.join(overrides) or 'defaults'}) failed: "
        f"{message.splitlines()[0] if message else type(e).__name__}{where}",
        file=sys.stderr,
        flush=True,
    )


def main() -> None:
    from xspec.compose import normalise_override

    global _STATE
    _STATE = state = _Invocation()
    overrides = set(overrides_of(sys.argv[1:]))  # shorthands (spec.adaptive=true), for Hydra too
    sys.argv[1:] = [normalise_override(a) if a in overrides else a for a in sys.argv[1:]]
    args = sys.argv[1:]
    # --cfg job prints the composed config: composing it is checked like a run
    info_only = any(
        a in ("--help", "-h", "--hydra-help", "--info", "-i") or a.startswith("--shell")
        for a in args
    )
    print_config = any(
        a.startswith(("--cfg", "-c")) and a not in ("-cp", "-cn", "-cd") for a in args
    )
    if not info_only:
        try:
            configs = check_jobs(
                _override_sets(args),
                full=not print_config,
                search=config_dirs_of(args),
                multirun=is_multirun(args),
            )
            if not print_config and launch().rank == 0:  # one exporter per launch
                _start_exporter(configs[0])
        except UserError as e:
            sys.exit(_fail(e))
    register_configs()
    try:
        _hydra_entry()
    finally:
        if state.exporter is not None:
            state.exporter.close()
    if "torch.distributed" in sys.modules:  # a torchrun run joined a process group
        from xspec.parallel.runtime import shutdown

        shutdown()
    results, failed = state.results, state.failed
    if results or failed:
        assert state.summary_dir is not None  # set by the first job
        try:
            _summarize(state.summary_dir, results, failed)
        except OutputError as e:
            sys.exit(_fail(e))
    if code := _exit_code(state):
        sys.exit(code)


def _exit_code(state: _Invocation) -> int:
    """0, or the invocation's failure: a job that failed (its exit code), a job in which
    every request failed (:data:`NOTHING_SERVED_EXIT`); a sweep says which."""
    results, failed = state.results, state.failed
    jobs = len(failed) + len(results)
    if failed:
        done = f"; the summary of the {len(results)} that finished" if results else ""
        print(
            f"xspec: error: {len(failed)} of {jobs} jobs failed "
            f"(job {', '.join(str(f['job']) for f in failed)}){done} is in {state.summary_dir}",
            file=sys.stderr,
        )
    empty = [r for r in results if all(q["error"] is not None for q in r["requests"])]
    if empty and jobs > 1:  # a single run has said so under its figures
        print(
            f"xspec: error: in {len(empty)} of {jobs} jobs every request failed (their "
            f"results.json hold the errors; the summary is in {state.summary_dir})",
            file=sys.stderr,
        )
    return max([f["exit_code"] for f in failed] + [NOTHING_SERVED_EXIT] * len(empty), default=0)


def _start_exporter(cfg: RunConfig) -> None:
    """One Prometheus exporter for the whole process (every job of a multirun)."""
    from xspec.run.exporter import MetricsExporter

    if cfg.metrics.port is None:
        return
    exporter = _STATE.exporter = MetricsExporter(cfg.metrics.host, cfg.metrics.port)
    print(f"xspec: serving Prometheus metrics at {exporter.url}", flush=True)


def _summarize(directory: Path, results: list[dict], failed: list[dict[str, Any]]) -> None:
    """The combined table (printed for a multirun or repeats) and summary files + plot."""
    from xspec.run.results import SUMMARY_PNG, plot, write_summary

    table = write_summary(results, directory, failed=failed)
    if len(results) + len(failed) > 1 or any(r["num_repeats"] > 1 for r in results):
        print("\n" + table)
    if not results:
        print(f"xspec: summary in {directory} (summary.md, summary.json)")
    elif plot(results, directory / SUMMARY_PNG):
        print(f"xspec: summary in {directory} (summary.md, summary.json, {SUMMARY_PNG})")
    else:
        print(
            f"xspec: summary in {directory} (summary.md, summary.json); "
            "pip install 'xspec[plot]' (matplotlib) for the plot"
        )


if __name__ == "__main__":
    main()
