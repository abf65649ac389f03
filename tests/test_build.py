"""build.check: every problem of a run, found before any weight is loaded; the CLI runs
it on every job of a sweep before the first job starts."""

from __future__ import annotations

import pytest

from xspec import registry
from xspec.__main__ import _override_sets, check_jobs
from xspec.build import check, resolve_gamma
from xspec.compose import compose_run
from xspec.errors import ConfigError
from xspec.platforms.base import Capabilities
from xspec.platforms.cpu import CpuPlatform
from xspec.spec.baseline import NoDrafter
from xspec.spec.drafter import Drafter
from xspec.spec.dspark import DSparkDrafter
from xspec.spec.mtp import MtpDrafter
from xspec.spec.testing import OracleDrafter


class TwoDraftPlatform(CpuPlatform):
    """The host CPU with a kernel limit of 2 draft tokens per step."""

    name = "two_drafts"

    def _build_capabilities(self) -> Capabilities:
        return Capabilities(max_speculative_tokens=2)


@pytest.fixture
def two_drafts(monkeypatch: pytest.MonkeyPatch) -> str:
    """An in-process platform entry (module:attr of this file), removed afterwards."""
    entry = registry.Entry("two_drafts", f"{__name__}:TwoDraftPlatform", "test", origin="built-in")
    monkeypatch.setitem(registry.platforms._builtins, "two_drafts", entry)
    return "two_drafts"


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("check() loaded weights")

    monkeypatch.setattr("xspec.models.loading.load_params", refuse)
    monkeypatch.setattr("xspec.models.deepseek_v4.weights.load_checkpoint", refuse)


@pytest.mark.usefixtures("no_weights")
def test_good_runs_have_no_problems() -> None:
    for overrides in (["model=qwen3_tiny", "spec=none"], ["model=dsv4_tiny_random", "spec=mtp"]):
        assert check(compose_run([*overrides, "platform=cpu"])) == [], overrides


def test_gamma_is_resolved_from_what_each_drafter_states() -> None:
    """One function resolves a run's gamma: the configured value, else the drafter's
    default (its DraftDepth), checked against its maximum, the platform's and the gamma
    schedule; a depth other than the trained one warns."""
    cfg = compose_run(["model=dsv4_tiny_random", "spec=oracle", "spec.num_speculative_tokens=null"])
    cpu = CpuPlatform(cfg.platform)
    assert resolve_gamma(cfg, OracleDrafter).value == 3
    assert resolve_gamma(cfg, MtpDrafter) == resolve_gamma(cfg, MtpDrafter, cpu)
    assert resolve_gamma(cfg, MtpDrafter).value == 1 and resolve_gamma(cfg, Drafter).value == 1
    dspark = compose_run(["model=dsv4_tiny_random", "spec=dspark"])
    assert resolve_gamma(dspark, DSparkDrafter).value == 5  # the draft's trained block size
    assert resolve_gamma(cfg, NoDrafter).value == 0
    cfg.spec.num_speculative_tokens = 5
    mtp = resolve_gamma(cfg, MtpDrafter)
    assert mtp.value == 5 and mtp.problems == []
    assert mtp.warning is not None and "trained to draft 1 per step" in mtp.warning
    assert mtp.spec(cfg.spec).num_speculative_tokens == 5 and cfg.spec.num_speculative_tokens == 5
    dspark.spec.num_speculative_tokens = 5
    assert resolve_gamma(dspark, DSparkDrafter).warning is None
    none = compose_run(["model=dsv4_tiny_random", "spec=none", "spec.num_speculative_tokens=5"])
    assert resolve_gamma(none, NoDrafter).value == 0
    assert "has no effect with spec=none" in resolve_gamma(none, NoDrafter).problems[0]
    cfg.spec.num_speculative_tokens = 17
    [over] = resolve_gamma(cfg, MtpDrafter).problems
    assert "drafts between 1 and 16 tokens per step (1 = the trained setting)" in over
    assert "limit of 16" in resolve_gamma(cfg, Drafter, cpu).problems[0]
    cfg.spec.num_speculative_tokens = 0
    assert resolve_gamma(cfg, Drafter).problems == [
        "spec.num_speculative_tokens must be >= 1 (got 0)"
    ]
    cfg.spec.num_speculative_tokens = None
    cfg.spec.gamma_schedule = [[1, 4], [8, 2]]
    [schedule] = resolve_gamma(cfg, OracleDrafter).problems  # the default 3: not 4
    assert "an entry's gamma exceeds spec.num_speculative_tokens=3" in schedule


@pytest.mark.usefixtures("no_weights")
def test_platform_limit_checked_at_the_drafters_real_gamma(two_drafts: str) -> None:
    """The oracle drafts 3 by default: a platform limited to 2 refuses it up front, even
    with spec.num_speculative_tokens left null (previously checked as 1)."""
    cfg = compose_run(["model=qwen3_tiny", "spec=oracle", "spec.num_speculative_tokens=null"])
    cfg.platform.name = two_drafts
    problems = check(cfg)
    assert any("spec.num_speculative_tokens=3" in p and "limit of 2" in p for p in problems)
    cfg.spec.method = "mtp"  # MTP's default gamma 1 fits
    cfg.model = compose_run(["model=dsv4_tiny_random"]).model
    assert check(cfg) == []


@pytest.mark.usefixtures("no_weights")
def test_target_checkpoint_checked_from_headers(tmp_path: object) -> None:
    cfg = compose_run(["model=qwen3", "model.path=/does/not/exist", "spec=none"])
    problems = check(cfg)
    assert len(problems) == 1 and "/does/not/exist" in problems[0]


@pytest.mark.usefixtures("no_weights")
def test_every_job_of_a_sweep_is_checked_first() -> None:
    """One message lists the problems of every failing job; the good job is not named."""
    sets = _override_sets(
        ["-m", "spec=none,mtp,oracle", "model=qwen3_tiny", "spec.num_speculative_tokens=17"]
    )
    with pytest.raises(ConfigError) as e:
        check_jobs(sets)
    msg = str(e.value)
    assert "3 of 3 jobs cannot run (no job was started)" in msg
    assert "job spec=mtp model=qwen3_tiny spec.num_speculative_tokens=17:" in msg
    assert "needs a DeepSeek-V4 target" in msg and "limit of 16" in msg
    assert "has no effect with spec=none" in msg
    check_jobs(_override_sets(["-m", "spec=none,oracle", "model=qwen3_tiny"]))  # all fine


def _built_for(workload: object) -> object:
    """Just what plan_summary reads: the workload, a byte tokenizer, a memory plan."""
    from types import SimpleNamespace

    from xspec.engine.memory import MemoryPlan
    from xspec.models.base import KvBytes
    from xspec.tokenizer import ByteTokenizer

    plan = MemoryPlan(
        budget=2**30, weights=0, target=KvBytes(0, 100.0), draft=KvBytes(), workspace=0,
        gamma=2, max_context=4096,
    )  # fmt: skip
    return SimpleNamespace(
        cfg=SimpleNamespace(workload=workload),
        tokenizer=ByteTokenizer(300, None, [1]),
        engine=SimpleNamespace(plan=plan, prefix_cache=None),
        parallel=SimpleNamespace(topology=SimpleNamespace(world=1)),
        expert_bytes=None,
        profile=None,
    )


def test_plan_summary_uses_the_real_workload(tmp_path: object) -> None:
    """Synthetic lengths, a prompts file's longest request (its own budget included), text
    prompts: the plan's per-sequence line is the workload's longest request."""
    import json
    from pathlib import Path

    from xspec.config import WorkloadConfig, WorkloadKind
    from xspec.run.report import plan_summary

    synthetic = WorkloadConfig(kind=WorkloadKind.synthetic, input_len=300, output_len=20)
    assert "workload: 300 prompt + 20 new + 2 draft = 322 tokens" in plan_summary(
        _built_for(synthetic)  # type: ignore[arg-type]
    )
    file = Path(str(tmp_path)) / "p.jsonl"
    lines = [{"prompt": "hello"}, {"prompt_token_ids": [5] * 50, "max_new_tokens": 7}]
    file.write_text("".join(json.dumps(x) + "\n" for x in lines))
    from_file = WorkloadConfig(prompts_file=str(file), max_new_tokens=16)
    assert "workload: 50 prompt + 7 new + 2 draft = 59 tokens" in plan_summary(
        _built_for(from_file)  # type: ignore[arg-type]
    )
    text = WorkloadConfig(prompts=["abc", "a" * 12], max_new_tokens=16)
    assert "workload: 12 prompt + 16 new" in plan_summary(_built_for(text))  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_weights")
def test_context_fit_reads_the_checkpoint_before_loading() -> None:
    """The limit (config.json's max_position_embeddings, or model.max_context), the
    drafter's gamma and the tokenizer, with no weight loaded."""
    from xspec.run.fit import context_fit

    fit = context_fit(compose_run(["model=qwen3_tiny", "spec=oracle", "platform=cpu"]))
    assert fit is not None and (fit.max_context, fit.gamma) == (2048, 3)
    assert fit.encode is not None and len(fit.encode("hello")) == 5  # byte tokenizer
    assert "max_position_embeddings" in fit.source and fit.raise_to is None
    fit = context_fit(compose_run(["model=qwen3_tiny", "spec=none", "model.max_context=64"]))
    assert fit is not None and (fit.max_context, fit.gamma, fit.raise_to) == (64, 0, 2048)
    assert fit.source == "model.max_context=64"
