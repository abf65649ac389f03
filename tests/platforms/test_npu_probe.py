"""The SAS operator probe reads every namespace it knows, from real registered schemas.

No torch_npu: each test registers real operators with ``torch.library`` in the namespaces
the packages use (``_C_ascend``: vllm-ascend, ``npu``: torch_npu) and destroys them when it
ends, so no other test sees them (the ``registry`` fixture checks that).
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.platforms.conformance import NativeSas, PlatformCfg
from xspec.platforms.base import SasMode
from xspec.platforms.npu.platform import NpuPlatform
from xspec.platforms.npu.probe import (
    SAS_OPERATORS,
    SasOperatorCandidate,
    import_registering_modules,
    probe_sas_operator,
)

VLLM_ASCEND = "_C_ascend::npu_sparse_attn_sharedkv"
TORCH_NPU = "npu::npu_sparse_attn_sharedkv"
# Schemas of a newer operator (takes the explicit window indices) and an older one.
NEW_SCHEMA = "Tensor query, Tensor ori_kv, Tensor? ori_sparse_indices=None"
OLD_SCHEMA = "Tensor query, Tensor ori_kv"

Register = Callable[[str, str], None]


@pytest.fixture
def register() -> Iterator[Register]:
    """``register("ns::name", args)`` defines a real operator for the test's duration."""
    if probe_sas_operator().operator is not None:
        pytest.skip("a sparse attention operator is already registered in this process")
    libs: list[torch.library.Library] = []

    def define(qualified_name: str, args: str) -> None:
        namespace, name = qualified_name.split("::")
        lib = torch.library.Library(namespace, "FRAGMENT")
        libs.append(lib)
        lib.define(f"{name}({args}) -> Tensor")

    yield define
    for lib in libs:
        lib._destroy()
    assert probe_sas_operator().operator is None, "a test operator outlived its test"


class ProbingNpuPolicy(NpuPlatform):
    """The real NPU platform with only the device half replaced: detection passes, and no
    module is imported before the probe (the test registered the operators itself)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def _import_operator_modules(self) -> None:
        pass


def npu_policy(native_sas: str = "auto") -> ProbingNpuPolicy:
    return ProbingNpuPolicy(PlatformCfg(name="npu", native_sas=NativeSas(native_sas)))


def test_table_names_every_known_namespace() -> None:
    names = [c.qualified_name for c in SAS_OPERATORS]
    assert names == [TORCH_NPU, "npu::sparse_attn_sharedkv", VLLM_ASCEND]
    by_module = {c.qualified_name: c.registered_by for c in SAS_OPERATORS}
    assert by_module[TORCH_NPU] == "torch_npu"
    assert by_module[VLLM_ASCEND] == "vllm_ascend.vllm_ascend_C"


def test_finds_the_vllm_ascend_operator(register: Register) -> None:
    register(VLLM_ASCEND, NEW_SCHEMA)
    probe = probe_sas_operator()
    assert probe.operator == VLLM_ASCEND and probe.accepts_ori_sparse_indices
    assert probe.describe() == f"{VLLM_ASCEND} takes ori_sparse_indices"


def test_reports_none_with_the_places_it_looked(register: Register) -> None:
    probe = probe_sas_operator()
    assert probe.operator is None and not probe.accepts_ori_sparse_indices
    assert probe.describe() == (
        "no shared-KV sparse attention operator is registered (looked for "
        f"{TORCH_NPU}, npu::sparse_attn_sharedkv, {VLLM_ASCEND})"
    )


def test_an_older_operator_is_found_but_does_not_take_indices(register: Register) -> None:
    register(TORCH_NPU, OLD_SCHEMA)
    probe = probe_sas_operator()
    assert probe.operator == TORCH_NPU and not probe.accepts_ori_sparse_indices
    assert probe.describe() == f"{TORCH_NPU} does not take ori_sparse_indices"


def test_prefers_the_operator_that_takes_indices(register: Register) -> None:
    # torch_npu's older operator comes first in the table; vllm-ascend's newer one wins.
    register(TORCH_NPU, OLD_SCHEMA)
    register(VLLM_ASCEND, NEW_SCHEMA)
    probe = probe_sas_operator()
    assert probe.operator == VLLM_ASCEND and probe.accepts_ori_sparse_indices


def test_any_overload_taking_indices_counts(register: Register) -> None:
    register(TORCH_NPU, OLD_SCHEMA)
    register(f"{TORCH_NPU}.indexed", NEW_SCHEMA)
    probe = probe_sas_operator()
    assert probe.operator == TORCH_NPU and probe.accepts_ori_sparse_indices


@pytest.mark.parametrize(
    ("registered", "mode", "reason"),
    [
        ((VLLM_ASCEND, NEW_SCHEMA), SasMode.NATIVE, f"{VLLM_ASCEND} takes ori_sparse_indices"),
        ((TORCH_NPU, OLD_SCHEMA), SasMode.COMPAT, f"{TORCH_NPU} does not take"),
        (None, SasMode.COMPAT, "no shared-KV sparse attention operator is registered"),
    ],
)
def test_auto_follows_the_probe_and_the_headline_says_why(
    register: Register, registered: tuple[str, str] | None, mode: SasMode, reason: str
) -> None:
    if registered is not None:
        register(*registered)
    platform = npu_policy("auto")
    assert platform.sas_mode() is mode
    assert platform.capabilities.native_sparse_attention == (mode is SasMode.NATIVE)
    # the clause the run headline prints (engine/report.py: step_options().summary())
    summary = platform.step_options().summary()
    assert f"sparse attention: {mode.value} ({reason}" in summary, summary


def test_on_and_off_headline_clauses(register: Register) -> None:
    platform = npu_policy("on")
    assert not platform.operator_accepts_ori_sparse_indices
    assert "sparse attention: compat (no shared-KV" in platform.sas_summary()
    off = npu_policy("off")
    assert off.step_options().describe.endswith(
        "; sparse attention: compat (platform.native_sas=off)"
    )


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for registering modules; their imports are undone after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        lib = getattr(sys.modules.pop(name), "LIB", None)
        if lib is not None:
            lib._destroy()


def test_imports_the_module_that_registers_a_namespace(
    module_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tag = uuid.uuid4().hex[:8]
    namespace, module = f"xspec_probe_{tag}", f"xspec_probe_ext_{tag}"
    # Like vllm-ascend's extension module: importing it registers the namespace's operators.
    (module_dir / f"{module}.py").write_text(
        "import torch\n"
        f"LIB = torch.library.Library({namespace!r}, 'DEF')\n"
        f"LIB.define('sparse_attn({NEW_SCHEMA}) -> Tensor')\n"
    )
    (module_dir / f"broken_{tag}.py").write_text(
        "raise ImportError('libascend_hal.so: not found')\n"
    )
    candidates = (
        SasOperatorCandidate(f"missing_{tag}", "sparse_attn", f"not_installed_{tag}.ext"),
        SasOperatorCandidate(f"broken_{tag}", "sparse_attn", f"broken_{tag}"),
        SasOperatorCandidate(namespace, "sparse_attn", module),
    )
    assert probe_sas_operator(candidates).operator is None  # not imported yet
    with caplog.at_level(logging.WARNING):
        import_registering_modules(candidates)
    assert f"cannot load broken_{tag} (libascend_hal.so: not found)" in caplog.text
    probe = probe_sas_operator(candidates)
    assert probe.operator == f"{namespace}::sparse_attn" and probe.accepts_ori_sparse_indices
