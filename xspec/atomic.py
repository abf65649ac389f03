"""Atomic output files: a reader (or a crash, or a full disk) never sees half a file.

Every file xspec writes for a user to keep (``results.json``, ``summary.*``, calibration
and step-cost profiles, training checkpoints) goes through :func:`atomic_path`: the
content is written to a temporary file in the same directory, flushed and fsynced, then
``os.replace``\\ d over the target, which POSIX makes atomic. When anything fails on the
way (``ENOSPC``, ``EDQUOT``, a permission error, the writer's own exception) the
temporary file is removed and the previous file, if any, is left byte-identical. OS
errors surface as :class:`~xspec.errors.OutputError` naming the path and the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xspec.errors import OutputError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it replaces ``path``.

    The writer inside the block writes the whole file to the yielded path (any API that
    takes a file name: ``savefig``, ``save_file``, ``write_bytes``). On an exception the
    temporary file is removed and ``path`` is untouched. The file stays 0600 while it is
    written, then takes ``mode`` (default: the existing file's, else what a plain
    ``open`` would give)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise _output_error(target, e) from None
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _mode_for(target) if mode is None else mode)
        _fsync(tmp)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except OSError as e:
        raise _output_error(target, e) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically (``mode``: as :func:`atomic_path`)."""
    with atomic_path(path, mode=mode) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: int = 2) -> None:
    """Write ``obj`` as strict JSON (NaN and infinities refused: they are not JSON) to
    ``path`` atomically. A value JSON cannot hold is a ``ValueError`` before any write."""
    write_text(path, json.dumps(obj, indent=indent, allow_nan=False) + "\n")


def _output_error(target: Path, e: OSError) -> OutputError:
    reason = e.strerror or str(e)
    return OutputError(f"cannot write {target}: {reason}", reason)


def _mode_for(target: Path) -> int:
    """The existing file's permissions, else what ``open(path, "w")`` would create."""
    try:
        return target.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (best effort: some filesystems refuse a dir fsync)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
