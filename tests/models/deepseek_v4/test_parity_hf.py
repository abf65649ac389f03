"""Parity with transformers' DeepseekV4ForCausalLM on the same official-layout checkpoint,
with the steps on the reference torch ops, on the CPU platform's native fused kernels,
and compiled (``slow``): one tolerance for all three.

The checkpoint is ``save_file(model.state_dict())`` + ``args.to_config()``: transformers
loads it through its own renaming table (conversion_mapping.py), so this also checks
that xspec's parameter names are the official ones. A 600-token prompt exercises the
SWA ring wrap, several CSA / HCA emissions and real indexer top-k (index_topk 8 or 16
out of up to 150 entries).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

PROMPT = 600
TOL = 1e-4  # fp32; measured max abs diff is ~5e-6
CASES = [("tiny", 0), ("tiny", 1), ("variant", 0), ("variant", 1)]


def save_checkpoint(model, path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.args.to_config(), indent=2))


@pytest.fixture(scope="module")
def hf_reference(dsv4, tmp_path_factory):
    """``(config, seed) -> (ids [600], HF logits [600, V])``, one HF load per case."""
    cache: dict = {}

    def get(config: str, seed: int):
        if (config, seed) not in cache:
            model = dsv4.model(config, seed)
            path = tmp_path_factory.mktemp(f"dsv4_{config}_{seed}")
            save_checkpoint(model, path)
            hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
            ids = dsv4.ids(PROMPT, model.vocab_size, seed + 100)
            with torch.no_grad():
                logits = hf.eval()(ids[None], use_cache=False).logits[0].float()
            cache[(config, seed)] = (ids, logits)
        return cache[(config, seed)]

    return get


@pytest.mark.parametrize("config", ["tiny", "variant"])
def test_checkpoint_loads_in_transformers_without_renames_left(dsv4, tmp_path, config):
    model = dsv4.model(config, 0)
    save_checkpoint(model, tmp_path)
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    cfg = hf.config
    ratios = model.args.target_compress_ratios
    kinds = {
        0: "sliding_attention",
        4: "compressed_sparse_attention",
        128: "heavily_compressed_attention",
    }
    assert cfg.layer_types == [kinds[r] for r in ratios]
    assert cfg.mlp_layer_types == [
        "hash_moe" if i < model.args.num_hash_layers else "moe" for i in range(len(ratios))
    ]
    assert cfg.qk_rope_head_dim == model.args.qk_rope_head_dim
    # hash tables arrive intact (transformers would otherwise leave zeros)
    tid2eid = hf.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(tid2eid, model.layers[0].ffn.gate.tid2eid)


@pytest.mark.parametrize(("config", "seed"), CASES)
def test_full_prefill_matches_transformers(dsv4, hf_reference, steps, config, seed):
    ids, ref = hf_reference(config, seed)
    model = dsv4.model(config, seed, steps=steps)
    logits = dsv4.run(model, ids, model.new_state()).logits
    diff = dsv4.max_diff(logits, ref)
    assert diff <= TOL, f"{config}/{seed}: full prefill max abs diff {diff:.3g}"


@pytest.mark.parametrize(("config", "seed"), CASES)
def test_chunked_prefill_matches_transformers(dsv4, hf_reference, steps, config, seed):
    ids, ref = hf_reference(config, seed)
    model = dsv4.model(config, seed, steps=steps)
    chunks = [1, 3, 130, 7, 128, 4, 200, 127]  # uneven, across ring and window edges
    logits = dsv4.run_chunks(model, ids, chunks)
    diff = dsv4.max_diff(logits, ref)
    assert diff <= TOL, f"{config}/{seed}: chunked prefill max abs diff {diff:.3g}"


@pytest.mark.parametrize(("config", "seed"), CASES)
def test_token_by_token_decode_matches_transformers(dsv4, hf_reference, steps, config, seed):
    """Prefill 120, then decode one token at a time through position 270: crosses the
    128 window, the ring wrap (136 slots) and the HCA emissions at 127 and 255."""
    ids, ref = hf_reference(config, seed)
    model = dsv4.model(config, seed, steps=steps)
    state = model.new_state()
    dsv4.run(model, ids[:120], state)
    logits = dsv4.run_chunks(model, ids[120:270], [1] * 150, state)
    diff = dsv4.max_diff(logits, ref[120:270])
    assert diff <= TOL, f"{config}/{seed}: decode max abs diff {diff:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize(("config", "seed"), [("tiny", 0), ("variant", 1)])
def test_long_decode_matches_transformers(dsv4, hf_reference, config, seed):
    """Token-by-token over the whole 600-token prompt after a 4-token prefill."""
    ids, ref = hf_reference(config, seed)
    model = dsv4.model(config, seed)
    state = model.new_state()
    first = dsv4.run(model, ids[:4], state).logits
    logits = torch.cat([first, dsv4.run_chunks(model, ids[4:], [1] * (PROMPT - 4), state)])
    diff = dsv4.max_diff(logits, ref)
    assert diff <= TOL, f"{config}/{seed}: long decode max abs diff {diff:.3g}"
