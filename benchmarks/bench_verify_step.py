"""Verify-step cost on the dsv4_tiny target: gamma+1 rows vs a 1-row decode step.

    python benchmarks/bench_verify_step.py [--contexts 128 1024 4000] [--rows 6] [--reps 30]
                                           [--batch 1] [--device cpu] [--threads N]
                                           [--kernels auto|reference] [--compile auto|on|off]

Speculative decoding pays off only if scoring ``gamma + 1`` rows costs about as much as
scoring one: for each context length a state is prefilled once, then a verify forward of
``--rows`` rows (default 6 = gamma 5 + anchor) and a plain 1-row decode step are timed
at the same position, truncating the state back after every call (exact rollback), with
the two interleaved and the median reported. Target: ratio <= 1.3. Not a test: nothing
is asserted. ``--kernels`` / ``--compile`` are the ``platform.kernels`` /
``platform.compile`` settings the steps run with (compilation happens in the warm-up).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from step_setup import interleaved, scorer  # (the script's folder is on sys.path)

from xspec.config import DType, ModelConfig, PlatformConfig, StepCompile, StepKernels
from xspec.models.base import ForwardBatch
from xspec.models.deepseek_v4 import load_model
from xspec.models.deepseek_v4.model import DeepseekV4Model
from xspec.models.deepseek_v4.state import DeepseekV4State
from xspec.platforms import get_platform


def prefilled(
    model: DeepseekV4Model, n: int, batch: int, gen: torch.Generator
) -> list[DeepseekV4State]:
    states = [model.new_state() for _ in range(batch)]
    for s in states:
        ids = torch.randint(2, model.vocab_size, (n,), generator=gen)
        for lo in range(0, n, 1024):
            chunk = ids[lo : lo + 1024]
            model.forward(ForwardBatch(chunk, [len(chunk)], [s]))
    return states


def decode_cycle(
    model: DeepseekV4Model, states: list[DeepseekV4State], steps: int, gen: torch.Generator
) -> Callable[[], None]:
    """``steps`` one-row decode steps in a row (positions n .. n+steps-1), then rollback:
    divided by ``steps``, the mean decode step over a compression cycle, which includes
    the entry emissions a fixed position may miss (a ratio-4 layer emits every 4th)."""
    ids = torch.randint(2, model.vocab_size, (steps, len(states)), generator=gen)
    n0 = [s.num_tokens for s in states]

    def fn() -> None:
        for row in ids:
            model.forward(ForwardBatch(row, [1] * len(states), states))
        for s, n in zip(states, n0):
            model.truncate(s, n)

    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4000])
    ap.add_argument("--rows", type=int, default=6, help="verify rows (gamma + 1)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per forward")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=[d.value for d in DType])
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference"])
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_grad_enabled(False)
    cfg = ModelConfig(arch="deepseek_v4", preset="tiny", dtype=DType(a.dtype))
    platform = get_platform(
        PlatformConfig(
            name=a.device, kernels=StepKernels(a.kernels), compile=StepCompile(a.compile)
        )
    )
    options = platform.step_options()
    model = load_model(cfg, device=device, max_rollback=max(a.rows, 8), steps=options)
    gen = torch.Generator().manual_seed(0)
    print(
        f"dsv4_tiny {a.dtype} on {device} ({torch.get_num_threads()} CPU threads), batch {a.batch}, "
        f"median of {a.reps} interleaved reps; {options.describe}"
    )
    print(
        f"{'context':>8} {'1 row (ms)':>11} {f'{a.rows} rows (ms)':>12} {'ratio':>6}"
        f" {'mean of 4 decodes (ms)':>23} {'ratio':>6}"
    )
    for n in a.contexts:
        states = prefilled(model, n, a.batch, gen)
        fns = {
            "one": scorer(model, states, 1, gen),
            "verify": scorer(model, states, a.rows, gen),
            "cycle": decode_cycle(model, states, 4, gen),
        }
        interleaved(fns, 3, sync)  # warm-up
        med = interleaved(fns, a.reps, sync)
        one, verify, mean = med["one"], med["verify"], med["cycle"] / 4
        print(
            f"{n:>8} {one * 1e3:>11.2f} {verify * 1e3:>12.2f} {verify / one:>6.2f}"
            f" {mean * 1e3:>23.2f} {verify / mean:>6.2f}"
        )
    print(
        "target: ratio <= 1.3 (first ratio: the decode step at the verify's own position; "
        "second: the mean decode step over positions n..n+3)"
    )
    if options.compile is not None:
        print(f"({options.compile.describe()}, all in the warm-up)")


if __name__ == "__main__":
    main()
