"""Training state files: safetensors + JSON, never pickle.

A job's resumable state (module weights, optimiser, data generator, step) is one
``<name>_state.safetensors``: every tensor in the safetensors body (``module.<key>``,
``optimizer.state.<i>.<name>``, ``generator``), everything else (the step, the
optimiser's param groups and any non-tensor per-parameter entry) as JSON under the
header's ``xspec`` metadata key. Reading it parses a JSON header and raw tensor bytes, so
a crafted file is an error naming the file, never code. One file, written atomically
(:mod:`xspec.atomic`): a crash or a full disk leaves the previous save as it was.

Work directories of older xspec versions held pickles (``<name>_state.pt``,
``regen.pt``, ``train_tokens.pt``); :func:`refuse_pickle` refuses them without opening
them (unpickling can run arbitrary code) and says how to proceed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from xspec import atomic
from xspec.errors import CheckpointError

FORMAT = "xspec.train_state.v1"
META_KEY = "xspec"
MODULE, OPTIMIZER, GENERATOR = "module.", "optimizer.state.", "generator"
READ_ERRORS = (OSError, ValueError, TypeError, KeyError, AttributeError, SafetensorError)


@dataclass
class TrainState:
    step: int
    module: dict[str, torch.Tensor]  # the module's state_dict
    optimizer: dict[str, Any]  # torch's optimizer state_dict: {"state": {i: {...}}, "param_groups"}
    generator: torch.Tensor  # [n] uint8: torch.Generator.get_state()


def state_path(out_dir: Path, name: str) -> Path:
    return out_dir / f"{name}_state.safetensors"


def legacy_state_path(out_dir: Path, name: str) -> Path:
    return out_dir / f"{name}_state.pt"


def refuse_pickle(path: Path, rebuild: str) -> None:
    """CheckpointError when the pickle ``path`` exists; it is never opened. ``rebuild``:
    what running again does once it is deleted."""
    if path.exists():
        raise CheckpointError(
            f"{path} is a pickle file written by an older xspec; it is not loaded (unpickling "
            f"can run arbitrary code). Delete it and run the stage again: {rebuild}"
        )


def save_state(path: Path, state: TrainState) -> None:
    """Write ``state`` to ``path`` atomically (OutputError when the disk refuses)."""
    tensors = {MODULE + k: v for k, v in state.module.items()}
    per_param: dict[str, dict[str, Any]] = {}
    for i, entries in state.optimizer["state"].items():
        plain = per_param.setdefault(str(i), {})
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIMIZER}{i}.{key}"] = value
            else:
                plain[key] = value
    tensors[GENERATOR] = state.generator
    body = {
        "format": FORMAT,
        "step": state.step,
        "optimizer": {"state": per_param, "param_groups": state.optimizer["param_groups"]},
    }
    meta = {"format": FORMAT, META_KEY: json.dumps(body, allow_nan=False)}
    # own, contiguous CPU copies: safetensors refuses tensors that share storage (tied weights)
    owned = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    # serialised in memory, written by plain file I/O: a full disk is an OSError (OutputError)
    atomic.write_bytes(path, save(owned, metadata=meta))


def load_state(path: Path) -> TrainState:
    """Read ``path`` (written by :func:`save_state`); CheckpointError naming the file when it
    is not one."""
    fix = "delete it to train that stage again from step 0"
    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        if meta.get("format") != FORMAT:
            raise ValueError(f"no {FORMAT} header")
        body = json.loads(meta[META_KEY])
        return _unflatten(body, tensors)
    except READ_ERRORS as e:
        raise CheckpointError(
            f"{path} is not a readable xspec training state ({e}); {fix}"
        ) from None


def _unflatten(body: dict[str, Any], tensors: dict[str, torch.Tensor]) -> TrainState:
    step = body["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    opt = body["optimizer"]
    state: dict[int, dict[str, Any]] = {int(i): dict(plain) for i, plain in opt["state"].items()}
    module: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key.startswith(MODULE):
            module[key.removeprefix(MODULE)] = t
        elif key.startswith(OPTIMIZER):
            i, name = key.removeprefix(OPTIMIZER).split(".", 1)
            state[int(i)][name] = t
        elif key != GENERATOR:
            raise ValueError(f"unexpected tensor {key!r}")
    groups = opt["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError("optimizer.param_groups must be a list of objects")
    return TrainState(step, module, {"state": state, "param_groups": groups}, tensors[GENERATOR])


def restore_optimizer(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``opt.load_state_dict(saved)``, with what JSON turned into lists (AdamW's ``betas``)
    made tuples again where ``opt`` holds tuples, so the optimiser is as it was saved."""
    groups = []
    for g, theirs in enumerate(saved["param_groups"]):
        mine = opt.param_groups[g] if g < len(opt.param_groups) else {}
        fixed = dict(theirs)
        for key, value in theirs.items():
            if isinstance(mine.get(key), tuple) and isinstance(value, list):
                fixed[key] = tuple(value)
        groups.append(fixed)
    opt.load_state_dict({"state": saved["state"], "param_groups": groups})
