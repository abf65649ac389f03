"""Registry behaviour: lazy lookup, refused duplicates, helpful unknown names, entry points.

Entry points are exercised for real: each test writes a ``*.dist-info`` directory (the
metadata an installed wheel leaves) into a temporary sys.path entry, and
``importlib.metadata`` discovers it. Implementation modules are written to the same
directory with unique names, so ``sys.modules`` shows exactly what got imported.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from xspec import registry
from xspec.errors import ConfigError, PlatformError, UserError
from xspec.registry import DuplicateNameError, Registry
from xspec.registry.builtins import BUILTINS


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh sys.path entry for throwaway modules and dist-info metadata."""
    monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates import/metadata caches
    return tmp_path


def write_module(directory: Path, body: str = "VALUE = 42\n") -> str:
    name = f"xspec_test_mod_{uuid.uuid4().hex[:10]}"
    (directory / f"{name}.py").write_text(body)
    return name


def write_dist(directory: Path, dist: str, group: str, entries: dict[str, str]) -> None:
    """The metadata pip leaves for an installed distribution declaring entry points."""
    info = directory / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\nSummary: test plugin {dist}\n"
    )
    lines = [f"[{group}]"] + [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    importlib.invalidate_caches()


def fresh(group: str = "") -> Registry[object]:
    group = group or f"xspec_test.{uuid.uuid4().hex[:10]}"
    return Registry("widget", group, "Widgets: anything importable.")


def test_register_lists_and_loads_lazily(plugin_dir: Path) -> None:
    mod_a = write_module(plugin_dir, "VALUE = 'a'\n")
    mod_b = write_module(plugin_dir, "VALUE = 'b'\n")
    widgets = fresh()
    widgets.register("beta", f"{mod_b}:VALUE", description="the b one")
    widgets.register("alpha", f"{mod_a}:VALUE")
    assert widgets.names() == ["alpha", "beta"]
    assert "alpha" in widgets and "gamma" not in widgets and 3 not in widgets
    assert widgets.describe("beta") == f"beta: the b one [{mod_b}:VALUE, built-in]"
    assert mod_a not in sys.modules and mod_b not in sys.modules, "listing imported a target"
    assert widgets.get("alpha") == "a"
    assert mod_a in sys.modules and mod_b not in sys.modules, "get() imported more than one"


def test_duplicate_register_refused(plugin_dir: Path) -> None:
    widgets = fresh()
    widgets.register("alpha", "os.path:join")
    with pytest.raises(DuplicateNameError, match=r"widget 'alpha' is already registered") as info:
        widgets.register("alpha", "os.path:split")
    assert isinstance(info.value, ValueError) and isinstance(info.value, UserError)
    assert widgets.get("alpha") is os.path.join, "the first registration must survive"


@pytest.mark.parametrize(
    "target", ["os.path", "os.path:", ":join", "os path:join", "os.path:join()"]
)
def test_malformed_target_refused(target: str) -> None:
    with pytest.raises(ValueError, match=r"must look like 'package\.module:Attr'"):
        fresh().register("x", target)


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        registry.platforms.get("foo")
    known = ", ".join(registry.platforms.names())
    assert str(info.value) == f"unknown platform 'foo'; known: {known}"
    assert known.startswith("auto, cpu, cuda, npu")
    with pytest.raises(ConfigError, match=r"did you mean 'qwen3'\?"):
        registry.models.describe("qwen")


def test_entry_points_discovered_from_metadata(plugin_dir: Path) -> None:
    module = write_module(plugin_dir, "class Gadget:\n    pass\n")
    widgets = fresh()
    widgets.register("builtin_one", "os.path:join")
    write_dist(
        plugin_dir, "gadget-plugin", widgets.entry_point_group, {"gadget": f"{module}:Gadget"}
    )
    assert widgets.names() == ["builtin_one", "gadget"]
    assert module not in sys.modules, "entry-point listing must read metadata only"
    assert "entry point of gadget-plugin 1.0" in widgets.describe("gadget")
    assert "test plugin gadget-plugin" in widgets.describe("gadget")
    loaded = widgets.get("gadget")
    assert loaded is sys.modules[module].Gadget


def test_entry_point_clashing_with_builtin_refused(plugin_dir: Path) -> None:
    widgets = fresh()
    widgets.register("join", "os.path:join")
    write_dist(plugin_dir, "clash-plugin", widgets.entry_point_group, {"join": "os.path:split"})
    with pytest.raises(
        DuplicateNameError, match=r"widget 'join' is registered twice: os.path:join"
    ):
        widgets.names()
    with pytest.raises(DuplicateNameError, match="clash-plugin"):
        widgets.get("join")


def test_two_plugins_clashing_refused(plugin_dir: Path) -> None:
    widgets = fresh()
    write_dist(plugin_dir, "first-plugin", widgets.entry_point_group, {"thing": "os.path:join"})
    write_dist(plugin_dir, "second-plugin", widgets.entry_point_group, {"thing": "os.path:split"})
    with pytest.raises(DuplicateNameError, match="registered twice"):
        widgets.names()


def test_same_target_twice_is_not_a_clash(plugin_dir: Path) -> None:
    widgets = fresh()
    widgets.register("join", "os.path:join")
    write_dist(plugin_dir, "echo-plugin", widgets.entry_point_group, {"join": "os.path:join"})
    assert widgets.names() == ["join"]


def test_broken_plugin_fails_on_selection_only(plugin_dir: Path) -> None:
    widgets = fresh()
    write_dist(
        plugin_dir, "broken-plugin", widgets.entry_point_group, {"bad": "no_such_mod_xyz:Thing"}
    )
    assert widgets.names() == ["bad"]
    with pytest.raises(
        ConfigError, match=r"widget 'bad' \(entry point of broken-plugin 1.0\) failed"
    ):
        widgets.get("bad")


def test_builtin_that_cannot_import_stays_loud() -> None:
    widgets = fresh()
    widgets.register("ghost", "no_such_mod_xyz.inner:Thing")
    with pytest.raises(
        ImportError, match=r"widget 'ghost': cannot import no_such_mod_xyz.inner:Thing"
    ):
        widgets.get("ghost")


def test_platform_plugins_are_checked(plugin_dir: Path) -> None:
    module = write_module(
        plugin_dir,
        "from xspec.platforms.cpu import CpuPlatform\n"
        "class NotAPlatform:\n    name = 'np'\n"
        "class Misnamed(CpuPlatform):\n    name = 'other'\n",
    )
    entries = {"np_plugin": f"{module}:NotAPlatform", "misnamed": f"{module}:Misnamed"}
    write_dist(plugin_dir, "odd-platforms", "xspec.platforms", entries)
    assert {"np_plugin", "misnamed"} <= set(registry.platforms.names())
    with pytest.raises(PlatformError, match=r"not a subclass of xspec\.platforms\.base\.Platform"):
        registry.platforms.get("np_plugin")
    with pytest.raises(PlatformError, match=r"set Misnamed\.name = 'misnamed'"):
        registry.platforms.get("misnamed")


def test_registries_inventory() -> None:
    expected: list[tuple[Registry[Any], str, str]] = [
        (registry.platforms, "platform", "xspec.platforms"),
        (registry.models, "model", "xspec.models"),
        (registry.spec_methods, "spec method", "xspec.spec_methods"),
    ]
    for reg, kind, group in expected:
        assert (reg.kind, reg.entry_point_group) == (kind, group)
        assert "plugin provides" in (reg.__doc__ or ""), f"{kind} registry states no contract"
        assert set(BUILTINS[kind]) <= set(reg.names())
    assert set(BUILTINS["platform"]) == {"auto", "cpu", "cuda", "npu", "npu_emulated"}
    assert set(BUILTINS["model"]) == {"qwen3", "deepseek_v4"}
    assert set(BUILTINS["spec method"]) == {"none", "mtp", "dspark", "dflash", "oracle", "wrong"}


# Fresh interpreter: listing must import no implementation (and not even torch);
# selecting one platform imports that platform's module and nothing else.
_LAZY_PROBE = """
import json, sys
from xspec import registry
listed = [r.names() for r in (registry.platforms, registry.models, registry.spec_methods)]
after_list = sorted(m for m in sys.modules if m.startswith("xspec") or m in ("torch", "torch_npu"))
registry.platforms.get("cpu")
after_get = sorted(m for m in sys.modules if m.startswith(("xspec.platforms", "xspec.spec"))
                   or m == "torch_npu")
print(json.dumps({"listed": listed, "after_list": after_list, "after_get": after_get}))
"""


def test_listing_imports_nothing_in_a_fresh_interpreter() -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run(
        [sys.executable, "-c", _LAZY_PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Only the registry itself (and whatever light modules `import xspec` pulls in).
    heavy = [m for m in result["after_list"] if m in ("torch", "torch_npu")]
    implementations = [
        m
        for m in result["after_list"]
        if m.startswith(("xspec.platforms", "xspec.models", "xspec.spec"))
    ]
    assert heavy == [] and implementations == [], result["after_list"]
    assert {"xspec.registry", "xspec.registry.builtins"} <= set(result["after_list"])
    assert "npu" in result["listed"][0] and "qwen3" in result["listed"][1]
    assert result["after_get"] == [
        "xspec.platforms",
        "xspec.platforms.base",
        "xspec.platforms.cpu",
    ], result["after_get"]


def test_model_plugin_selected_by_name(plugin_dir: Path) -> None:
    """``model=<entry-point name>`` composes like a built-in option (no YAML in xspec):
    ``ModelConfig(arch=name)``, ``model.path`` required; the plugin is imported only
    once the run is built, and then really used."""
    import xspec
    from xspec.compose import compose_run
    from xspec.models.qwen3.tiny import tiny_dir

    body = (
        "from xspec.models.qwen3 import Qwen3Family\n"
        "class ToyFamily(Qwen3Family):\n"
        "    arch = 'toy_lm'\n"
        "FAMILY = ToyFamily()\n"
    )
    module = write_module(plugin_dir, body)
    write_dist(plugin_dir, "toy-model", "xspec.models", {"toy_lm": f"{module}:FAMILY"})
    assert "toy_lm" in registry.models.names()
    cfg = compose_run(["model=toy_lm", "model.path=/somewhere", "spec=none"])
    assert (cfg.model.arch, cfg.model.path, cfg.model.preset) == ("toy_lm", "/somewhere", None)
    assert module not in sys.modules, "composing must not import the plugin"
    with pytest.raises(ConfigError, match=r"model\.path is required"):
        xspec.LLM(model="toy_lm", spec="none", platform="cpu")
    llm = xspec.LLM(
        model="toy_lm",
        spec="none",
        platform="cpu",
        overrides={"model.path": str(tiny_dir(False)), "model.tokenizer": "byte"},
    )
    assert module in sys.modules
    assert len(llm.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)[0].token_ids) == 3


def test_plugins_that_are_not_a_model_family_or_a_drafter_are_refused(plugin_dir: Path) -> None:
    """A model entry point must name a ModelFamily instance whose ``arch`` is its name; a
    spec method must name a Drafter subclass. Anything else is refused when selected,
    with a message naming the fix."""
    body = (
        "from xspec.models.qwen3 import Qwen3Family, load_model\n"
        "class Fam(Qwen3Family):\n"
        "    arch = 'fam_cls'\n"
        "class Misnamed(Qwen3Family):\n"
        "    arch = 'something_else'\n"
        "MISNAMED = Misnamed()\n"
        "class NotADrafter:\n"
        "    def __init__(self, cfg, **kw): pass\n"
    )
    module = write_module(plugin_dir, body)
    models = {
        "old_loader": f"{module}:load_model",
        "fam_cls": f"{module}:Fam",
        "misnamed_fam": f"{module}:MISNAMED",
    }
    write_dist(plugin_dir, "odd-models", "xspec.models", models)
    write_dist(
        plugin_dir, "odd-methods", "xspec.spec_methods", {"nodraft": f"{module}:NotADrafter"}
    )
    with pytest.raises(
        ConfigError, match=r"not an instance of a subclass of xspec\.models\.family\.ModelFamily"
    ):
        registry.models.get("old_loader")
    with pytest.raises(ConfigError, match=r"resolves to the class Fam; register an instance"):
        registry.models.get("fam_cls")
    with pytest.raises(ConfigError, match=r"set Misnamed\.arch = 'misnamed_fam'"):
        registry.models.get("misnamed_fam")
    with pytest.raises(ConfigError, match=r"not a subclass of xspec\.spec\.drafter\.Drafter"):
        registry.spec_methods.get("nodraft")


def test_builtins_are_model_families_and_drafters() -> None:
    from xspec.models.family import ModelFamily
    from xspec.spec.drafter import Drafter

    for name in BUILTINS["model"]:
        family = registry.models.get(name)
        assert isinstance(family, ModelFamily) and family.arch == name
    for name in BUILTINS["spec method"]:
        assert issubclass(registry.spec_methods.get(name), Drafter)
