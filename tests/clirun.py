"""``python -m xspec ...`` in this process: the CLI's messages and exit codes without the
cost of a fresh interpreter per case (tests/test_cli.py keeps one subprocess run that
checks the real entry point's exit-code contract)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli_in_process(*args: str, cwd: Path) -> CliResult:
    """Run ``xspec.__main__.main`` with ``args`` in ``cwd`` (where Hydra's outputs/ and
    multirun/ go); ``main`` starts its per-invocation state afresh."""
    import logging

    from hydra.core.global_hydra import GlobalHydra

    import xspec.__main__ as cli

    GlobalHydra.instance().clear()
    out, err = io.StringIO(), io.StringIO()
    old_argv, old_cwd = sys.argv, Path.cwd()
    root_handlers = list(logging.getLogger().handlers)
    code = 0
    try:
        sys.argv = ["xspec", *args]
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
        GlobalHydra.instance().clear()
        logging.getLogger().handlers[:] = root_handlers  # Hydra's job logging
    return CliResult(code, out.getvalue(), err.getvalue())
