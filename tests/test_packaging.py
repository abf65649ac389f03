"""Configuration layout: conf/ is the one copy of the YAML; a wheel ships it as xspec.conf;
a user's own --config-dir adds options."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_cli import run_cli
from xspec.config import config_dir

ROOT = Path(__file__).resolve().parents[1]


def test_conf_is_the_one_copy_of_the_yaml() -> None:
    assert config_dir() == ROOT / "conf"
    assert (ROOT / "conf" / "config.yaml").is_file()
    assert not list((ROOT / "xspec").rglob("*.yaml"))  # no second copy inside the package


def test_pyproject_lists_every_package() -> None:
    """setuptools cannot discover the mapped xspec.conf, so packages are listed by hand."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "xspec").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert set(tool["packages"]) == found | {"xspec.conf"}
    assert tool["package-dir"] == {"xspec.conf": "conf"}


def test_wheel_ships_the_same_configs(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "-w", str(tmp_path), "--no-deps",
         "--no-build-isolation", "-q"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("xspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    yaml = {str(p.relative_to(ROOT)) for p in (ROOT / "conf").rglob("*.yaml")}
    assert {f"xspec/{n}" for n in yaml} <= names
    assert not [n for n in names if n.startswith("conf/")]  # not a top-level package
    # the shipped trained checkpoints (model=dsv4_tiny) travel inside the package
    assets = {
        str(p.relative_to(ROOT)) for p in (ROOT / "xspec" / "assets").rglob("*") if p.is_file()
    }
    assert {"xspec/assets/dsv4_tiny/model.safetensors", "xspec/assets/dsv4_tiny/tokenizer.json",
            "xspec/assets/dsv4_tiny_dspark/model.safetensors"} <= assets  # fmt: skip
    assert assets <= names
    # the CPU platform's native kernels are built from their C source on first use
    assert "xspec/platforms/native/kernels.c" in names


def test_user_config_dir_adds_options(tmp_path: Path, xspec_cache: Path) -> None:
    mine = tmp_path / "my_conf" / "model"
    mine.mkdir(parents=True)
    (mine / "my_tiny.yaml").write_text(
        "defaults:\n  - /schema/model@_here_\narch: qwen3\npreset: tiny\ndtype: float32\n"
    )
    args = ["model=my_tiny", "spec=none", "workload.max_new_tokens=2", "workload.num_requests=1"]
    r = run_cli(*args, cache=xspec_cache, cwd=tmp_path)
    assert r.returncode == 2 and "my_tiny" in r.stderr  # unknown without the directory
    r = run_cli("--config-dir", str(tmp_path / "nope"), *args, cache=xspec_cache, cwd=tmp_path)
    assert r.returncode == 2 and "nope: not a directory" in r.stderr
    for flag in (
        ["--config-dir", str(tmp_path / "my_conf")],
        [f"--config-dir={tmp_path / 'my_conf'}"],
    ):
        r = run_cli(
            *flag, *args, f"hydra.run.dir={tmp_path / 'out'}", cache=xspec_cache, cwd=tmp_path
        )
        assert r.returncode == 0, r.stderr
        assert "model=my_tiny (qwen3, preset tiny)" in r.stdout


@pytest.mark.parametrize("args", [["-cd", "{d}"], ["--config-dir", "{d}"], ["--config-dir={d}"]])
def test_config_dirs_of(args: list[str]) -> None:
    from xspec.__main__ import config_dirs_of, overrides_of

    args = [a.format(d="/x") for a in args]
    assert config_dirs_of([*args, "model=a"]) == ["/x"]
    assert overrides_of([*args, "model=a"]) == ["model=a"]
