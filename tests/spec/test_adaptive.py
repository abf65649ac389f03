"""``spec.adaptive``: confidence-scheduled verification.

Greedy outputs equal ``spec=none`` token for token (DeepSeek-V4 with a draft whose drafts
get accepted, Qwen3 batched and with continuous batching) while the scheduler really
verifies ragged prefixes; sampled outputs follow the target through the Markov loop and
the scheduler (chi-square, with a negative control); calibrated confidences are
``sigmoid(z / T)``; bad inputs are clear errors before anything is loaded."""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

import xspec
from tests.spec.test_dspark import NEW, PROMPTS, bigram_draft
from tests.spec.test_verify_stats import CHI2_CRIT_0001, assert_follows, chi_square
from xspec.errors import ConfigError
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.tiny import dspark_config, dspark_tensors
from xspec.models.draft_heads import ConfidenceHead, MarkovHead
from xspec.models.loading import write_checkpoint
from xspec.sampling import SamplingParams
from xspec.spec.adaptive.calibration import ConfidenceCalibration, save_calibration
from xspec.spec.adaptive.cost import StepCost
from xspec.spec.adaptive.scan import schedule_verify
from xspec.spec.block import sample_block
from xspec.spec.policy import FixedDepth
from xspec.spec.verify import rejection_sample

# a steep step cost: each draft per request costs 20 % of a step, so the scheduler keeps
# the likely drafts and drops the rest (ragged prefixes at the tiny drafts' confidences)
STEEP = StepCost(requests=[1, 8], drafts=[0, 5], seconds=[[1.0, 2.0], [1.0, 2.0]])
FAST = {"spec.adaptive.max_requests": 4, "spec.adaptive.profile_reps": 1}


class Recording(FixedDepth):
    """A depth policy: every request drafts its whole budget each step, then Algorithm 1
    on ``cost`` trims what each verifies (so the trim is what a test exercises; the tiny
    random drafts would otherwise rarely be worth drafting); it remembers every step's
    lengths."""

    def __init__(self, cost: StepCost) -> None:
        self.cost, self.steps = cost, []

    def trim(self, confidence: torch.Tensor, depths: list[int]) -> list[int]:
        lengths = schedule_verify(confidence.cpu(), depths, self.cost.sps(len(depths)))
        self.steps.append((list(depths), lengths))
        return lengths

    def assert_ragged(self) -> None:
        """Some drafts were dropped and some verified, and one step mixed lengths."""
        verified = sum(sum(n) for _, n in self.steps)
        offered = sum(sum(m) for m, _ in self.steps)
        assert 0 < verified < offered, (verified, offered)
        assert any(len(set(n)) > 1 for _, n in self.steps), "no step with ragged widths"


def adaptive(model: str, *, policy: FixedDepth | None = None, **overrides: Any) -> xspec.LLM:
    """An adaptive run (its step-cost profile measured or cached); ``policy``: a depth
    policy of the test's own instead of the adaptive decision."""
    return xspec.LLM(
        model=model,
        spec="dspark",
        platform="cpu",
        overrides={"spec.adaptive": True, **FAST, **overrides},
        depth_policy=policy,
    )


# -- DeepSeek-V4: a draft whose Markov head encodes the target's bigrams ---------------------


@pytest.fixture(scope="module")
def dsv4_baseline() -> list[list[int]]:
    llm = xspec.LLM(model="dsv4_tiny_random", spec="none", platform="cpu")
    return [g.token_ids for g in llm.generate(PROMPTS, NEW, ignore_eos=True)]


@pytest.fixture(scope="module")
def dsv4_draft(tmp_path_factory: pytest.TempPathFactory, dsv4_baseline: list[list[int]]) -> Path:
    nxt: dict[int, Counter] = defaultdict(Counter)
    for prompt, out in zip(PROMPTS, dsv4_baseline):
        for a, b in itertools.pairwise(prompt[-1:] + out):
            nxt[a][b] += 1
    pairs = {a: c.most_common(1)[0][0] for a, c in nxt.items()}
    return bigram_draft(tmp_path_factory.mktemp("adaptive_dspark"), pairs)


def test_dsv4_greedy_equals_baseline(dsv4_baseline: list[list[int]], dsv4_draft: Path) -> None:
    record = Recording(STEEP)
    llm = adaptive("dsv4_tiny_random", policy=record, **{"spec.draft_path": str(dsv4_draft)})
    assert llm.built.profile is not None  # built with a profile; the policy trims on STEEP
    out = llm.generate(PROMPTS, NEW, ignore_eos=True)
    assert [g.token_ids for g in out] == dsv4_baseline
    record.assert_ragged()
    rep = llm.metrics.report()
    assert rep.num_accepted_tokens > 0
    assert rep.num_committed_tokens == rep.num_accepted_tokens + rep.num_row_steps
    assert rep.num_target_rows == rep.num_draft_tokens + rep.num_row_steps
    assert rep.num_wasted_target_rows == rep.num_draft_tokens - rep.num_accepted_tokens
    assert rep.mean_target_rows < 1 + llm.built.drafter.gamma
    assert rep.predicted_acceptance_rate is not None


# -- Qwen3: the tiny preset's DSpark draft ----------------------------------------------------


def qwen_prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 37, 14, 60, 9, 23][:n]
    return [torch.randint(0, 256, (k,), generator=gen).tolist() for k in lengths]


@pytest.fixture(scope="module")
def qwen_baseline() -> list[list[int]]:
    llm = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu")
    return [g.token_ids for g in llm.generate(qwen_prompts(6), 40, ignore_eos=True)]


@pytest.mark.parametrize("concurrency", [6, 2])  # all at once; continuous batching
def test_qwen3_greedy_equals_baseline(qwen_baseline: list[list[int]], concurrency: int) -> None:
    record = Recording(STEEP)
    llm = adaptive("qwen3_tiny", policy=record)
    out = llm.generate(qwen_prompts(6), 40, ignore_eos=True, concurrency=concurrency)
    assert [g.token_ids for g in out] == qwen_baseline
    record.assert_ragged()


def test_qwen3_measured_profile_then_cached(qwen_baseline: list[list[int]]) -> None:
    """Without a swapped cost: the build measures (or reuses the cached) profile, the
    scheduler runs on it, the output is the baseline's; a second build reads the cache."""
    first = adaptive("qwen3_tiny")
    out = first.generate(qwen_prompts(6), 40, ignore_eos=True)
    assert [g.token_ids for g in out] == qwen_baseline
    second = adaptive("qwen3_tiny")
    assert second.built.profile is not None
    assert second.built.profile.source.startswith("cached, loaded from")
    cost = second.built.profile.cost
    assert cost == first.built.profile.cost  # type: ignore[union-attr]
    assert cost.requests == [1, 2, 4] and cost.drafts == [0, 1, 2, 4]  # max_requests 4, gamma 4
    assert cost.draft_seconds is not None and all(d > 0 for d in cost.draft_seconds)
    assert all(a <= b for row in cost.seconds for a, b in itertools.pairwise(row))


def test_calibrated_confidences_are_scaled_logits(tmp_path: Path) -> None:
    """With a calibration file the proposal's confidence is sigmoid(z / T_k), raw
    otherwise; the metrics and the plan say which."""
    from xspec.run.report import adaptive_summary

    temps = [0.5, 2.0, 3.0, 4.0]
    path = tmp_path / "cal.json"
    save_calibration(ConfidenceCalibration(temperatures=temps), path)
    raw = adaptive("qwen3_tiny", policy=FixedDepth(), **{"spec.adaptive.calibration": "off"})
    cal = adaptive("qwen3_tiny", policy=FixedDepth(), **{"spec.adaptive.calibration": str(path)})
    assert "UNCALIBRATED" in adaptive_summary(raw.built)
    assert str(path) in adaptive_summary(cal.built)
    confidences = []
    for llm in (raw, cal):
        seen: list[torch.Tensor] = []
        drafter = llm.built.drafter
        propose = drafter.propose

        def spy(*args: Any, propose: Any = propose, seen: list = seen) -> Any:
            out = propose(*args)
            seen.append(out.confidence)
            return out

        drafter.propose = spy  # type: ignore[method-assign]
        llm.generate(qwen_prompts(1), 16, ignore_eos=True)
        confidences.append(seen[0])
    z = torch.logit(confidences[0].double())
    want = torch.sigmoid(z / torch.tensor(temps, dtype=torch.float64))
    torch.testing.assert_close(confidences[1].double(), want, rtol=1e-4, atol=1e-6)


# -- sampling: the target distribution through the Markov loop and the scheduler -------------


def test_sampled_outputs_follow_the_target_through_the_scheduler() -> None:
    """Fixed target distributions p_0, p_1 (history-independent), a Markov-biased draft and
    a confidence head reading W1[prev] (so whether d_2 is verified depends on d_1), steps
    of 6 requests scheduled by Algorithm 1 on a steep cost: the first and second committed
    tokens follow p_0 and p_1 (chi-square). The negative control schedules on the draft
    token it decides about (verify d_1 only when it is one given token): it must fail."""
    gen = torch.Generator().manual_seed(5)
    vocab, g, n, group = 6, 3, 30_000, 6
    markov = MarkovHead(vocab, 2, dtype=torch.float32, device="cpu")
    head = ConfidenceHead(4, 2, bias=True, dtype=torch.float32, device="cpu")
    for w in (markov.markov_w1.weight, markov.markov_w2.weight, head.proj.weight):
        torch.nn.init.normal_(w, std=1.5, generator=gen)
    base = torch.randn(1, g, vocab, generator=gen).expand(n, -1, -1)
    hidden = torch.randn(1, g, 4, generator=gen).expand(n, -1, -1)
    p = torch.softmax(torch.randn(g + 1, vocab, generator=gen), -1)  # [g+1, V]
    shared = torch.Generator().manual_seed(6)
    params = [SamplingParams(temperature=1.0)] * n
    drafts, q, prev = sample_block(
        base, torch.zeros(n, dtype=torch.long), markov, params, [shared] * n
    )
    conf = head(hidden, markov.embed(prev))  # [n, g], depends on the drafts before each
    lengths: list[int] = []
    for lo in range(0, n, group):
        lengths += schedule_verify(conf[lo : lo + group], [g] * group, STEEP.sps(group))
    assert 0 < sum(lengths) < g * n and len(set(lengths)) > 2  # ragged prefixes
    out = rejection_sample(p.expand(n, -1, -1), drafts, q, [shared] * n, lengths).output_tokens
    assert_follows(out[:, 0], p[0], "first committed token")
    second = out[:, 1][out[:, 1] >= 0]
    assert second.numel() > n / 10
    assert_follows(second, p[1], "second committed token")

    # negative control: a schedule that reads the draft it decides about is biased
    t = int((q[0, 0] - p[0]).argmax())  # a token the draft over-proposes
    cheat = (drafts[:, 0] == t).long().tolist()
    bad = rejection_sample(p.expand(n, -1, -1), drafts, q, [shared] * n, cheat).output_tokens
    stat, dof = chi_square(bad[:, 0], p[0])
    assert stat > CHI2_CRIT_0001[dof - 1], f"negative control passed: chi2={stat:.1f}"


# -- bad input --------------------------------------------------------------------------------


def test_adaptive_without_a_confidence_head_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs a drafter with a confidence head.*spec=mtp"):
        xspec.LLM(
            model="dsv4_tiny_random", spec="mtp", platform="cpu", overrides={"spec.adaptive": True}
        )
    with pytest.raises(ConfigError, match=r"spec=dflash draft in .* has none"):
        xspec.LLM(
            model="qwen3_tiny", spec="dflash", platform="cpu", overrides={"spec.adaptive": True}
        )
    config = dspark_config(DeepseekV4Args.tiny())
    tensors = dspark_tensors(config, 3)
    del tensors["mtp.2.confidence_head.proj.weight"]
    write_checkpoint(tmp_path, tensors, config)
    with pytest.raises(ConfigError, match=r"spec=dspark draft in .* has none"):
        adaptive("dsv4_tiny_random", **{"spec.draft_path": str(tmp_path)})


def test_profile_for_another_model_is_refused(tmp_path: Path) -> None:
    llm = adaptive("qwen3_tiny")
    assert llm.built.profile is not None and llm.built.profile.path is not None
    with pytest.raises(
        ConfigError, match=r"measured for another setup \(checkpoint: file 'preset:tiny'"
    ):
        adaptive("qwen3_moe_tiny", **{"spec.adaptive.profile": str(llm.built.profile.path)})
    body = json.loads(llm.built.profile.path.read_text())
    body["key"]["platform"] = "cuda"
    (tmp_path / "p.json").write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=r"platform: file 'cuda', this run 'cpu'"):
        adaptive("qwen3_tiny", **{"spec.adaptive.profile": str(tmp_path / "p.json")})
    loaded = adaptive("qwen3_tiny", **{"spec.adaptive.profile": str(llm.built.profile.path)})
    assert loaded.built.profile is not None and loaded.built.profile.source.startswith("loaded")


def test_calibration_with_the_wrong_number_of_positions(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    save_calibration(ConfidenceCalibration(temperatures=[1.0, 1.0]), path)
    with pytest.raises(ConfigError, match=r"has 2 temperatures .* this run drafts 4 positions"):
        adaptive("qwen3_tiny", **{"spec.adaptive.calibration": str(path)})


def test_cli_shorthand_results_and_bad_input_exit_code(tmp_path: Path, xspec_cache: Path) -> None:
    """``spec.adaptive=true`` on the command line; results.json carries the adaptive
    figures; a bad input exits 2 with the message, before anything runs."""
    from tests.test_cli import run_cli

    common = ["model=qwen3_tiny", "spec=dspark", "spec.adaptive=true"]
    common += [
        "spec.adaptive.max_requests=4",
        "spec.adaptive.profile_reps=1",
        "workload.max_new_tokens=12",
    ]
    r = run_cli(*common, f"hydra.run.dir={tmp_path}", cache=xspec_cache)
    assert r.returncode == 0, r.stderr
    assert "step-cost profile" in r.stdout and "target rows per request-step" in r.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["adaptive"]["calibrated"] is False and res["mean_target_rows_per_step"] >= 1.0
    assert "num_wasted_target_rows" in res["spec_decode"]
    # the decision's figures: depth histogram, steps without drafts, predicted vs measured
    # step time (printed and in results.json)
    assert "speculation depth (request-steps)" in r.stdout and "steps without drafts" in r.stdout
    assert "step-cost model:" in r.stdout and "predicted" in r.stdout
    step_time = res["adaptive"]["step_time"]
    assert step_time["steps"] > 0 and step_time["measured_ms_mean"] > 0
    assert step_time["predicted_ms_mean"] > 0
    spec = res["spec_decode"]
    assert sum(spec["depth_histogram"]) == spec["num_row_steps"]
    assert res["acceptance"]["steps_without_drafts"] == spec["num_steps_without_drafts"]
    bad = run_cli("model=dsv4_tiny_random", "spec=mtp", "spec.adaptive=true", cache=xspec_cache)
    assert bad.returncode == 2 and "needs a drafter with a confidence head" in bad.stderr


def test_a_full_disk_keeps_the_previous_step_cost_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profile is written to a temp file beside it, fsynced and renamed: a full disk
    leaves the previous profile byte-identical (and still readable), no temp file behind."""
    import errno

    from xspec.errors import OutputError
    from xspec.spec.adaptive.profile import read_profile, save_profile

    path, key = tmp_path / "profile.json", {"gamma": 5}
    save_profile(path, key, STEEP, 1.0, 3)
    before = path.read_bytes()

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    faster = StepCost(requests=[1], drafts=[0], seconds=[[0.5]])
    with pytest.raises(OutputError, match=r"profile.json: No space left on device"):
        save_profile(path, key, faster, 1.0, 3)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]
    assert read_profile(path, key) == STEEP


def test_a_calibration_applied_at_another_temperature_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A greedy fit: greedy requests are silent; requests at T = 0.8 get one warning naming
    the file and both regimes, however many steps they take."""
    import logging

    path = tmp_path / "cal.json"
    fitted = ConfidenceCalibration(temperatures=[1.0] * 4, sampling_temperature=0.0)
    save_calibration(fitted, path)
    llm = adaptive("qwen3_tiny", **{"spec.adaptive.calibration": str(path)})
    with caplog.at_level(logging.WARNING, logger="xspec.spec.adaptive.calibration"):
        llm.generate(qwen_prompts(2), 12, ignore_eos=True)
        assert caplog.records == []
        llm.generate(qwen_prompts(2), 12, ignore_eos=True, temperature=0.8, seed=0)
        llm.generate(qwen_prompts(2), 12, ignore_eos=True, temperature=0.8, seed=1)
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert str(path) in msg and "greedy" in msg and "temperature 0.8" in msg
