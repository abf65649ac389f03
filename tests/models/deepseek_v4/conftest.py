"""Shared fixtures for the DeepSeek-V4 model tests: configs, seeded models, helpers.

Helpers reach the tests through the ``dsv4`` fixture (a namespace) rather than
``import conftest``, which would be ambiguous with other conftest modules.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch

from xspec.models.base import ForwardBatch, ModelOutput
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.model import DeepseekV4Model
from xspec.models.deepseek_v4.state import DeepseekV4State
from xspec.models.ops import EAGER_STEPS, ModelOps, StepOptions
from xspec.platforms import native
from xspec.platforms.compile import StepCompiler


def variant_args() -> DeepseekV4Args:
    """A second shape: other hc_mult / heads / groups / top-k, layer order, hash count,
    an active SwiGLU clamp and a different YaRN."""
    return dataclasses.replace(
        DeepseekV4Args.tiny(),
        vocab_size=300,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=48,
        qk_rope_head_dim=8,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        compress_ratios=[4, 128, 0, 4, 0],
        index_n_heads=6,
        index_head_dim=16,
        index_topk=16,
        n_routed_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        routed_scaling_factor=2.5,
        swiglu_limit=1.0,
        num_hash_layers=1,
        hc_mult=2,
        hc_sinkhorn_iters=10,
        rope_scaling={
            "type": "yarn",
            "factor": 8,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=2048,
    )


CONFIGS = {"tiny": DeepseekV4Args.tiny, "variant": variant_args}


@functools.lru_cache(maxsize=16)
def seeded_model(
    config: str, seed: int, max_rollback: int = 8, steps: StepOptions = EAGER_STEPS
) -> DeepseekV4Model:
    """A random fp32 CPU model built with ``steps`` (the platform's ops and compiler;
    cached: tests must not modify its weights)."""
    model = DeepseekV4Model(CONFIGS[config](), max_rollback=max_rollback, steps=steps)
    model.init_random_(seed)
    return model.eval()


def token_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    """``[n]`` int64 random token ids."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def run(model: DeepseekV4Model, ids: torch.Tensor, state: DeepseekV4State, **kw) -> ModelOutput:
    """One sequence, one forward of all ``ids [n]``."""
    return model(ForwardBatch(ids, [ids.shape[0]], [state], **kw))


def run_chunks(
    model: DeepseekV4Model,
    ids: torch.Tensor,
    chunks: list[int],
    state: DeepseekV4State | None = None,
) -> torch.Tensor:
    """Feed ``ids`` in consecutive chunks; returns the logits of every row ``[sum, V]``."""
    state = state if state is not None else model.new_state()
    out, pos = [], 0
    for c in chunks:
        out.append(run(model, ids[pos : pos + c], state).logits)
        pos += c
    return torch.cat(out)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="session")
def dsv4() -> SimpleNamespace:
    """Helpers: ``model(config, seed)``, ``ids(n, vocab, seed)``, ``run``, ``run_chunks``,
    ``max_diff``, ``configs``."""
    return SimpleNamespace(
        model=seeded_model,
        ids=token_ids,
        run=run,
        run_chunks=run_chunks,
        max_diff=max_diff,
        configs=CONFIGS,
    )


STEP_MODES = ["reference", "native", pytest.param("compiled", marks=pytest.mark.slow)]


@functools.cache
def step_options(mode: str) -> StepOptions | str:
    """How a test runs the models' stateless steps: the reference torch ops, the CPU
    platform's native fused kernels, or compiled (inductor); one object per mode, so
    the seeded models built with it are cached. A string: why the mode cannot run."""
    if mode == "reference":
        return EAGER_STEPS
    if mode == "native":
        kernels, why = native.load()
        return why if kernels is None else StepOptions(ops=kernels.ops())
    ops = ModelOps(grouped_mm_dtypes=frozenset({"float32"}))
    return StepOptions(ops=ops, compile=StepCompiler("inductor"))


@pytest.fixture(params=STEP_MODES)
def steps(request) -> StepOptions:
    """The :class:`StepOptions` of this test's mode (param ``reference | native |
    compiled``): build the models with it (``dsv4.model(config, seed, steps=steps)``)."""
    options = step_options(request.param)
    if isinstance(options, str):
        pytest.skip(options)
    return options
