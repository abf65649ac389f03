"""The depth policy: the one object the speculative step asks how many tokens each
sequence drafts and verifies (``xspec/spec/policy.py``), and the step's shape."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Sequence

import pytest
import torch

import xspec
from xspec.engine.engine import Engine
from xspec.spec import step
from xspec.spec.policy import DepthPolicy, FixedDepth, PolicySeq


class Log(FixedDepth):
    """Fixed gamma, writing down what the step asked of it, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []
        self.states: list[object] = []

    def decide(self, seqs: Sequence[PolicySeq], caps: list[int]) -> list[int]:
        for s in seqs:  # the per-request slot the policy owns: kept across steps
            if s.depth_state is None:
                s.depth_state = object()
                self.states.append(s.depth_state)
        self.calls.append(("decide", list(caps)))
        return super().decide(seqs, caps)

    def trim(self, confidence: torch.Tensor, depths: list[int]) -> list[int]:
        self.calls.append(("trim", list(depths)))
        return [min(d, 1) for d in depths]  # verify one draft at most

    def observe(self, seqs: Sequence[PolicySeq], verified: list[int], accepted: list[int]) -> None:
        assert all(s.depth_state in self.states for s in seqs)
        self.calls.append(("observe", list(verified)))


def test_the_step_asks_one_policy_before_and_after_drafting_and_after_the_step() -> None:
    """``xspec.LLM(depth_policy=...)``: each decode step asks it ``decide`` (the caps:
    gamma within the request's budget), ``trim`` (the drafter scored its drafts) and
    ``observe`` (what was verified: the trim's answer), in that order."""
    log = Log()
    llm = xspec.LLM(model="qwen3_tiny", spec="dspark", platform="cpu", depth_policy=log)
    assert llm.engine.policy is log
    gamma = llm.built.drafter.gamma
    out = llm.generate([[5, 17, 42]], max_new_tokens=4, ignore_eos=True)[0]
    assert len(out.token_ids) == 4
    names = [name for name, _ in log.calls]
    assert names[:3] == ["decide", "trim", "observe"]
    assert names.count("decide") == names.count("observe") == out.num_steps
    decided = [caps for name, caps in log.calls if name == "decide"]
    assert decided[0] == [min(gamma, 3 - 1)]  # 3 tokens left after prefill
    verified = [n for name, n in log.calls if name == "observe"]
    assert all(n[0] <= 1 for n in verified)
    assert llm.metrics.report().num_draft_tokens == sum(n[0] for n in verified)
    assert len(log.states) == 1


def test_fixed_depth_drafts_every_sequence_a_varying_policy_only_those_given_a_depth() -> None:
    class Half(DepthPolicy):
        def decide(self, seqs: Sequence[PolicySeq], caps: list[int]) -> list[int]:
            return [c if b % 2 else 0 for b, c in enumerate(caps)]

    assert FixedDepth().decide([], [3, 0, 2]) == [3, 0, 2]
    assert FixedDepth().drafting([3, 0, 2]) == [0, 1, 2]  # the draft batch is the batch
    assert Half().drafting(Half().decide([], [3, 3, 3, 0])) == [1]
    assert Half().trim(torch.ones(4, 3), [0, 3, 0, 0]) == [0, 3, 0, 0]
    assert Half().predicted(None) is None and Half().summary() is None


def test_only_a_lockstep_safe_policy_runs_under_expert_parallelism() -> None:
    """Every rank drafts the iteration's agreed width (lockstep): the engine refuses a
    policy whose depths are not the caps."""

    class Plain(DepthPolicy):
        def decide(self, seqs: Sequence[PolicySeq], caps: list[int]) -> list[int]:
            return [0] * len(caps)

    llm = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu")
    b = llm.built
    lockstep = object()  # never used: the check comes first
    with pytest.raises(ValueError, match="Plain cannot run under expert parallelism"):
        Engine(b.target, b.drafter, [], stop_ids=frozenset(), lockstep=lockstep, policy=Plain())  # type: ignore[arg-type]
    assert FixedDepth.lockstep_safe and not Plain.lockstep_safe


def _lines(fn: object) -> int:
    node = ast.parse(inspect.getsource(fn).lstrip()).body[0]  # type: ignore[arg-type]
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def test_decode_step_reads_as_short_phases() -> None:
    """``decode_step`` and every function of the step module it calls directly fit on a
    screen (60 lines), and it takes one policy: no schedule, no speculation argument."""
    tree = ast.parse(inspect.getsource(step.decode_step))
    called = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and hasattr(step, n.func.id)
    }
    assert {"_draft_step", "_verify", "_commit", "_observe"} <= called
    for name in ["decode_step", *sorted(called)]:
        fn = getattr(step, name)
        if inspect.isfunction(fn):
            assert _lines(fn) <= 60, f"{name}: {_lines(fn)} lines"
    params = inspect.signature(step.decode_step).parameters
    assert "policy" in params and not {"schedule", "speculation"} & set(params)
