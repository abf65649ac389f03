"""DeepSeek-V4 target benchmarks on the dsv4_tiny preset (CPU; ratios measured side by side).

    python benchmarks/bench_dsv4_target.py [--quick] [--models dsv4_tiny dsv4_tiny_random]
                                           [--batches 1 8] [--compile]

1. Decode step time at context 4096 vs 256 (compressed attention keeps it near flat;
   target ratio <= 1.5).
2. Greedy decode throughput at each batch size: xspec vs transformers' own ``generate``
   on the same checkpoint and prompts (target xspec >= 2x), xspec with its steps on the
   reference torch ops, on the platform's fused kernels (the default), and with
   ``--compile`` compiled (compile time is spent in the warm-up call, never timed).
3. KV bytes per token and fixed bytes per sequence, read from the allocated tensors and
   compared with the analytic formula.

Repetitions of the things compared are interleaved and the median is reported, so
machine noise hits both sides alike. Nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import xspec
from xspec.models.base import ForwardBatch
from xspec.models.deepseek_v4.state import kv_bytes


def interleaved(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds per call of each fn, calling them round-robin ``reps`` times after
    one untimed warm-up call each (first calls pay one-off allocations and lazy setup)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def prefill(model, n: int, gen: torch.Generator):
    state = model.new_state()
    ids = torch.randint(2, model.vocab_size, (n,), generator=gen)
    for lo in range(0, n, 1024):
        chunk = ids[lo : lo + 1024]
        model.forward(ForwardBatch(chunk, [len(chunk)], [state]))
    return state


def decode_step_ratio(model, reps: int, contexts: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    states = {n: prefill(model, n, gen) for n in contexts}

    def step(n: int) -> Callable[[], None]:
        def fn() -> None:
            s = states[n]
            model.forward(ForwardBatch(torch.tensor([7]), [1], [s]))
            model.truncate(s, n)

        return fn

    med = interleaved({f"ctx{n}": step(n) for n in contexts}, reps)
    lo, hi = contexts
    print(
        f"[1] decode step, 1 sequence: ctx {lo}: {med[f'ctx{lo}'] * 1e3:.2f} ms, ctx {hi}: {med[f'ctx{hi}'] * 1e3:.2f} ms"
    )
    print(f"    ratio ctx{hi}/ctx{lo} = {med[f'ctx{hi}'] / med[f'ctx{lo}']:.2f}  (target <= 1.5)")


def throughput_vs_hf(
    model: str, batches: list[int], prompt_len: int, new_tokens: int, reps: int, compile_: bool
) -> None:
    """Greedy decode throughput of ``model``: transformers' ``generate`` and xspec with its
    steps on the reference torch ops, on the platform's fused kernels (the default) and,
    with ``compile_``, compiled; every variant interleaved in the same repetitions."""
    from transformers import DeepseekV4ForCausalLM

    variants = {"reference ops": {"platform.kernels": "reference"}, "fused kernels": {}}
    if compile_:
        variants["compiled"] = {"platform.compile": "on"}
    llms = {
        name: xspec.LLM(model=model, spec="none", platform="cpu", overrides=o)
        for name, o in variants.items()
    }
    first = next(iter(llms.values()))
    path = first.built.target.checkpoint_dir  # the same official-layout directory
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = first.built.target.num_layers
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(
            4, first.built.target.vocab_size, (batch, prompt_len), generator=gen
        )
        med = interleaved(generators(hf, llms, prompts, new_tokens), reps)
        tokens = batch * new_tokens
        print(
            f"[2] {model} ({layers} layers) greedy decode, batch {batch}, prompt {prompt_len}, "
            f"{new_tokens} new tokens (tok/s; x transformers):"
        )
        for name, t in med.items():
            print(f"    {name:<14} {tokens / t:8.1f}  {med['transformers'] / t:5.2f}x")
        print("    target: xspec >= 2x transformers")
    for name, llm in llms.items():
        print(f"    steps of '{name}': {llm.built.platform.step_options().summary()}")


def generators(
    hf: Any, llms: dict[str, xspec.LLM], prompts: torch.Tensor, new_tokens: int
) -> dict[str, Callable[[], None]]:
    """The compared calls: transformers' greedy ``generate`` and each xspec variant's."""

    def run_hf() -> None:
        with torch.no_grad():
            hf.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )

    def run_xspec(llm: xspec.LLM) -> Callable[[], None]:
        return lambda: llm.generate(prompts.tolist(), max_new_tokens=new_tokens, ignore_eos=True)

    return {"transformers": run_hf} | {name: run_xspec(llm) for name, llm in llms.items()}


def kv_accounting(model, context: int) -> None:
    gen = torch.Generator().manual_seed(2)
    state = prefill(model, context, gen)
    fixed, per_token = kv_bytes(model.args, model.dtype, model.max_rollback)
    print(
        f"[3] KV accounting: analytic fixed {fixed} B/seq, {per_token:.2f} B/token; "
        f"allocated fixed {state.nbytes_fixed()} B, {state.nbytes_per_token():.2f} B/token "
        f"-> {'equal' if (fixed, per_token) == (state.nbytes_fixed(), state.nbytes_per_token()) else 'DIFFERENT'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument(
        "--models",
        nargs="+",
        default=["dsv4_tiny", "dsv4_tiny_random"],
        help="presets for [2] (dsv4_tiny: 12 layers, trained; dsv4_tiny_random: 5 layers)",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--compile", action="store_true", help="also xspec with platform.compile=on")
    a = ap.parse_args()
    torch.set_num_threads(1)
    llm = xspec.LLM(
        model="dsv4_tiny", spec="none", platform="cpu", overrides={"model.max_context": 8192}
    )
    model = llm.built.target
    reps = 5 if a.quick else 15
    decode_step_ratio(model, reps * 2, (256, 4096))
    # a shared CPU is noisy: several interleaved repetitions, the median reported
    for name in a.models:
        throughput_vs_hf(
            name,
            a.batches,
            prompt_len=64,
            new_tokens=16 if a.quick else 32,
            reps=5 if a.quick else 9,
            compile_=a.compile,
        )
    kv_accounting(model, 1024)


if __name__ == "__main__":
    main()
