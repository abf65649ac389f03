"""An out-of-tree platform, installed for real, is found and used without changing xspec.

The example package (examples/xspec_example_platform) is installed with pip into a
private target directory (not site-packages), which is then put on sys.path: pip builds
it and writes a real ``*.dist-info`` with ``entry_points.txt``, and xspec finds it
through ``importlib.metadata`` exactly as it would in site-packages. Building happens in
a copy, so the source tree gets no build/ or egg-info litter.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.platforms.conformance import NativeSas, PlatformCfg, PlatformConformance
from xspec import registry
from xspec.models.base import CapturePoint, CaptureSite
from xspec.platforms import get_platform
from xspec.platforms.base import Platform

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "xspec_example_platform"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """pip-install the example into a private directory and put it on sys.path."""
    work = tmp_path_factory.mktemp("example_plugin")
    source, site = work / "src", work / "site"
    shutil.copytree(EXAMPLE, source)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "--disable-pip-version-check", "--target", str(site), str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"pip install failed:\n{done.stdout}\n{done.stderr}"
    assert "example_cpu" not in registry.platforms.names(), "plugin visible before install?"
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()  # also drops importlib.metadata's directory caches
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for name in [m for m in sys.modules if m.split(".")[0] == "xspec_example_platform"]:
            del sys.modules[name]
        importlib.invalidate_caches()


def test_listed_from_metadata_without_import(installed: Path) -> None:
    assert "example_cpu" in registry.platforms.names()
    assert "example_cpu" in registry.platforms
    assert "xspec_example_platform" not in sys.modules, "names() must not import plugins"
    described = registry.platforms.describe("example_cpu")
    assert "xspec_example_platform:ExampleCpuPlatform" in described
    assert "entry point of xspec-example-platform 0.1.0" in described


def test_selected_by_name_and_really_used(installed: Path) -> None:
    platform = get_platform(PlatformCfg(name="example_cpu"))
    cls = type(platform)
    assert cls.__name__ == "ExampleCpuPlatform"
    # The class came from the installed copy, not from the repository's examples/ folder.
    assert Path(sys.modules[cls.__module__].__file__ or "").is_relative_to(installed)
    # Its own answers, different from the built-in cpu platform's.
    assert platform.capture_point(4) == CapturePoint(layer=5, site=CaptureSite.INPUT)
    problems = platform.validate(dtype="bfloat16")
    assert len(problems) == 1 and "platform=example_cpu" in problems[0], problems
    assert platform.capabilities.max_speculative_tokens == 4  # resolve_gamma checks it


class TestExamplePluginConformance(PlatformConformance):
    @pytest.fixture(autouse=True)
    def _installed(self, installed: Path) -> None:
        """Every conformance check runs with the plugin installed."""

    def make_platform(self, native_sas: str = "auto") -> Platform:
        return get_platform(PlatformCfg(name="example_cpu", native_sas=NativeSas(native_sas)))


def test_selected_from_the_command_line_group(installed: Path) -> None:
    """``platform=example_cpu`` composes although xspec ships no YAML for it."""
    from xspec.compose import compose_run

    cfg = compose_run(["platform=example_cpu", "model=qwen3_tiny"])
    assert cfg.platform.name == "example_cpu"


def test_its_one_op_is_called_and_the_rest_is_the_reference(installed: Path) -> None:
    """The plugin runs ``rms_norm`` only: the model calls it (its counter moves), every
    other op is the model's reference, and greedy output equals the reference ops'."""
    import xspec

    fp32 = {"model.dtype": "float32"}
    reference = xspec.LLM(
        model="dsv4_tiny", spec="mtp", platform="cpu",
        overrides={**fp32, "platform.kernels": "reference"},
    )  # fmt: skip
    plugin = xspec.LLM(model="dsv4_tiny", spec="mtp", platform="example_cpu", overrides=fp32)
    ops = plugin._built.platform.step_options().ops
    others = ("rope", "mhc_pre", "sparse_attention", "moe", "index_topk", "compress_pool")
    assert all(getattr(ops, name) is None for name in (*others, "linear"))
    assert ops.rms_norm is not None and ops.rms_norm.calls == 0  # type: ignore[attr-defined]
    prompts = ["The quick brown fox", "Speculative decoding"]
    want = [g.token_ids for g in reference.generate(prompts, 12, ignore_eos=True)]
    got = [g.token_ids for g in plugin.generate(prompts, 12, ignore_eos=True)]
    assert got == want
    assert ops.rms_norm.calls > 0  # type: ignore[attr-defined]
