"""Where xspec keeps what it generates or builds once: presets, native kernels, profiles;
and whether what is found there can be trusted.

A cache entry is used only if it holds bytes this user can vouch for: the cache
directory and the cache root above it are owned by this user (or root) and writable by
nobody else, every directory above them too unless sticky (``/tmp``: others cannot
rename or remove what is ours in it). Directories made here are 0700. Root is trusted
because it can change this process anyway. The native kernels' cache
(``platforms/native/cache.py``) and the preset cache (``models/presets.py``) both apply
these checks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path


def cache_root() -> Path:
    """$XSPEC_CACHE_DIR, default ~/.cache/xspec."""
    return Path(os.environ.get("XSPEC_CACHE_DIR") or "~/.cache/xspec").expanduser()


def owner_problem(st: os.stat_result, path: Path) -> str | None:
    """Why ``path`` (its ``stat``) belongs to someone other than this user or root, or None."""
    if st.st_uid not in (os.getuid(), 0):
        return f"{path} is owned by uid {st.st_uid}, not by you"
    return None


def trust_problem(st: os.stat_result, path: Path, *, sticky_ok: bool = False) -> str | None:
    """Why the file or directory ``path`` (its ``stat``) could hold someone else's bytes,
    or None. ``sticky_ok``: a sticky directory may be writable by others."""
    if why := owner_problem(st, path):
        return why
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def cache_dir(path: Path) -> tuple[Path | None, str]:
    """``path`` (created if missing) resolved, or None and why it is not to be trusted.
    OSError if it cannot be created (a file on the way, no permission)."""
    make_private_dirs(path)
    real = Path(os.path.realpath(path))
    if not real.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    # the cache and its root strictly; above them a sticky directory may be shared
    for depth, d in enumerate((real, *real.parents)):
        why = trust_problem(os.stat(d), d, sticky_ok=depth >= 2)
        if why is not None:
            return None, why
    return real, ""


def private(directory: Path) -> bool:
    """Whether nobody but its owner can enter ``directory`` (no group or other bits)."""
    return not os.stat(directory).st_mode & 0o077


def tree_problem(directory: Path, *, inside_private: bool) -> str | None:
    """Why the cache entry ``directory`` could hold someone else's bytes, or None: it and
    everything under it must be directories or regular files (no links, no FIFOs) owned
    by this user or root and, unless the directory holding it is private
    (``inside_private``: no one else can reach it, whatever the modes under it), writable
    by nobody else."""
    check = owner_problem if inside_private else trust_problem
    paths = [directory]
    for top, dirs, files in os.walk(directory, onerror=_raise):  # links: listed, not followed
        paths += [Path(top, name) for name in (*dirs, *files)]
    for path in paths:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            return f"{path} is not a regular file or directory"
        if why := check(st, path):
            return why
    return None


def _raise(e: OSError) -> None:
    raise e


def make_private_dirs(path: Path) -> None:
    """``mkdir -p`` whose new directories are 0700 (``makedirs`` gives the intermediate
    ones the umask's mode, which may let the group write)."""
    missing: list[Path] = []
    p = path.absolute()
    while not p.is_dir() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # a concurrent maker made it
            d.mkdir(mode=0o700)
