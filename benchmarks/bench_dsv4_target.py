"""DeepSeek-V4 target benchmarks on the dsv4_tiny preset (CPU; ratios measured side by side).

    python benchmarks/bench_dsv4_target.py [--quick]

1. Decode step time at context 4096 vs 256 (compressed attention keeps it near flat;
   target ratio <= 1.5).
2. Batched greedy decode throughput: xspec vs transformers' own ``generate`` on the same
   checkpoint and prompts (target xspec >= 2x).
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
    llm: xspec.LLM, batch: int, prompt_len: int, new_tokens: int, reps: int
) -> None:
    from transformers import DeepseekV4ForCausalLM

    path = llm._built.target.checkpoint_dir  # the same official-layout directory
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, llm._built.target.vocab_size, (batch, prompt_len), generator=gen)

    def run_xspec() -> None:
        llm.generate(prompts.tolist(), max_new_tokens=new_tokens, ignore_eos=True)

    def run_hf() -> None:
        with torch.no_grad():
            hf.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )

    med = interleaved({"xspec": run_xspec, "transformers": run_hf}, reps)
    tokens = batch * new_tokens
    print(
        f"[2] batched greedy decode, batch {batch}, prompt {prompt_len}, {new_tokens} new tokens: "
        f"xspec {tokens / med['xspec']:.1f} tok/s, transformers {tokens / med['transformers']:.1f} tok/s"
    )
    print(
        f"    ratio xspec/transformers = {med['transformers'] / med['xspec']:.2f}x  (target >= 2x)"
    )


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
    a = ap.parse_args()
    torch.set_num_threads(1)
    llm = xspec.LLM(
        model="dsv4_tiny", spec="none", platform="cpu", overrides={"model.max_context": 8192}
    )
    model = llm._built.target
    reps = 5 if a.quick else 15
    decode_step_ratio(model, reps * 2, (256, 4096))
    # a shared CPU is noisy: several interleaved repetitions, the median reported
    throughput_vs_hf(
        llm, batch=8, prompt_len=64, new_tokens=16 if a.quick else 32, reps=5 if a.quick else 9
    )
    kv_accounting(model, 1024)


if __name__ == "__main__":
    main()
