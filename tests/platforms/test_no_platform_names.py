"""Core code never branches on platform identity (docs/architecture.md, "Platforms").

Scans every module under xspec/ except xspec/platforms/ (the one place allowed to know
device names) with the ``ast`` module, so comments and docstrings that *mention* the
forbidden patterns do not trip it, while any real comparison does:

- ``platform.name == ...`` (any ``*.name`` on something called platform);
- comparisons against a device/platform name literal: ``== "npu"``, ``!= "cuda"``,
  ``"cuda" in str(device)``, ``x in ("npu", "cpu")``;
- ``device.type == ...`` (any ``.type`` on something called device);
- ``is_npu()`` / ``is_cuda()`` / ``is_rocm()``-style predicates;
- ``torch.cuda.is_available()`` and any ``torch_npu`` import (detection is the
  platform's ``unavailable_reason``).

The scanner is tested on known-bad and known-good snippets first, so it cannot pass by
finding nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "xspec"
ALLOWED = ROOT / "platforms"
DEVICE_NAMES = {"npu", "cuda", "cpu", "xpu", "mps", "rocm", "hip", "npu_emulated"}
PREDICATES = {f"is_{name}" for name in DEVICE_NAMES} | {"is_cuda_alike", "is_out_of_tree"}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for Name/Attribute chains ("" for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _names_device(node: ast.AST) -> bool:
    """A str literal (or a tuple/list/set of them) naming a device or platform."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower() in DEVICE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_device(elt) for elt in node.elts)
    return False


def _identity_attribute(node: ast.AST) -> bool:
    """``<...platform>.name`` or ``<...device>.type``."""
    if not isinstance(node, ast.Attribute):
        return False
    owner = _dotted(node.value).lower()
    return (node.attr == "name" and "platform" in owner) or (
        node.attr == "type" and "device" in owner
    )


def _imports_torch_npu(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "torch_npu" for alias in node.names)
    return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch_npu"


def violations(source: str, filename: str = "<snippet>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_device(op) for op in operands):
                found.append(f"{where}: comparison with a device/platform name")
            elif any(_identity_attribute(op) for op in operands):
                found.append(f"{where}: comparison on platform.name / device.type")
        elif isinstance(node, ast.Call):
            callee = _dotted(node.func)
            if callee.rsplit(".", 1)[-1] in PREDICATES:
                found.append(f"{where}: platform predicate {callee}()")
            elif callee == "torch.cuda.is_available":
                found.append(f"{where}: device detection outside xspec/platforms")
        elif _imports_torch_npu(node):
            found.append(f"{where}: torch_npu imported outside xspec/platforms/npu")
    return found


@pytest.mark.parametrize(
    "bad",
    [
        'if platform.name == "npu":\n    pass',
        'if self.platform.name != "cuda":\n    pass',
        "ok = cfg.platform.name in names",
        'x = device.type == "cuda"',
        "x = hidden.device.type != target",
        'x = "cuda" in str(device)',
        'x = kind in ("npu", "cuda")',
        'x = backend == "NPU"',
        "x = current_platform.is_npu()",
        "x = is_cuda()",
        "x = torch.cuda.is_available()",
        "import torch_npu",
        "from torch_npu.contrib import transfer_to_npu",
    ],
)
def test_scanner_catches(bad: str) -> None:
    assert violations(bad), f"scanner missed: {bad!r}"


@pytest.mark.parametrize(
    "good",
    [
        '"""Never write platform.name == "npu" in core code."""',
        '# if device.type == "cuda": not like this',
        "device = platform.device()",
        'x = torch.zeros(3, device="cpu")',
        "mode = platform.sas_mode()",
        "if caps.native_sparse_attention:\n    pass",
        'msg = f"platform={platform.name}"',
        'same = dtype == "float32"',
    ],
)
def test_scanner_allows(good: str) -> None:
    assert violations(good) == []


def test_core_code_never_branches_on_platform_identity() -> None:
    files = [p for p in sorted(ROOT.rglob("*.py")) if ALLOWED not in p.parents]
    assert files, f"no core modules found under {ROOT}"
    found = []
    for path in files:
        found += violations(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert not found, "platform identity checks outside xspec/platforms:\n" + "\n".join(found)
