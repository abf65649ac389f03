"""``python -m xspec model=... spec=... platform=... key=value ...``

Hydra's usual features work (``--help``, ``--cfg job``, ``-m`` multirun). Every
override set (every job of a sweep) is composed and checked up front (config values,
registry names, checkpoint headers, platform limits, drafter fit: ``build.check``), so
a user error in any job prints one message listing the problems of every job and exits
with code 2 before any job runs, never a Python traceback.
"""

from __future__ import annotations

import itertools
import sys

import hydra
from omegaconf import DictConfig

from xspec.compose import compose_run, typed
from xspec.config import RunConfig, register_configs, validate
from xspec.errors import ConfigError, UserError

USER_ERROR = 2


def _fail(e: UserError) -> int:
    print(f"xspec: error: {e}", file=sys.stderr)
    return USER_ERROR


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


def check_jobs(override_sets: list[list[str]], *, full: bool = True) -> None:
    """Compose and check every job (config, names, checkpoints, platform limits, drafter
    fit) before the first one runs; one ConfigError lists the problems of every job.
    ``full=False`` (``--cfg``: only printing the config) checks the values alone."""
    from xspec.build import check
    from xspec.engine.report import workload_problems

    failures: list[tuple[list[str], list[str]]] = []
    for overrides in override_sets:
        try:
            cfg = compose_run(overrides)
            if full:
                problems = check(cfg) + workload_problems(cfg.workload)
            else:
                validate(cfg)
                problems = []
        except UserError as e:
            problems = e.problems or [str(e)]
        if problems:
            failures.append((overrides, problems))
    if not failures:
        return
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


def _indent(text: str, prefix: str) -> str:
    first, *rest = text.splitlines() or [""]
    return "\n".join([first, *(prefix + line for line in rest)])


_SUMMARIES: list = []  # one RunSummary per job of this process (multirun)


def run(cfg: RunConfig, choices: dict[str, str] | None = None) -> None:
    """The main job: generate for the workload's prompts and report timings and acceptance."""
    from xspec.build import build, plan_summary
    from xspec.engine.report import run_workload, summarize

    built = build(cfg)
    print(plan_summary(built))
    model = (choices or {}).get("model", cfg.model.arch)
    runs = run_workload(built, cfg.workload, cfg.sampling, model_option=model)
    label = f"model={model} spec={cfg.spec.method} gamma={built.drafter.gamma}"
    _SUMMARIES.append(summarize(label, built, runs))


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def _hydra_entry(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        run(typed(cfg), dict(HydraConfig.get().runtime.choices))
    except UserError as e:
        sys.exit(_fail(e))


def main() -> None:
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
            check_jobs(_override_sets(args), full=not print_config)
        except UserError as e:
            sys.exit(_fail(e))
    register_configs()
    _hydra_entry()
    if len(_SUMMARIES) > 1 or any(len(s.runs) > 1 for s in _SUMMARIES):
        # a multirun (the jobs side by side) or repeats (medians with their spread)
        from xspec.engine.report import comparison_table

        print("\n" + comparison_table(_SUMMARIES))


if __name__ == "__main__":
    main()
