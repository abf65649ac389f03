"""User-facing errors.

A :class:`UserError` is a problem the user can fix (a bad option, a missing checkpoint
file, a prompt that does not fit). The CLI prints its message without a traceback and
exits with code 2; the Python API lets it propagate. Messages say what is wrong, where,
and how to fix it.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's input: config, checkpoint, prompt or environment."""

    exit_code = 2

    def __init__(self, message: str, *, problems: list[str] | None = None) -> None:
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class ConfigError(UserError):
    """The composed configuration is invalid (every problem listed together)."""


class CheckpointError(UserError):
    """A checkpoint directory is missing, unreadable, or has missing/misshapen tensors."""


class PlatformError(UserError):
    """The selected platform cannot run here (missing package or device, unsupported option)."""


class RequestError(UserError):
    """A generation request is invalid (empty prompt, too long, ids outside the vocabulary)."""


class MemoryBudgetError(UserError):
    """The memory budget cannot hold the weights plus even one sequence."""


class OutputError(Exception):
    """An output file could not be written (disk full, permissions): the previous file,
    if any, is left as it was. Not the user's input, so the CLI exits with code 1.
    ``reason``: the operating system's words (``No space left on device``)."""

    exit_code = 1

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message
