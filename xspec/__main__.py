"""``python -m xspec model=... spec=... platform=... key=value ...``

Hydra's usual features work (``--help``, ``--cfg job``, ``-m`` multirun). Every
override set is composed and validated up front, so a user error (unknown option, bad
value, missing path, bad checkpoint, prompt too long) prints a short message and exits
with code 2, never a Python traceback.
"""

from __future__ import annotations

import itertools
import sys

import hydra
from omegaconf import DictConfig

from xspec.compose import compose_run, typed
from xspec.config import RunConfig, register_configs
from xspec.errors import UserError

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


_SUMMARIES: list = []  # one RunSummary per job of this process (multirun)


def run(cfg: RunConfig, choices: dict[str, str] | None = None) -> None:
    """The main job: generate for the workload's prompts and report timings and acceptance."""
    from xspec.build import build
    from xspec.engine.report import run_workload, summarize

    built = build(cfg)
    model = (choices or {}).get("model", cfg.model.arch)
    gens = run_workload(built, cfg.workload, cfg.sampling, model_option=model)
    label = f"model={model} spec={cfg.spec.method} gamma={built.drafter.gamma}"
    _SUMMARIES.append(summarize(label, built, gens))


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
    if not info_only:
        try:
            for overrides in _override_sets(args):
                compose_run(overrides)
        except UserError as e:
            sys.exit(_fail(e))
    register_configs()
    _hydra_entry()
    if len(_SUMMARIES) > 1:  # a multirun: the jobs side by side
        from xspec.engine.report import comparison_table

        print("\n" + comparison_table(_SUMMARIES))


if __name__ == "__main__":
    main()
