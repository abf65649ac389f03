"""One resumable training loop for the target and its drafters.

A :class:`Job` owns the trainable module, the optimiser (AdamW, linear warmup then
cosine decay to ``min_lr_ratio``), a seeded generator for its data and a loss
function; :func:`run` steps it with a progress bar, appends one JSON line per logged
step to ``<name>_log.jsonl`` (the window's mean metrics and ``step_s``, its wall
seconds a step) and saves ``<name>_state.safetensors`` (module, optimiser,
step, generator; :mod:`xspec.train.state`: no pickle, written atomically) every
``save_every`` steps and at the end. Starting again with the same directory resumes from
the last save: same data order, same result as one run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xspec import atomic
from xspec.errors import CheckpointError
from xspec.train.state import (
    TrainState,
    legacy_state_path,
    load_state,
    refuse_pickle,
    restore_optimizer,
    save_state,
    state_path,
)

LossFn = Callable[[torch.Generator], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class Schedule:
    steps: int
    lr: float
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    save_every: int = 100
    log_every: int = 10

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (
            self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        )


@dataclass
class Job:
    name: str  # files: <name>_state.safetensors, <name>_log.jsonl
    module: nn.Module
    params: list[nn.Parameter]
    loss_fn: LossFn
    schedule: Schedule
    seed: int
    after_step: Callable[[], None] | None = None  # e.g. the router bias update


def run(job: Job, out_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """Train ``job`` to ``schedule.steps`` (resuming from ``out_dir``); returns the mean of
    the last logged window of metrics, and the wall time of this call."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    path, log_path = state_path(out_dir, job.name), out_dir / f"{job.name}_log.jsonl"
    refuse_pickle(legacy_state_path(out_dir, job.name), f"{job.name} starts over from step 0")
    sched = job.schedule
    opt = torch.optim.AdamW(  # foreach: one op per kind for all tensors, not per tensor
        job.params, lr=sched.lr, weight_decay=sched.weight_decay, betas=(0.9, 0.95), foreach=True
    )
    gen = torch.Generator().manual_seed(job.seed)
    step = _resume(path, job, opt, gen) if path.exists() else 0
    if log_path.exists():  # keep the lines up to the saved step: no stale or doubled ones
        lines = log_path.read_text().splitlines()
        kept = [x for x in lines if json.loads(x)["step"] <= step]
        if len(kept) < len(lines):
            atomic.write_text(log_path, "".join(x + "\n" for x in kept))
    job.module.train()
    window: list[dict[str, float]] = []
    start = since = time.perf_counter()
    bar = tqdm(
        total=sched.steps, initial=step, desc=job.name, disable=not progress, dynamic_ncols=True
    )
    while step < sched.steps:
        for group in opt.param_groups:
            group["lr"] = sched.lr_at(step)
        loss, metrics = job.loss_fn(gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(job.params, sched.grad_clip)
        opt.step()
        if job.after_step is not None:
            job.after_step()
        step += 1
        window.append(metrics | {"grad_norm": float(norm)})
        bar.update(1)
        if step % sched.log_every == 0 or step == sched.steps:
            mean = {k: sum(m[k] for m in window) / len(window) for k in window[0]}
            bar.set_postfix({k: f"{v:.3f}" for k, v in mean.items() if k != "grad_norm"})
            now = time.perf_counter()
            mean["step_s"] = (now - since) / len(window)  # wall seconds a step, this window
            with log_path.open("a") as f:
                f.write(json.dumps({"step": step, "lr": sched.lr_at(step - 1)} | mean) + "\n")
            window, since = [], now
        if step % sched.save_every == 0 or step == sched.steps:
            save_state(
                path, TrainState(step, job.module.state_dict(), opt.state_dict(), gen.get_state())
            )
    bar.close()
    job.module.eval()
    final = last_logged(log_path)
    return final | {"wall_s": time.perf_counter() - start, "schedule": asdict(sched)}


def _resume(path: Path, job: Job, opt: torch.optim.Optimizer, gen: torch.Generator) -> int:
    """Load the saved state into the module, optimiser and generator; the saved step."""
    saved = load_state(path)
    try:
        job.module.load_state_dict(saved.module)
        restore_optimizer(opt, saved.optimizer)
        gen.set_state(saved.generator)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{path} does not fit this {job.name} job ({e}); delete it to train it again "
            "from step 0"
        ) from None
    return saved.step


def last_logged(log_path: Path) -> dict[str, float]:
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    return json.loads(lines[-1]) if lines else {}
