"""Reading a JSON file a user names, safely.

A path on the command line may be a FIFO (reading it waits forever for a writer), a
multi-gigabyte file, or JSON nested deeper than Python's recursion limit (``json`` nests
one frame per level and raises RecursionError, which no ``except ValueError`` catches).
:func:`read_json` turns each of those into a :class:`JSONFileError` whose message says
what is wrong; callers add where the path came from and how to fix it.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

MAX_BYTES = 64 << 20  # calibration and profile files are a few KiB


class JSONFileError(ValueError):
    """A JSON file that cannot be used; ``missing`` when there is no file at all."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def read_json(path: Path, *, max_bytes: int = MAX_BYTES) -> Any:
    """The JSON value in ``path``; JSONFileError when it is absent, not a regular file,
    larger than ``max_bytes``, unreadable, not UTF-8, not JSON or nested too deeply."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise JSONFileError(f"{path} does not exist", missing=True) from None
    except OSError as e:
        raise JSONFileError(f"cannot read {path} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise JSONFileError(f"{path} is not a regular file (a FIFO, socket, device or directory)")
    if st.st_size > max_bytes:
        raise JSONFileError(f"{path} is {st.st_size} bytes, over the {max_bytes}-byte limit")
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise JSONFileError(f"cannot read {path} ({e.strerror})") from None
    if len(data) > max_bytes:  # it grew between stat and read
        raise JSONFileError(f"{path} is over the {max_bytes}-byte limit")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise JSONFileError(f"{path} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise JSONFileError(
            f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    except RecursionError:
        raise JSONFileError(f"{path} nests JSON too deeply") from None
