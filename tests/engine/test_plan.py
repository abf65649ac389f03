"""The memory plan before loading (xspec/engine/memory.py ``LayoutPlan``, ``python -m
xspec.plan``): weights by format from the safetensors headers, per EP rank, against
numbers computed here by hand from the DeepSeek-V4-Flash-0731 geometry; and a run whose
weights cannot fit is refused before any tensor is read (exit 2)."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clirun import run_cli_in_process
from tests.models.deepseek_v4.flash_headers import allocated_bytes, write_flash_0731
from tests.test_cli import ROOT
from xspec.plan import main as plan_main

GIB = 1 << 30
# DeepSeek-V4-Flash-0731: its config.json (flash_headers.flash_0731_config)
V, D, H, HD, QR, G, OLR = 129280, 4096, 64, 512, 1024, 8, 1024
E, INTER, TOPK, IH, IHD, HC, RANK, STAGES = 256, 2048, 6, 64, 128, 4, 256, 3
RATIOS = [0, 0] + [4, 128] * 20 + [4]
GAMMA, ROLLBACK, WINDOW = 5, 8, 128  # dspark_block_size; max(gamma, 8) rows of rollback


def _quant(fmt: str, n: int, k: int, expert: bool) -> tuple[str, int]:
    """(format, bytes) of one quantised linear ``[n, k]`` with its scales / offsets."""
    if fmt == "w8a8":  # int8 + fp32 weight_scale [n, 1] + fp32 weight_offset [n, 1]
        return "w8a8", n * k + 8 * n
    if expert:  # MXFP4: two e2m1 per byte + one ue8m0 per 32 values
        return "mxfp4", n * k // 2 + n * k // 32
    return "fp8", n * k + math.ceil(n / 128) * math.ceil(k / 128)  # e4m3 + 128x128 ue8m0


def hand_weights(fmt: str, ep: int) -> dict[str, int]:
    """Bytes by format one EP rank holds: target + three DSpark stages, E / ep experts of
    each MoE layer, everything else replicated (bf16 and fp32 as the file stores them)."""
    held = {"bf16": 0, "fp32": 0, "int": 0}

    def add(key: str, nbytes: int) -> None:
        held[key] = held.get(key, 0) + nbytes

    ffn = [(INTER, D), (D, INTER), (INTER, D)]  # w1, w2, w3
    attn = [(QR, D), (H * HD, QR), (HD, D)]  # wq_a, wq_b, wkv: quantised in both formats
    wo = [(G * OLR, H * HD // G), (D, G * OLR)]  # wo_a, wo_b: FP8 in the official release
    hc = 2 * (24 * HC * D + 24 + 3)  # hc_attn / hc_ffn fn, base, scale (fp32)

    def block(ratio: int, hash_routed: bool) -> None:
        linears = attn + ([(IH * IHD, QR)] if ratio == 4 else []) + ffn  # + shared expert
        for n, k in linears:
            add(*_quant(fmt, n, k, expert=False))
        for n, k in wo:
            add(*(_quant(fmt, n, k, False) if fmt != "w8a8" else ("bf16", 2 * n * k)))
        for n, k in ffn * (E // ep):
            add(*_quant(fmt, n, k, expert=True))
        add("bf16", 2 * (2 * D + QR + HD + E * D))  # norms, q_norm, kv_norm, gate.weight
        add("fp32", 4 * (H + hc + (0 if hash_routed else E)))  # sink, mHC, gate.bias
        add("int", V * TOPK * 4 if hash_routed else 0)  # tid2eid int32
        coff = 2 if ratio == 4 else 1
        if ratio:  # the compressor: wkv, wgate, norm (bf16), ape (fp32)
            add("bf16", 2 * (2 * coff * HD * D + HD))
            add("fp32", 4 * ratio * coff * HD)
        if ratio == 4:  # the indexer: weights_proj, its compressor
            add("bf16", 2 * (IH * D + 2 * 2 * IHD * D + IHD))
            add("fp32", 4 * 4 * 2 * IHD)

    add("bf16", 2 * (2 * V * D + D))  # embed, head, norm
    add("fp32", 4 * (HC * HC * D + HC + 1))  # hc_head
    for i, ratio in enumerate(RATIOS):
        block(ratio, hash_routed=i < 3)
    for s in range(STAGES):  # SWA-only blocks with learned routing
        block(0, hash_routed=False)
        if s == 0:
            add("bf16", 2 * (D * 3 * D + D))  # main_proj over 3 captured layers, main_norm
        if s == STAGES - 1:  # hc_head, norm, Markov head (W1, W2), confidence head
            add("fp32", 4 * (HC * HC * D + HC + 1))
            add("bf16", 2 * (D + 2 * V * RANK + D + RANK))
    return {k: v for k, v in held.items() if v}


def hand_kv() -> tuple[int, float, int]:
    """(target fixed, target bytes per token, draft fixed) in bf16. Per token: 21 CSA
    layers x (512 / 4 + 128 / 4) x 2 B + 20 HCA layers x 512 / 128 x 2 B."""
    per_token = 21 * (HD * 2 / 4 + IHD * 2 / 4) + 20 * (HD * 2 / 128)
    fixed = 43 * (WINDOW + ROLLBACK) * HD * 2  # the SWA rings (+ rollback rows)
    for ratio in RATIOS:  # fp32 compressor state rows, kv + score
        coff = 2 if ratio == 4 else 1
        widths = [HD, IHD] if ratio == 4 else [HD] if ratio else []
        fixed += sum(2 * (coff * ratio + ROLLBACK) * coff * w * 4 for w in widths)
    rings = STAGES * WINDOW * HD * 2  # one window ring per DSpark stage
    held = 8 * STAGES * D * 2  # captures held back (fixed gamma: 8 rows of K*d, no window)
    return fixed, per_token, rings + held


def _plan(tmp_path: Path, ckpt: Path, *args: str) -> tuple[int, dict, str, str]:
    out = tmp_path / "plan.json"
    argv = [
        "model=dsv4_flash", f"model.path={ckpt}", "spec=dspark", "platform=cpu",
        "engine.device_memory_gib=64", "engine.memory_budget=0.9", "--json", str(out), *args,
    ]  # fmt: skip
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = plan_main(argv)
    data = json.loads(out.read_text()) if out.exists() else {}
    return code, data, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def flash_0731(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Header-only Flash-0731 checkpoints, one per format (written once per module)."""
    root = tmp_path_factory.mktemp("flash_0731")
    return {fmt: write_flash_0731(root / fmt, fmt) for fmt in ("w8a8", "fp8_mxfp4")}


@pytest.mark.parametrize(("fmt", "ep"), [("fp8_mxfp4", 4), ("w8a8", 16)])
def test_flash_0731_plan_matches_hand_computation(
    tmp_path: Path, flash_0731: dict[str, Path], fmt: str, ep: int
) -> None:
    ckpt = flash_0731[fmt]
    assert allocated_bytes(ckpt) < 64 << 20  # headers only: the data sections are holes
    code, data, text, err = _plan(
        tmp_path, ckpt, "parallel.dp=4", f"parallel.ep={ep}", "--world", "16", "--context", "65536"
    )
    assert code == 0, err
    weights = hand_weights(fmt, ep)
    t_fixed, t_token, d_fixed = hand_kv()
    budget = int(0.9 * 64 * GIB)
    workspace = (GAMMA + 1) * (3 * V + 16 * D) * 4 + GAMMA * V * 4
    seq = t_fixed + d_fixed + math.ceil(t_token * (65536 + GAMMA)) + workspace
    fits = (budget - sum(weights.values())) // seq
    assert data["layout"] == {"world": 16, "dp": 4, "ep": ep}
    assert data["budget"] == budget and data["gamma"] == GAMMA
    assert data["kv"]["target"] == {"fixed": t_fixed, "per_token": t_token} and t_token == 6880
    assert data["kv"]["draft"] == {"fixed": d_fixed, "per_token": 0.0}
    assert data["verify_workspace"] == workspace
    assert len(data["ranks"]) == ep
    for r, row in enumerate(data["ranks"]):
        assert row["ranks"] == list(range(r, 16, ep))
        assert row["weights"] == weights
        assert row["seq_bytes"] == seq and row["max_sequences"] == fits > 0
    assert data["max_sequences_per_replica"] == fits and data["max_sequences"] == 4 * fits
    gib = sum(weights.values()) / GIB
    assert f"weights {gib:.1f} GiB" in text and "6880 B/token (target 6880, draft 0)" in text
    assert f"{fits} per DP replica, {4 * fits} in all" in text


def test_flash_0731_w8a8_on_4_ranks_does_not_fit(
    tmp_path: Path, flash_0731: dict[str, Path]
) -> None:
    ckpt = flash_0731["w8a8"]
    code, data, text, err = _plan(tmp_path, ckpt, "parallel.dp=4", "parallel.ep=4", "--world=16")
    assert "0 per DP replica, 0 in all" in text
    weights = sum(hand_weights("w8a8", 4).values())
    assert code == 2 and data["ranks"][0]["max_sequences"] == 0  # the plan is still written
    assert f"{int(0.9 * 64 * GIB)} bytes available but at least" in err
    assert f"weights {weights / GIB:.1f} GiB counted from the checkpoint headers (w8a8" in err
    assert "raise parallel.ep (now 4;" in err and "model.dtype" in err


def _garble_data(ckpt: Path) -> int:
    """Overwrite every shard's data section with 0xFF (NaN as floats) -> stored bytes."""
    total = 0
    for shard in sorted(ckpt.glob("*.safetensors")):
        with open(shard, "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            size = shard.stat().st_size - 8 - n
            f.seek(8 + n)
            f.write(b"\xff" * size)
        total += size
    return total


def test_too_small_budget_is_refused_before_any_tensor_is_read(tmp_path: Path) -> None:
    """A real tiny checkpoint whose tensor data is garbage: loading any tensor would fail
    ("NaN or Inf", or the hash table's expert ids out of range); a budget below its
    stored bytes is refused first, exit 2, with the numbers (the same message as for the
    intact checkpoint)."""
    from xspec.models.deepseek_v4.tiny import tiny_dir

    intact = tiny_dir()
    garbled = tmp_path / "garbled"
    shutil.copytree(intact, garbled)
    stored = _garble_data(garbled)
    budget = stored // 2
    args = ["model=dsv4_tiny_random", "model.tokenizer=byte", "spec=none", "platform=cpu",
            f"engine.memory_budget={budget}"]  # fmt: skip
    results = [
        run_cli_in_process(*args, f"model.path={path}", cwd=tmp_path) for path in (intact, garbled)
    ]
    for r in results:
        assert r.returncode == 2, r.stderr
        assert f"{budget} bytes available but at least" in r.stderr
        assert "refused before any tensor is read" in r.stderr and "fp32" in r.stderr
        assert "NaN" not in r.stderr and "Traceback" not in r.stderr
    assert results[0].stderr.replace(str(intact), "") == results[1].stderr.replace(str(garbled), "")
    # with room for it the garbled one is loaded, and its first tensor fails
    ok = run_cli_in_process(
        *args[:-1], f"model.path={garbled}", "workload.num_requests=1", cwd=tmp_path
    )
    assert ok.returncode == 2 and re.search(r"NaN or Inf|must be an expert id", ok.stderr)


def _limit_address_space() -> None:
    """In the child: a regression that loads the weights fails with MemoryError instead of
    waking the OOM killer on a shared machine."""
    resource.setrlimit(resource.RLIMIT_AS, (8 * GIB, 8 * GIB))


def test_flash_slice_refused_with_small_rss(tmp_path: Path, xspec_cache: Path) -> None:
    """The issue's case: a 2-layer W8A8 slice at Flash geometry (14.4 GiB of shards, 28 GiB
    as bf16) under a 4 GB budget. The real CLI refuses it before reading a tensor: exit
    2, and the process never grows past a few hundred MB (loading would take GiBs)."""
    ckpt = write_flash_0731(tmp_path / "slice", "w8a8", layers=2)
    stored = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert 12 * GIB < stored < 16 * GIB and allocated_bytes(ckpt) < 16 << 20
    env = {**os.environ, "XSPEC_CACHE_DIR": str(xspec_cache), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "xspec", "model=dsv4_flash", f"model.path={ckpt}",
         "model.tokenizer=byte", "spec=none", "platform=cpu", "engine.memory_budget=4e9",
         f"hydra.run.dir={tmp_path / 'out'}"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
        preexec_fn=_limit_address_space,
    )  # fmt: skip
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB
    assert proc.returncode == 2, proc.stderr
    assert "4000000000 bytes available but at least" in proc.stderr
    assert "(w8a8 " in proc.stderr and "refused before any tensor is read" in proc.stderr
    assert rss_gib < 2, f"peak RSS {rss_gib:.2f} GiB"


@pytest.mark.parametrize(
    ("model", "spec"),
    [("dsv4_tiny_random", "dspark"), ("dsv4_tiny_random", "mtp"), ("qwen3_tiny", "dflash")],
)
def test_footprint_agrees_with_the_loaded_models(model: str, spec: str) -> None:
    """What the headers say equals what the loaded target + drafter report: KV, workspace,
    context exactly; weights up to the few buffers no checkpoint stores."""
    from xspec.build import build, layout_plan
    from xspec.compose import compose_run

    cfg = compose_run([f"model={model}", f"spec={spec}", "platform=cpu"])
    before = layout_plan(cfg, free_before=1 << 34, default_fraction=0.5).rank_plan(0)
    after = build(cfg).engine.plan
    assert after is not None
    assert (before.target, before.draft) == (after.target, after.draft)
    assert (before.workspace, before.gamma, before.max_context) == (
        after.workspace,
        after.gamma,
        after.max_context,
    )
    assert 0 <= after.weights - before.weights <= 1024


def test_expert_parallel_ranks_split_the_routed_experts() -> None:
    from xspec.build import layout_plan
    from xspec.compose import compose_run

    cfg = compose_run(["model=dsv4_tiny_random", "spec=mtp", "platform=cpu"])
    whole = layout_plan(cfg, free_before=1 << 34, default_fraction=0.5)
    cfg.parallel.ep = 2
    split = layout_plan(cfg, free_before=1 << 34, default_fraction=0.5, world=2)
    assert whole is not None and split is not None and split.routed_experts > 0
    assert split.routed_experts == whole.routed_experts
    for r in range(2):  # 4 of the 8 experts of every MoE layer (target + MTP block)
        held = sum(split.weights(r).values())
        assert held == sum(whole.weights(0).values()) - whole.routed_experts // 2


def test_plan_needs_the_device_memory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert plan_main(["model=dsv4_tiny_random", "spec=none", "parallel.ep=2"]) == 2
    assert "set engine.device_memory_gib" in capsys.readouterr().err
    assert plan_main(["model=dsv4_tiny_random", "engine.device_memory_gib=-1"]) == 2
    assert "engine.device_memory_gib must be > 0" in capsys.readouterr().err
    code = plan_main(
        ["model=dsv4_tiny_random", "spec=none", "engine.memory_budget=4e9", "--json", "-"]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["budget"] == 4_000_000_000 and data["layout"]["world"] == 1


# dsv4_tiny_random: max_position_embeddings 4096, 8 routed experts
TINY = ["model=dsv4_tiny_random", "spec=none", "engine.device_memory_gib=64"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--world", "0"], "--world must be between 1 and 1048576 ranks (got 0)"),
        (["--world", "-3"], "--world must be between 1 and 1048576 ranks (got -3)"),
        (["--world", str((1 << 20) + 1)], "--world must be between 1 and 1048576 ranks"),
        (["--context", "0"], "--context must be >= 1 token (got 0)"),
        (["--context", "4097"], "--context 4097 is longer than the model's context of 4096 tokens (the checkpoint's max_position_embeddings)"),
        (["--context", str(10**400)], "give --context <= 4096"),
        (["model.max_context=100", "--context", "101"], "context of 100 tokens (model.max_context=100)"),
        (["model.max_context=8192"], "model.max_context=8192 is above the checkpoint's trained context of 4096 tokens"),
        (["engine.device_memory_gib=1e300"], "engine.device_memory_gib must be > 0 and at most 1048576 GiB (1 PiB)"),
        (["engine.memory_budget=1e300"], "engine.memory_budget must be at most 1125899906842624 bytes (1 PiB"),
        (["parallel.dp=999999937", "parallel.ep=8"], "need a world of 7999999496 ranks (their least common multiple), more than the 1048576 a plan describes"),
    ],
)  # fmt: skip
def test_plan_bounds_every_number(
    args: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    """0 is an error, not the default; a world, a context or a memory size beyond any real
    one is refused with its limit (exit 2, one message), never an OverflowError."""
    assert plan_main([*TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xspec: error:") and needle in err, err


def test_plan_context_defaults_within_the_model_context(capsys: pytest.CaptureFixture) -> None:
    """The default context (workload.input_len + output_len, 256) is capped to a shorter
    model.max_context instead of refused (the user gave no --context)."""
    assert plan_main([*TINY, "model.max_context=100", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 100


def _limit_memory() -> None:
    """In the child: 4 GiB of address space, so a plan that allocates per rank without
    bound fails with MemoryError instead of waking the OOM killer."""
    resource.setrlimit(resource.RLIMIT_AS, (4 * GIB, 4 * GIB))


def test_a_world_of_a_billion_is_refused_before_allocating(tmp_path: Path) -> None:
    """The issue's case, through the real entry point: exit 2 and the limit, at once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "xspec.plan", *TINY, "--world", "1000000000"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
        preexec_fn=_limit_memory,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--world must be between 1 and 1048576 ranks (got 1000000000)" in proc.stderr
    assert "Traceback" not in proc.stderr
