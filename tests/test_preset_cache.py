"""Cached presets ($XSPEC_CACHE_DIR/presets) are read only when this user can vouch for
them, with the native kernels' cache checks (xspec/cache.py): a preset cache or a preset
file someone else owns or may write is refused (exit 2, naming it and the fix); a
private preset cache is trusted whatever the umask gave the files in it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.clirun import run_cli_in_process
from xspec.errors import CheckpointError
from xspec.models.qwen3.presets import checkpoint_path
from xspec.models.qwen3.tiny import tiny_dir

TINY = SimpleNamespace(path=None, preset="tiny")  # model=qwen3_tiny's section
OTHER_UID = 54321  # no user here: root can give a file to it


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache holding a copy of the session's Qwen3 tiny preset (presets/ 0755)."""
    source = tiny_dir(False)  # the session's cache, before XSPEC_CACHE_DIR moves
    root = tmp_path / "cache"
    (root / "presets").mkdir(parents=True, mode=0o755)
    shutil.copytree(source, root / "presets" / source.name)
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(root))
    return root


def _preset(cache: Path) -> Path:
    return cache / "presets" / tiny_dir(False).name


def test_a_trusted_preset_resolves(cache: Path) -> None:
    assert checkpoint_path(TINY) == _preset(cache)


def test_a_file_someone_else_owns_is_refused(cache: Path, tmp_path: Path) -> None:
    """The issue's case, through the CLI: exit 2 before the preset is read."""
    shard = next(_preset(cache).glob("*.safetensors"))
    os.chown(shard, OTHER_UID, -1)
    r = run_cli_in_process("model=qwen3_tiny", "spec=none", "platform=cpu", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert (
        f"the cached preset {_preset(cache)} cannot be trusted: {shard} is owned by uid "
        f"{OTHER_UID}, not by you; delete {_preset(cache)} (the next run regenerates it)"
        in r.stderr
    )
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("what", ["group-writable file", "link", "writable cache"])
def test_what_others_could_write_is_refused(cache: Path, what: str) -> None:
    preset = _preset(cache)
    if what == "group-writable file":
        (preset / "config.json").chmod(0o664)
        needle = f"{preset / 'config.json'} is writable by group or others (mode 664)"
    elif what == "link":
        (preset / "tokenizer.json").symlink_to("/etc/hostname")
        needle = f"{preset / 'tokenizer.json'} is a symbolic link"
    else:
        (cache / "presets").chmod(0o777)
        needle = f"the preset cache {cache / 'presets'} cannot be trusted: {cache / 'presets'} is writable"
    with pytest.raises(CheckpointError, match="cannot be trusted") as e:
        checkpoint_path(TINY)
    assert needle in str(e.value)


def test_a_private_preset_cache_trusts_its_files_modes(cache: Path) -> None:
    """Under umask 002 the generator writes 0664 files; nobody else can reach them in a
    0700 preset cache (the one a first run makes), so they are used."""
    (cache / "presets").chmod(0o700)
    (_preset(cache) / "config.json").chmod(0o664)
    assert checkpoint_path(TINY) == _preset(cache)
    os.chown(_preset(cache) / "config.json", OTHER_UID, -1)  # ownership still counts
    with pytest.raises(CheckpointError, match=f"owned by uid {OTHER_UID}"):
        checkpoint_path(TINY)


def test_a_first_run_makes_the_preset_cache_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new cache: its root and presets/ are made 0700 before the preset is generated
    into it; the shipped presets (in the package) never need it."""
    from xspec.models.deepseek_v4.presets import checkpoint_path as dsv4_checkpoint_path

    source = tiny_dir(False)  # the session's: generating anew would only cost time
    monkeypatch.setattr(
        "xspec.models.qwen3.tiny.generate_tiny",
        lambda path, *, moe: shutil.copytree(source, path),
    )
    root = tmp_path / "new" / "cache"
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(root))
    assert dsv4_checkpoint_path(SimpleNamespace(path=None, preset="tiny")).parts[-2] == "assets"
    assert not root.exists()
    path = checkpoint_path(TINY)
    assert (path / "config.json").is_file() and path.parent == root / "presets"
    assert [d.stat().st_mode & 0o777 for d in (root, root / "presets")] == [0o700, 0o700]
