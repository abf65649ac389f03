"""The training pipeline on a toy recipe: every stage runs through the inference modules,
losses go down, and the exported directories load through xspec's own loaders and
speculate with the baseline's greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

import xspec
from xspec.train import corpus
from xspec.train.loop import Schedule
from xspec.train.pipeline import (
    DSPARK_ASSET,
    TARGET_ASSET,
    Recipe,
    evaluate,
    stage_drafters,
    stage_export,
    stage_regen,
    stage_target,
)


def _sched(steps: int) -> Schedule:
    return Schedule(steps=steps, lr=3e-3, warmup=1, save_every=4, log_every=1)


RECIPE = Recipe(
    num_layers=4,
    target=_sched(8),
    target_batch=2,
    target_len=64,
    regen_prompts=6,
    prompt_len=16,
    new_tokens=32,
    dspark=_sched(8),
    dspark_batch=2,
    dspark_anchors=4,
    mtp=_sched(8),
    mtp_batch=2,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("work")
    out = tmp_path_factory.mktemp("out")
    stage_target(work, RECIPE, progress=False)
    stage_regen(work, RECIPE)
    stage_drafters(work, RECIPE, progress=False)
    stage_export(work, RECIPE, out)
    return work, out


def _losses(work: Path, name: str) -> list[float]:
    return [json.loads(x)["loss"] for x in (work / f"{name}_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["target", "mtp", "dspark"])
def test_losses_decrease(built, name) -> None:
    losses = _losses(built[0], name)
    assert len(losses) == 8
    assert sum(losses[-2:]) < sum(losses[:2])


def test_regenerated_text_is_the_targets(built) -> None:
    """Half the prompts were continued greedily: re-running the exported target greedily
    on them gives the same tokens."""
    work, out = built
    with safe_open(str(work / "regen.safetensors"), "pt") as f:  # safetensors, no pickle
        ids, n = f.get_tensor("ids"), int(f.metadata()["prompt_len"])
    assert ids.shape == (RECIPE.regen_prompts, RECIPE.prompt_len + RECIPE.new_tokens)
    llm = xspec.LLM(
        model="dsv4_tiny",
        spec="none",
        platform="cpu",
        overrides={"model.path": str(out / TARGET_ASSET)},
    )
    got = llm.generate(ids[:2, :n].tolist(), max_new_tokens=RECIPE.new_tokens, ignore_eos=True)
    assert [g.token_ids for g in got] == ids[:2, n:].tolist()


def test_export_round_trips_and_speculates_exactly(built) -> None:
    _, out = built
    target, draft = out / TARGET_ASSET, out / DSPARK_ASSET
    assert (target / "tokenizer.json").is_file()
    assert json.loads((draft / "config.json").read_text())["dspark_noise_token_id"] == corpus.NOISE
    prompts = corpus.prompts(corpus.source_files(split="heldout"), 3, seed=0, max_chars=120)
    outputs = {}
    for method in ("none", "mtp", "dspark"):
        overrides = {"model.path": str(target)}
        if method == "dspark":
            overrides["spec.draft_path"] = str(draft)
        llm = xspec.LLM(model="dsv4_tiny", spec=method, platform="cpu", overrides=overrides)
        outputs[method] = [g.token_ids for g in llm.generate(prompts, max_new_tokens=12)]
        if method != "none":
            assert llm.metrics.report().num_draft_tokens > 0
    assert outputs["mtp"] == outputs["none"] and outputs["dspark"] == outputs["none"]


def test_evaluate_reports_both_drafters(built) -> None:
    _, out = built
    result = evaluate(out / TARGET_ASSET, out / DSPARK_ASSET, prompts=2, new_tokens=8)
    assert set(result) == {"mtp@0.0", "mtp@0.8", "dspark@0.0", "dspark@0.8"}
    assert result["dspark@0.0"]["gamma"] == RECIPE.dspark_block
    assert len(result["dspark@0.0"]["survival"]) == RECIPE.dspark_block


def test_the_work_dir_holds_no_pickle(built) -> None:
    """Every kept file is safetensors or JSON: the loop states, the token caches."""
    work, _ = built
    assert not list(work.glob("*.pt"))
    names = {p.name for p in work.iterdir()}
    want = {"train_tokens.safetensors", "regen.safetensors", "metrics.json"}
    assert want | {f"{j}_state.safetensors" for j in ("target", "mtp", "dspark")} <= names
    assert not [n for n in names if n.startswith(".")]  # no temp file or directory left
