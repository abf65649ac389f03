"""The speculative step itself: its result, the request budget, device discipline."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import xspec
from tests.spec.simdevice import DEVICE, SimModule, SimTarget, SimulatedDevice
from xspec.config import ModelConfig, PlatformConfig, SpecConfig
from xspec.engine.engine import Engine, Request
from xspec.metrics import SpecDecodeMetrics
from xspec.models.base import EAGER_STEPS
from xspec.models.deepseek_v4 import load_model as load_dsv4
from xspec.models.qwen3 import load_model as load_qwen3
from xspec.platforms.cpu import CpuPlatform
from xspec.sampling import SamplingParams, make_generator
from xspec.spec.baseline import NoDrafter
from xspec.spec.mtp import MtpDrafter
from xspec.spec.step import RunningSeq, StepResult, decode_step, prefill
from xspec.spec.testing import OracleDrafter

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100)), [300, 7]]


@pytest.fixture(scope="module")
def oracle() -> xspec.LLM:
    return xspec.LLM(
        model="qwen3_tiny",
        spec="oracle",
        platform="cpu",
        overrides={"spec.num_speculative_tokens": 3},
    )


@pytest.mark.parametrize(("max_new", "drafts"), [(2, 0), (3, 1), (5, 3), (6, 3), (7, 3 + 1)])
def test_drafts_never_exceed_the_budget(oracle: xspec.LLM, max_new: int, drafts: int) -> None:
    """gamma 3; the first token comes from prefill. A request with r tokens left verifies
    at most r - 1 drafts, so the oracle's step never commits past max_new_tokens and the
    metrics count only the drafts that were verified (all accepted)."""
    before = oracle.metrics.report()
    out = oracle.generate([PROMPTS[0]], max_new_tokens=max_new, ignore_eos=True)[0]
    rep = oracle.metrics.report()
    assert len(out.token_ids) == max_new
    assert rep.num_draft_tokens - before.num_draft_tokens == drafts
    assert rep.num_accepted_tokens - before.num_accepted_tokens == drafts
    assert rep.num_committed_tokens - before.num_committed_tokens == max_new - 1


def test_batch_block_width_follows_the_neediest_request(oracle: xspec.LLM) -> None:
    """Two requests with 2 and 4 tokens left after prefill: one step, 1 draft for the
    first and 3 for the second, each finishing exactly at its budget."""
    engine = oracle._built.engine
    engine.metrics = SpecDecodeMetrics()
    reqs = [Request(PROMPTS[0], 3, SamplingParams()), Request(PROMPTS[1], 5, SamplingParams())]
    gens = engine.run(reqs, concurrency=2)
    assert [len(g.token_ids) for g in gens] == [3, 5]
    rep = engine.metrics.report()
    assert (rep.num_steps, rep.num_draft_tokens, rep.num_committed_tokens) == (1, 1 + 3, 2 + 4)


def test_step_returns_what_it_committed(oracle: xspec.LLM) -> None:
    built = oracle._built
    target, drafter = built.target, built.drafter
    seqs = [
        RunningSeq(
            list(p), target.new_state(), drafter.new_state(), SamplingParams(), None, len(p) + n
        )
        for p, n in zip(PROMPTS, (2, 4, 9))
    ]
    first = prefill(target, drafter, seqs, [], 2048)
    assert isinstance(first, StepResult) and [len(t) for t in first.new_tokens] == [1, 1, 1]
    step = decode_step(target, drafter, seqs, [], SpecDecodeMetrics())
    assert step.num_drafts == [0, 2, 3]  # 1, 3 and 8 tokens left; gamma 3
    assert step.num_accepted == step.num_drafts  # the oracle
    assert [len(t) for t in step.new_tokens] == [1, 3, 4]
    for s, p, f, new in zip(seqs, PROMPTS, first.new_tokens, step.new_tokens):
        assert s.token_ids == p + f + new
    assert [s.remaining for s in seqs] == [0, 0, 4]


def test_engine_never_exceeds_max_new_tokens(oracle: xspec.LLM) -> None:
    """Even a step result longer than the budget is cut at max_new_tokens."""
    built = oracle._built
    engine = Engine(built.target, built.drafter, [], stop_ids=frozenset())
    gen = engine.add(0, Request([1], 2, SamplingParams()))
    assert engine._take(0, [7, 8, 9], None, gen, 1.0)
    assert gen.token_ids == [7, 8]


# -- device discipline ---------------------------------------------------------------------


def _run(target: Any, drafter: Any, params: SamplingParams) -> list[list[int]]:
    """Prefill + decode steps until every prompt has 7 new tokens (batch shrinking)."""
    seqs = [
        RunningSeq(
            list(p),
            target.new_state(),
            drafter.new_state(),
            params,
            make_generator(params),
            len(p) + 7,
        )
        for p in PROMPTS
    ]
    prefill(target, drafter, seqs, [], 16)
    while live := [s for s in seqs if s.remaining]:
        decode_step(target, drafter, live, [], SpecDecodeMetrics())
    return [s.token_ids for s in seqs]


class Recorder:
    """Wraps prefill / decode_step calls to record the host reads each one made."""

    def __init__(self, mode: SimulatedDevice, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mode, self.calls = mode, []  # type: ignore[var-annotated]
        for name in ("prefill", "decode_step"):
            monkeypatch.setitem(globals(), name, self._wrap(name, globals()[name]))

    def _wrap(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            before = len(self.mode.syncs)
            out = fn(*args, **kwargs)
            assert not self.mode.mixed, f"{name}: {self.mode.mixed}"
            self.calls.append((name, self.mode.syncs[before:]))
            return out

        return call

    def check_one_read_per_call(self) -> None:
        assert {name for name, _ in self.calls} == {"prefill", "decode_step"}
        for name, syncs in self.calls:  # prefill: the first tokens; a step: the output matrix
            assert syncs == (["tolist"] if name == "prefill" else ["cpu"]), (name, syncs)


@pytest.mark.parametrize("method", ["none", "oracle"])
def test_step_keeps_everything_on_the_target_device(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a simulated accelerator (see simdevice.py) the step hands the target device
    tensors only, mixes no host tensor into a device op, and reads the device back once
    per call (the committed tokens). Same tokens as on the host."""
    qwen = load_qwen3(
        ModelConfig(arch="qwen3", preset="tiny"), device=torch.device("cpu"), max_rollback=8
    )
    spec = SpecConfig(method=method, num_speculative_tokens=3 if method == "oracle" else None)
    make: Any = OracleDrafter if method == "oracle" else NoDrafter
    kw = dict(model_cfg=ModelConfig(arch="qwen3", preset="tiny"), platform=None, steps=EAGER_STEPS)
    want = _run(qwen, make(spec, target=qwen, **kw), SamplingParams())
    mode = SimulatedDevice()
    recorder = Recorder(mode, monkeypatch)
    with mode:
        target = SimTarget(qwen, mode)
        assert target.device == DEVICE
        got = _run(target, make(spec, target=target, **kw), SamplingParams())
    assert got == want
    recorder.check_one_read_per_call()


def test_mtp_drafts_on_the_target_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """MTP on dsv4_tiny_random, greedy and sampled: drafts and their q stay on the device."""
    cfg = ModelConfig(arch="deepseek_v4", preset="tiny_random")
    dsv4 = load_dsv4(cfg, device=torch.device("cpu"), max_rollback=8)
    spec = SpecConfig(method="mtp", num_speculative_tokens=2)
    platform = CpuPlatform(PlatformConfig(name="cpu"))
    want = _run(
        dsv4,
        MtpDrafter(spec, target=dsv4, model_cfg=cfg, platform=platform, steps=EAGER_STEPS),
        SamplingParams(),
    )
    mode = SimulatedDevice()
    recorder = Recorder(mode, monkeypatch)
    with mode:
        target = SimTarget(dsv4, mode)
        drafter: Any = MtpDrafter(
            spec, target=dsv4, model_cfg=cfg, platform=platform, steps=EAGER_STEPS
        )
        drafter.target = target
        drafter.module = SimModule(drafter.module, mode, ("draft_hidden", "draft_logits"))
        assert _run(target, drafter, SamplingParams()) == want
        _run(target, drafter, SamplingParams(temperature=0.8, top_k=20, seed=3))
    recorder.check_one_read_per_call()
