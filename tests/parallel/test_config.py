"""The ``parallel`` section: topology arithmetic and every bad setting as a clear error
before anything is loaded (world size from torchrun's environment)."""

from __future__ import annotations

import pytest

from tests.test_cli import run_cli
from xspec.build import check
from xspec.compose import compose_run
from xspec.config import validate
from xspec.errors import ConfigError
from xspec.parallel.topology import Topology, expert_range
from xspec.platforms import get_platform


def test_topology_replicas_and_expert_groups():
    # 4 processes, dp=2 x ep=2: replicas {0,1} {2,3}, EP groups the same pairs
    t = [Topology(world=4, rank=r, dp=2, ep=2) for r in range(4)]
    assert [x.replica for x in t] == [0, 0, 1, 1]
    assert [x.replica_leader for x in t] == [True, False, True, False]
    assert [x.ep_rank for x in t] == [0, 1, 0, 1]
    assert t[0].ep_group_ranks() == [[0, 1], [2, 3]]
    assert t[2].requests_of_replica(5) == [1, 3]
    assert [t[0].concurrency_of_replica(c) for c in (16, 3, 1)] == [8, 2, 1]
    assert t[2].concurrency_of_replica(3) == 1
    # the reference deployment's split: EP over all 16 ranks, every rank its own requests
    ref = Topology(world=16, rank=5, dp=16, ep=16)
    assert (ref.replica, ref.ep_rank, ref.ep_group_ranks()) == (5, 5, [list(range(16))])
    assert [expert_range(r, 4, 256) for r in (0, 3)] == [range(0, 64), range(192, 256)]


def _problems(overrides: list[str]) -> list[str]:
    cfg = compose_run(["model=dsv4_tiny_random", "platform=cpu", *overrides])
    return check(cfg)


def test_single_process_refuses_dp_and_ep():
    problems = _problems(["parallel.dp=2", "parallel.ep=2", "spec=none"])
    assert any("parallel.dp=2 needs 2+ processes" in p and "torchrun" in p for p in problems)
    assert any("parallel.ep=2 needs 2+ processes" in p for p in problems)


def test_sizes_must_divide_the_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    problems = _problems(["parallel.dp=3", "spec=none"])
    assert problems == [
        "parallel.dp=3 does not divide the world size 4 (torchrun --nnodes x "
        "--nproc-per-node); use a divisor of 4"
    ]
    with pytest.raises(ConfigError, match=r"parallel.timeout_s must be > 0"):
        validate(compose_run(["parallel.timeout_s=0"]))


def test_ep_must_divide_the_expert_count(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # ep=3 divides the world, not the 8 experts
    assert _problems(["parallel.ep=3", "spec=mtp"]) == [
        "parallel.ep=3 does not divide the model's 8 routed experts per layer (config.json "
        "n_routed_experts); use a divisor of 8"
    ]


def test_ep_needs_an_expert_parallel_model_and_drafter(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _problems(["parallel.ep=2", "spec=oracle"]) == [
        "parallel.ep=2: spec=oracle does not support expert parallelism (it does not declare "
        "its MoE forwards); use spec=none, mtp or dspark, or parallel.ep=1"
    ]
    cfg = compose_run(["model=qwen3_moe_tiny", "platform=cpu", "spec=none", "parallel.ep=2"])
    assert any("model.arch=qwen3 has no expert-parallel loader" in p for p in check(cfg))
    # data parallelism alone works for any model and method
    cfg = compose_run(["model=qwen3_moe_tiny", "platform=cpu", "spec=none", "parallel.dp=2"])
    assert check(cfg) == []


def test_backend_comes_from_the_platform():
    cfg = compose_run(["platform=cpu"])
    assert get_platform(cfg.platform).distributed_backend() == "gloo"
    assert get_platform(cfg.platform).rank_device_index(3) == 0  # one host device


def test_cli_exits_2_for_ep_without_torchrun(tmp_path):
    r = run_cli("model=dsv4_tiny_random", "platform=cpu", "parallel.ep=2", cache=tmp_path / "c")
    assert r.returncode == 2, r.stderr
    assert "parallel.ep=2 needs 2+ processes" in r.stderr and "Traceback" not in r.stderr


def test_a_checkpoint_missing_one_ranks_experts_fails_before_loading(monkeypatch, tmp_path):
    """EP rank 1's experts (4..7) of layer 2 are gone: every rank's up-front check names
    them (headers only), so no rank loads or computes anything."""
    from xspec.models.deepseek_v4.tiny import tiny_dir
    from xspec.models.loading import Checkpoint, write_checkpoint

    ckpt = Checkpoint(tiny_dir())
    kept = {
        n: t
        for n, t in ckpt.iter_tensors()
        if not any(n.startswith(f"layers.2.ffn.experts.{e}.") for e in range(4, 8))
    }
    write_checkpoint(tmp_path / "ckpt", kept, ckpt.config)
    monkeypatch.setenv("WORLD_SIZE", "2")
    problems = _problems(["spec=none", "parallel.ep=2", f"model.path={tmp_path / 'ckpt'}",
                          "model.tokenizer=byte"])  # fmt: skip
    text = "\n".join(problems)
    assert all(f"'layers.2.ffn.experts.{e}.w1.weight'" in text for e in range(4, 8)), text
    assert "experts.3." not in text


def test_adaptive_verification_is_single_process_for_now(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    problems = _problems(["parallel.dp=2", "spec=dspark", "spec.adaptive=true"])
    assert any(
        "spec.adaptive=true is not supported with parallel.dp/ep > 1" in p for p in problems
    ), problems
    assert not any("spec.adaptive" in p for p in _problems(["parallel.dp=2", "spec=dspark"]))
