"""Where the native kernels' library comes from: the cache, verified, or a build now.

Loading a shared library runs code (its constructors), so a library is loaded only from
bytes this user can vouch for:

* the cache directory (``$XSPEC_CACHE_DIR/native``) and the cache root above it must be
  owned by this user (or root) and writable by nobody else; every directory above them
  too, unless sticky (``/tmp``: others cannot rename or remove what is ours in it).
  Directories this module creates are 0700;
* a cached library and its manifest (``<library>.json``, the sha256 recorded when it
  was built) must be regular files owned by this user (or root), writable by nobody
  else, and the library's bytes must hash to the recorded sha256;
* the bytes that passed the check are the bytes loaded: they are copied into a private
  0700 directory and loaded from there, so nothing can swap the cache file between
  the check and ``dlopen``. A truncated library fails the hash, so it is never mapped
  (mapping one raises SIGBUS).

The ownership and mode checks are :mod:`xspec.cache`'s (the preset cache applies them
too). A cache that fails these checks is not used at all: the build goes to a private
directory and the run says why. A rejected entry in a trusted cache is deleted and
rebuilt once. Root is trusted because it can change this process anyway.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from xspec import atomic
from xspec.cache import cache_dir as cache_dir  # the directory checks, shared with presets
from xspec.cache import trust_problem
from xspec.errors import OutputError

# A build takes about a second; a compiler still running after this is stuck (a lock on
# a network file system, a license server), and the run goes on with the reference ops.
BUILD_TIMEOUT_S = 60.0


class Untrusted(Exception):
    """A path someone other than this user (or root) could have written."""


def verified(directory: Path, name: str) -> tuple[bytes | None, str]:
    """The cached library ``name``'s bytes if it and its manifest are trusted and the
    bytes hash to the recorded sha256; else None and why not ("" = not cached)."""
    library, manifest = directory / name, directory / f"{name}.json"
    try:
        data = _read_trusted(library)
    except FileNotFoundError:
        return None, ""
    except (Untrusted, OSError) as e:
        return None, _reason(e, library)
    try:
        recorded = json.loads(_read_trusted(manifest))["sha256"]
    except FileNotFoundError:
        return None, f"{library} has no recorded sha256 ({manifest.name} is missing)"
    except (Untrusted, OSError) as e:
        return None, _reason(e, manifest)
    except (ValueError, TypeError, KeyError):
        return None, f"{manifest} records no sha256"
    if hashlib.sha256(data).hexdigest() != recorded:
        return None, f"{library} does not match the sha256 recorded when it was built"
    return data, ""


def _read_trusted(path: Path) -> bytes:
    """``path``'s bytes, read through the descriptor whose owner and mode were checked;
    Untrusted if they fail :func:`trust_problem` or it is not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a symlink: ELOOP
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{path} is not a regular file")
        why = trust_problem(st, path)
        if why is not None:
            raise Untrusted(why)
        return f.read()


def _reason(e: Exception, path: Path) -> str:
    if isinstance(e, Untrusted):
        return str(e)
    if isinstance(e, OSError) and e.errno == errno.ELOOP:
        return f"{path} is a symbolic link"
    return f"cannot read {path} ({e.strerror if isinstance(e, OSError) else e})"


def discard(directory: Path, name: str) -> None:
    """Remove a rejected cache entry (best effort: a read-only cache keeps it)."""
    for path in (directory / name, directory / f"{name}.json"):
        with contextlib.suppress(OSError):
            path.unlink()


def publish(directory: Path, name: str, data: bytes) -> str:
    """Cache ``data`` as library ``name`` and record its sha256 beside it; "" or why not.

    Concurrent builders may pair one's library with the other's manifest (builds are
    normally byte-identical anyway): the next load then sees a mismatch and rebuilds."""
    record = {"library": name, "sha256": hashlib.sha256(data).hexdigest()}
    manifest = (json.dumps(record, indent=2) + "\n").encode()
    try:  # 0600 while written, 0644 once in place: writable by this user only, throughout
        atomic.write_bytes(directory / name, data, mode=0o644)
        atomic.write_bytes(directory / f"{name}.json", manifest, mode=0o644)
    except OutputError as e:
        return f"not cached: cannot write to {directory} ({e.reason})"
    return ""


@contextlib.contextmanager
def private_dir(cache: Path | None) -> Iterator[Path]:
    """A fresh 0700 directory, removed afterwards (a library loaded from it stays
    mapped): in the cache if there is one (a file system that allows executable
    mappings, as the cache must), else in the system's temporary directory."""
    try:
        tmp = tempfile.mkdtemp(prefix=".private-", dir=cache)  # dir=None: the system's
    except OSError:
        tmp = tempfile.mkdtemp(prefix="xspec-native-")
    try:
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compile_library(cc: str, flags: tuple[str, ...], source: Path, out: Path) -> bytes | str:
    """Compile ``source`` into ``out`` (in a private directory) -> its bytes, or the
    compiler's last error line. TimeoutError after :data:`BUILD_TIMEOUT_S`."""
    cmd = [cc, *flags, "-o", str(out), str(source), "-lm"]
    try:
        # a session of its own: on a timeout the whole group goes (cc1, as, ld), or
        # a grandchild holding stderr open would keep communicate() waiting
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as e:
        return f"cannot run {cc}: {e.strerror or e}"
    with proc:
        try:
            _, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=5)  # a process that left the group may hold stderr
            raise TimeoutError(f"{cc} still running after {BUILD_TIMEOUT_S:g} s") from None
    if proc.returncode != 0:
        return (err.strip().splitlines() or ["no output"])[-1]
    try:
        return out.read_bytes()
    except OSError as e:
        return f"{cc} wrote no library ({e.strerror or e})"
