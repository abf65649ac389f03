"""Planning a DeepSeek-V4 drafter's tensors (MTP layer, DSpark stages) from headers only.

:func:`plan_tensors` matches checkpoint names to module keys, checks every expected
tensor's shape and storage (float, W8A8 with ``weight_scale``/``weight_offset`` marked in
``quant_model_description.json``, FP8 with block ``.scale``, MXFP4 experts with a per-32
``.scale``: the target loader's formats,
:mod:`xspec.models.deepseek_v4.weights`) and lists every problem, before any allocation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.weights import (
    FLOAT_CODES,
    QUANT_DESCRIPTION,
    W8A8_SIBLINGS,
    W8A8_TYPES,
    fp8_block,
    is_mxfp4,
    mxfp4_problem,
)
from xspec.models.loading import Checkpoint


def plan_tensors(
    ckpt: Checkpoint,
    key_of: Callable[[str], str | None],
    expected_for: Callable[[set[str]], dict[str, list[int]]],
    what: str,
    *,
    label: Callable[[str], str] = lambda key: key,
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(checkpoint name -> module key, dequant schemes, problems) from headers.

    ``key_of(name)``: the module key a checkpoint tensor provides (None = not ours);
    ``expected_for(found keys)``: module key -> shape of every tensor the module needs
    (optional tensors decided by what was found); ``what`` names the module in messages,
    ``label(key)`` the checkpoint name to ask for when a key is missing.
    """
    problems: list[str] = []
    found: dict[str, str] = {}  # module key -> checkpoint name
    for name in ckpt.names():
        key = key_of(name)
        if key is None:
            continue
        if key in found:
            problems.append(
                f"tensors {found[key]!r} and {name!r} both provide the {what}'s {key!r}; keep one"
            )
            continue
        found[key] = name
    expected = expected_for(set(found))
    qtypes = ckpt.read_json(QUANT_DESCRIPTION) or {}  # per-tensor quant types (msModelSlim)
    consumed: set[str] = set()  # quantisation siblings (weight_scale, .scale ...)
    dequant: dict[str, str] = {}
    for key, want in expected.items():
        if key not in found:
            problems.append(f"missing tensor {label(key)} (expected shape {want}) in {ckpt.path}")
            continue
        name = found[key]
        shape, _ = ckpt.meta(name)
        if is_mxfp4(ckpt, name, qtypes.get(name)):  # packed: [N, K/2] holds want = [N, K]
            consumed.add(name.removesuffix(".weight") + ".scale")
            if problem := mxfp4_problem(ckpt, name, want):
                problems.append(problem)
            else:
                dequant[name] = "mxfp4"
        elif shape != want:
            problems.append(
                f"tensor {name!r} in {ckpt.file_of(name).name} has shape {shape}, expected {want}"
            )
        elif scheme := quant_scheme(ckpt, name, want, qtypes.get(name), problems, consumed):
            dequant[name] = scheme
    for key, name in found.items():
        if key not in expected and name not in consumed:
            problems.append(
                f"unexpected tensor {name!r} in {ckpt.file_of(name).name}: not part of a "
                f"DeepSeek-V4 {what} layer for this config.json"
            )
    names = {name: key for key, name in found.items() if key in expected}
    return names, dequant, problems


def quant_scheme(
    ckpt: Checkpoint,
    name: str,
    want: list[int],
    qtype: str | None,
    problems: list[str],
    consumed: set[str],
) -> str | None:
    """How ``name`` is stored: None (float), "w8a8" or "fp8" (the target loader's formats:
    :mod:`xspec.models.deepseek_v4.weights`); anything else is a problem."""
    _, code = ckpt.meta(name)
    base, where = name.removesuffix(".weight"), f"tensor {name!r} in {ckpt.file_of(name).name}"
    if code in FLOAT_CODES:
        return None
    if code == "I8" and qtype in W8A8_TYPES and len(want) == 2:
        consumed.update(f"{base}.{s}" for s in W8A8_SIBLINGS if f"{base}.{s}" in ckpt)
        scales = [f"{base}.weight_scale"] + [f"{base}.weight_offset"] * (
            f"{base}.weight_offset" in ckpt
        )
        grids = ([want[0], 1], [want[0]])
        return "w8a8" if siblings_ok(ckpt, where, scales, grids, problems) else None
    if code == "F8_E4M3" and f"{base}.scale" in ckpt and len(want) == 2:
        consumed.add(f"{base}.scale")
        grid = [math.ceil(w / b) for w, b in zip(want, fp8_block(ckpt))]
        return "fp8" if siblings_ok(ckpt, where, [f"{base}.scale"], (grid,), problems) else None
    problems.append(
        f"{where} has unsupported dtype {code} (quant type {qtype}); supported: {list(FLOAT_CODES)}, "
        f"I8 marked {' / '.join(W8A8_TYPES)} in {QUANT_DESCRIPTION} with X.weight_scale, "
        "F8_E4M3 with its block X.scale, I8 MXFP4 with its per-32 X.scale"
    )
    return None


def siblings_ok(
    ckpt: Checkpoint,
    where: str,
    names: list[str],
    shapes: tuple[list[int], ...],
    problems: list[str],
) -> bool:
    """Every scale / offset sibling present with one of ``shapes``."""
    ok = True
    for sib in names:
        if sib not in ckpt:
            problems.append(f"{where} is quantised but {sib!r} is missing")
            ok = False
        elif ckpt.meta(sib)[0] not in shapes:
            problems.append(
                f"{sib!r} has shape {ckpt.meta(sib)[0]}; {where} needs one of {list(shapes)}"
            )
            ok = False
    return ok


def crossover_problems(
    where: Path, args: DeepseekV4Args, target_args: DeepseekV4Args, what: str
) -> list[str]:
    """A drafter reads the target's hidden states and token ids: ``hidden_size``,
    ``vocab_size`` and ``hc_mult`` must match (``what`` names the drafter)."""
    problems = []
    for key in ("hidden_size", "vocab_size", "hc_mult"):
        mine, theirs = getattr(args, key), getattr(target_args, key)
        if mine != theirs:
            problems.append(
                f"{where}: {key} is {mine} but the target's is {theirs}; the {what} consumes "
                f"the target's hidden states and token ids, use the {what} of this target"
            )
    return problems
