"""Where the native kernels' library comes from (``platforms/native/cache.py``): only bytes
this user built, in a cache only this user can write, are loaded; every failure on the
way falls back to the reference ops with a one-line reason."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xspec.platforms import native

ROOT = Path(__file__).resolve().parents[2]

PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) {
        fputs("planted code ran\n", f);
        fclose(f);
    }
}
"""


@pytest.fixture(scope="module")
def real_cc() -> str:
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    return cc


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, real_cc: str) -> Path:
    """One cache directory holding this CPU's build (built once for the module)."""
    root = tmp_path_factory.mktemp("built") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XSPEC_CACHE_DIR", str(root))
        loaded, why = native.load()
    assert loaded is not None, why
    return root


@pytest.fixture
def cache(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's ``$XSPEC_CACHE_DIR/native``, a copy of the module's built cache."""
    root = tmp_path / "cache"
    shutil.copytree(built, root)
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(root))
    return root / "native"


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("xspec_host_*.so"))


def _recorded(entry: Path) -> str:
    return json.loads(entry.with_name(entry.name + ".json").read_text())["sha256"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _planted(tmp_path: Path, cc: str) -> tuple[Path, Path]:
    """A shared library whose constructor writes a marker file, and the marker's path."""
    marker, source, lib = tmp_path / "marker", tmp_path / "planted.c", tmp_path / "planted.so"
    source.write_text(PLANTED % marker)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    return lib, marker


def _forge_manifest(entry: Path, lib: Path) -> None:
    """What someone who can write the cache can also do: record the planted hash."""
    record = {"library": entry.name, "sha256": _sha256(lib)}
    entry.with_name(entry.name + ".json").write_text(json.dumps(record))


def _plant(cache: Path, lib: Path, how: str) -> str:
    """Put ``lib`` in place of every cached build, ``how``; the reason load() must give."""
    for entry in _entries(cache):
        if how == "symlink":
            entry.unlink()
            entry.symlink_to(lib)
        else:
            shutil.copyfile(lib, entry)
        if how != "mismatching recorded hash":
            _forge_manifest(entry, lib)
        if how == "no recorded hash":
            entry.with_name(entry.name + ".json").unlink()
        if how == "group-writable library":
            entry.chmod(0o664)
        if how == "another user's library":
            os.chown(entry, 12345, 12345)
    if how == "world-writable cache directory":
        cache.chmod(0o777)
    if how == "world-writable cache root":
        cache.parent.chmod(0o777)
    return {
        "world-writable cache directory": "writable by group or others (mode 777)",
        "world-writable cache root": "writable by group or others (mode 777)",
        "group-writable library": "writable by group or others (mode 664)",
        "another user's library": "owned by uid 12345",
        "symlink": "is a symbolic link",
        "no recorded hash": "has no recorded sha256",
        "mismatching recorded hash": "does not match the sha256 recorded when it was built",
    }[how]


@pytest.mark.parametrize(
    "how",
    [
        "world-writable cache directory",
        "world-writable cache root",
        "group-writable library",
        "another user's library",
        "symlink",
        "no recorded hash",
        "mismatching recorded hash",
    ],
)
def test_a_planted_library_is_refused_and_none_of_its_code_runs(cache, tmp_path, real_cc, how):
    """A library someone else could have written never reaches dlopen: not its
    constructor either. The run gets kernels built privately (an untrusted cache) or
    rebuilt in place (a bad entry in a trusted cache), and says which and why."""
    if how == "another user's library" and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    lib, marker = _planted(tmp_path, real_cc)
    expected = _plant(cache, lib, how)
    loaded, why = native.load()
    assert not marker.exists(), "the planted library's constructor ran"
    assert loaded is not None, why
    assert expected in why and "\n" not in why
    if how.startswith("world-writable"):
        assert "not cached" in why
        assert all(_sha256(e) == _sha256(lib) for e in _entries(cache))  # not ours to fix
    else:
        assert "rebuilt" in why
        (entry,) = (e for e in _entries(cache) if e == loaded.path)
        assert not entry.is_symlink() and _sha256(entry) == _recorded(entry) != _sha256(lib)
    ctypes.CDLL(str(lib))  # the plant was live: loading it does run its constructor
    assert marker.exists()


def test_the_run_header_says_why_the_cache_was_not_used(cache):
    """The reason reaches the run's ``steps:`` line (the channel that says "no C
    compiler")."""
    from xspec.config import PlatformConfig
    from xspec.platforms.cpu import CpuPlatform

    cache.chmod(0o777)
    describe = CpuPlatform(PlatformConfig(name="cpu")).step_options().describe
    assert describe.startswith("steps: eager, native host kernels")
    assert f"not cached: {cache} is writable by group or others (mode 777)" in describe


def test_a_fresh_cache_is_private_and_records_each_library_s_hash(monkeypatch, tmp_path):
    """New directories are 0700, libraries and manifests 0644, and each manifest holds
    the sha256 of its library's bytes; the next load uses the cached build."""
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "a" / "b"))
    loaded, why = native.load()
    assert loaded is not None, why
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "native"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    entry = loaded.path
    assert entry.parent == tmp_path / "a" / "b" / "native"
    assert stat.S_IMODE(entry.stat().st_mode) == 0o644
    assert _sha256(entry) == _recorded(entry)
    assert not list(entry.parent.glob(".private-*"))  # the loaded copy is gone
    again, why = native.load()
    assert again is not None and again.path == entry
    assert why.startswith(f"native host kernels ({entry.name}, ") and ";" not in why


@pytest.mark.parametrize("mode", [0o777, 0o1777])
def test_directories_above_the_cache_must_not_be_open_to_others(monkeypatch, tmp_path, mode):
    """A directory above the cache root that others may write lets them swap the
    cache: refused, unless sticky (like /tmp), where they cannot rename ours."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(shared / "cache"))
    loaded, why = native.load()
    assert loaded is not None, why
    if mode & stat.S_ISVTX:
        assert "not cached" not in why and loaded.path.parent == shared / "cache" / "native"
    else:
        assert f"not cached: {shared} is writable by group or others (mode 777)" in why


def test_a_truncated_cached_library_is_rebuilt_not_mapped(cache):
    """Mapping a truncated library raises SIGBUS in the loading process (every start,
    until deleted by hand): the hash check refuses it first, and it is rebuilt once."""
    (entry,) = _entries(cache)[:1]
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])
    code = "from xspec.platforms import native\nk, why = native.load()\nprint(k is not None, why)"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("True ") and "rebuilt" in run.stdout
    assert "does not match the sha256 recorded" in run.stdout
    assert entry.read_bytes() == whole


def test_a_cache_that_cannot_be_created_means_reference_ops(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(blocker))
    loaded, why = native.load()
    assert loaded is None
    assert why == (
        f"the kernel cache {blocker / 'native'} cannot be created (Not a directory); "
        "using the reference torch ops"
    )


def test_a_library_without_the_entry_points_means_reference_ops(monkeypatch, tmp_path, real_cc):
    """A compiler that builds something else (here: a file with none of the kernels)."""
    empty = tmp_path / "empty.c"
    empty.write_text("int xspec_nothing(void) { return 0; }\n")
    fake = tmp_path / "cc"
    fake.write_text(
        "#!/bin/sh\n"
        'for a; do shift; case "$a" in *kernels.c) set -- "$@" ' + f'"{empty}";; '
        '*) set -- "$@" "$a";; esac; done\n'
        f'exec {real_cc} "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    loaded, why = native.load()
    assert loaded is None
    assert "(it has no xspec_mhc_pre); using the reference torch ops" in why
    assert why.startswith("cannot load xspec_host_") and "\n" not in why


def test_a_hanging_compiler_times_out(monkeypatch, tmp_path):
    """The compiler and whatever it started (here ``sleep``, holding its stderr) are
    killed at the timeout; the run goes on with the reference ops."""
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nsleep 120\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("xspec.platforms.native.cache.BUILD_TIMEOUT_S", 1.0)
    start = time.monotonic()
    loaded, why = native.load()
    assert time.monotonic() - start < 30
    assert loaded is None
    assert why == (
        f"building kernels.c failed ({fake} still running after 1 s); using the reference torch ops"
    )
