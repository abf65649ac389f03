"""Which shared-KV sparse attention (SAS) operator this process has, read from its schema.

Several packages register the operator, each in its own ``torch.ops`` namespace: torch_npu
under ``torch.ops.npu``, vllm-ascend's custom op library under ``torch.ops._C_ascend``.
:data:`SAS_OPERATORS` is the one table of the places xspec knows, with the module whose
import registers each; :func:`probe_sas_operator` reads the registered schemas (it never
calls an operator: some older ones abort during tiling when given explicit indices) and
returns a :class:`SasOperatorProbe` naming what it found.

Importing or calling anything here never imports torch_npu: the NPU platform's device half
imports it (with its install hint) before probing.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lightning_utilities.core.imports import package_available

log = logging.getLogger(__name__)

# The argument native SAS mode needs: the explicit window indices.
NATIVE_SAS_ARGUMENT = "ori_sparse_indices"
# Registers the torch.ops.npu candidates; only platform.py's _import_torch_npu imports it.
TORCH_NPU = "torch_npu"


@dataclass(frozen=True)
class SasOperatorCandidate:
    """A place a shared-KV sparse attention operator may be registered."""

    namespace: str  # torch.ops.<namespace>
    name: str
    registered_by: str  # the module whose import registers it

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}::{self.name}"


# Probed in this order: the first candidate that takes ori_sparse_indices wins, else the
# first one registered.
SAS_OPERATORS: tuple[SasOperatorCandidate, ...] = (
    SasOperatorCandidate("npu", "npu_sparse_attn_sharedkv", TORCH_NPU),
    SasOperatorCandidate("npu", "sparse_attn_sharedkv", TORCH_NPU),
    SasOperatorCandidate("_C_ascend", "npu_sparse_attn_sharedkv", "vllm_ascend.vllm_ascend_C"),
)


@dataclass(frozen=True)
class SasOperatorProbe:
    """What the probe found: the operator chosen and whether it takes explicit indices."""

    # "namespace::name" of the operator chosen (the emulation names its stand-in);
    # None: no candidate is registered
    operator: str | None
    accepts_ori_sparse_indices: bool
    looked_for: tuple[str, ...] = ()  # qualified names probed, for the "none found" line

    def describe(self) -> str:
        """One clause for the run report, e.g. ``_C_ascend::npu_sparse_attn_sharedkv takes
        ori_sparse_indices``."""
        if self.operator is None:
            return (
                "no shared-KV sparse attention operator is registered (looked for "
                f"{', '.join(self.looked_for)})"
            )
        verb = "takes" if self.accepts_ori_sparse_indices else "does not take"
        return f"{self.operator} {verb} {NATIVE_SAS_ARGUMENT}"


def probe_sas_operator(
    candidates: Sequence[SasOperatorCandidate] = SAS_OPERATORS,
) -> SasOperatorProbe:
    """Look ``candidates`` up in ``torch.ops`` (registered operators only; nothing imported)."""
    looked_for = tuple(c.qualified_name for c in candidates)
    first_found: str | None = None
    for candidate in candidates:
        arguments = _schema_arguments(candidate)
        if arguments is None:
            continue
        if any(NATIVE_SAS_ARGUMENT in names for names in arguments):
            return SasOperatorProbe(candidate.qualified_name, True, looked_for)
        first_found = first_found or candidate.qualified_name
    return SasOperatorProbe(first_found, False, looked_for)


def import_registering_modules(candidates: Sequence[SasOperatorCandidate] = SAS_OPERATORS) -> None:
    """Import the modules that register ``candidates``, where installed (never torch_npu).

    vllm-ascend registers ``torch.ops._C_ascend`` only when its extension module is
    imported, so a probe of the namespaces alone would miss it in a plain xspec run. A
    module that is installed but fails to load is logged and skipped: the probe then
    reports the operators that did load.
    """
    for module in dict.fromkeys(c.registered_by for c in candidates):
        if module == TORCH_NPU or module in sys.modules:
            continue
        if not package_available(module.partition(".")[0]):  # find_spec: imports nothing
            continue
        try:
            importlib.import_module(module)
        except (ImportError, OSError, RuntimeError) as exc:
            log.warning(
                "cannot load %s (%s); its sparse attention operator is not probed", module, exc
            )


def _schema_arguments(candidate: SasOperatorCandidate) -> list[set[str]] | None:
    """The argument names of each overload of ``candidate``; None when it is not registered."""
    try:
        packet = getattr(getattr(torch.ops, candidate.namespace), candidate.name)
    except (AttributeError, RuntimeError):
        return None
    return [
        {arg.name for arg in getattr(packet, overload)._schema.arguments}
        for overload in packet.overloads()
    ]
