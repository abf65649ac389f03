"""DeepSeek-V4 checkpoint loading: tiny preset, HF parity, every bad input named."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from xspec.config import DType
from xspec.errors import CheckpointError, ConfigError
from xspec.models.base import ForwardBatch
from xspec.models.deepseek_v4 import load_model
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.model import DeepseekV4Model
from xspec.models.deepseek_v4.tiny import VERSION, generate_tiny
from xspec.models.deepseek_v4.weights import expected_tensors, load_checkpoint, load_rot
from xspec.models.loading import Checkpoint, write_checkpoint

CPU = torch.device("cpu")


def _cfg(path: Path | None = None, preset: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        path=str(path) if path else None, preset=preset, dtype=DType.float32, max_context=None
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """The tiny checkpoint (seed 0) plus its tensors and config, for building variants."""
    path = tmp_path_factory.mktemp("dsv4") / "tiny"
    generate_tiny(path)
    ckpt = Checkpoint(path)
    return path, dict(ckpt.iter_tensors()), dict(ckpt.config)


def _variant(tmp_path: Path, tiny, *, config=None, drop=(), add=None, extra_json=None) -> Path:
    _, tensors, base_config = tiny
    tensors = {k: v for k, v in tensors.items() if k not in drop} | (add or {})
    path = tmp_path / "variant"
    write_checkpoint(
        path,
        tensors,
        {**base_config, **(config or {})},
        max_shard_bytes=8 << 20,
        extra_json=extra_json,
    )
    return path


def _state_dicts_equal(a: torch.nn.Module, b: dict[str, torch.Tensor]) -> None:
    sa = a.state_dict()
    assert sorted(sa) == sorted(b)
    for k, v in b.items():
        diff = (sa[k].double() - v.double()).abs().max().item()
        assert sa[k].dtype == v.dtype and torch.equal(sa[k], v), f"{k}: max abs diff {diff}"


def test_expected_tensors_match_the_model() -> None:
    """The declarative official-layout table equals the model's state_dict (names and shapes)."""
    for args in (DeepseekV4Args.tiny(), _other_args()):
        model = DeepseekV4Model(args, device="meta")
        assert {k: list(v.shape) for k, v in model.state_dict().items()} == expected_tensors(args)


def _other_args() -> DeepseekV4Args:
    args = DeepseekV4Args.tiny()
    args.num_hidden_layers, args.compress_ratios, args.num_hash_layers = 4, [4, 128, 0, 4, 0], 1
    args.hc_mult, args.n_shared_experts, args.o_groups = 2, 2, 2
    return args


def test_tiny_preset_loads_exactly(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    model = load_model(_cfg(preset="tiny_random"), device=CPU, max_rollback=4)
    path = tmp_path / "cache" / "presets" / f"dsv4_tiny-{VERSION}"
    assert model.checkpoint_dir == path
    assert (
        len(
            set(
                json.loads((path / "model.safetensors.index.json").read_text())[
                    "weight_map"
                ].values()
            )
        )
        >= 2
    )
    ref = DeepseekV4Model(DeepseekV4Args.tiny())
    ref.init_random_(0)
    _state_dicts_equal(model, ref.state_dict())
    assert model.max_rollback == 4 and not model.training
    assert (
        load_model(_cfg(preset="tiny_random"), device=CPU, max_rollback=4).checkpoint_dir == path
    )  # reused


def test_tiny_generation_is_deterministic(tmp_path: Path, tiny) -> None:
    generate_tiny(tmp_path / "again")
    files = sorted(p.name for p in tiny[0].iterdir())
    assert files == sorted(p.name for p in (tmp_path / "again").iterdir())
    for f in files:
        assert (tiny[0] / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f


def test_matches_transformers_logits(tiny) -> None:
    """The same directory loads in transformers' DeepseekV4ForCausalLM with equal logits."""
    from transformers import DeepseekV4ForCausalLM

    model = load_checkpoint(tiny[0], dtype=torch.float32, device=CPU)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    ours = model(ForwardBatch(ids, [40], [model.new_state()])).logits  # [40, V]
    hf = DeepseekV4ForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]  # [40, V]
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-4, f"max abs diff vs transformers {diff}"


def test_drafter_tensors_do_not_break_loading(tmp_path: Path, tiny) -> None:
    rot = torch.linalg.qr(torch.randn(256, 256, generator=torch.Generator().manual_seed(0)))[0]
    extra = {
        "mtp.0.e_proj.weight": torch.ones(256, 256),
        "mtp.0.embed.weight": torch.ones(512, 256),
        "rot.weight": rot,
    }
    path = _variant(tmp_path, tiny, add=extra)
    model = load_checkpoint(path, dtype=torch.float32, device=CPU)
    _state_dicts_equal(model, {k: v for k, v in tiny[1].items() if not k.startswith("mtp.")})
    assert torch.equal(load_rot(Checkpoint(path)), rot)
    assert load_rot(Checkpoint(tiny[0])) is None


def test_bfloat16_load(tiny) -> None:
    model = load_checkpoint(tiny[0], dtype=torch.bfloat16, device=CPU)
    w = model.state_dict()["layers.2.attn.wq_a.weight"]
    assert w.dtype == torch.bfloat16 and torch.equal(
        w, tiny[1]["layers.2.attn.wq_a.weight"].bfloat16()
    )


def _shard(path: Path, name: str) -> str:
    return Checkpoint(path).file_of(name).name


@pytest.mark.parametrize(
    "case",
    [
        "extra_layer",
        "missing_layer",
        "missing_tensor",
        "wrong_shape",
        "float64",
        "int8_no_desc",
        "float_tid2eid",
    ],
)
def test_bad_checkpoints_name_tensor_file_and_key(tmp_path: Path, tiny, case: str) -> None:
    tensors = tiny[1]
    if case == "extra_layer":  # layers.5.* exist, config says 5 layers
        add = {
            k.replace("layers.4.", "layers.5.", 1): v
            for k, v in tensors.items()
            if k.startswith("layers.4.")
        }
        path = _variant(tmp_path, tiny, add=add)
        want = [
            rf"tensors for layers\.5 exist \(e\.g\. tensor 'layers\.5\.[\w.]+' in {_any_shard()}\) but config\.json num_hidden_layers = 5"
        ]
    elif case == "missing_layer":  # config says 5 layers, layers.4.* absent
        path = _variant(tmp_path, tiny, drop=[k for k in tensors if k.startswith("layers.4.")])
        want = [r"no tensors for layers\.4 at all, but config\.json num_hidden_layers = 5"]
    elif case == "missing_tensor":
        path = _variant(tmp_path, tiny, drop=["layers.2.attn.indexer.wq_b.weight", "hc_head_base"])
        want = [
            r"missing tensor 'layers\.2\.attn\.indexer\.wq_b\.weight' \(expected shape \[128, 128\]\)",
            "missing tensor 'hc_head_base'",
        ]
    elif case == "wrong_shape":
        path = _variant(tmp_path, tiny, add={"embed.weight": torch.zeros(500, 256)})
        want = [
            rf"tensor 'embed\.weight' in {_shard(path, 'embed.weight')} has shape \[500, 256\], expected \[512, 256\]"
        ]
    elif case == "float64":
        path = _variant(tmp_path, tiny, add={"norm.weight": tensors["norm.weight"].double()})
        want = [
            rf"tensor 'norm\.weight' in {_shard(path, 'norm.weight')} has unsupported dtype F64"
        ]
    elif (
        case == "int8_no_desc"
    ):  # a quantised weight without its description must not load as float
        add = {"layers.1.attn.wq_a.weight": torch.ones(128, 256, dtype=torch.int8)}
        path = _variant(tmp_path, tiny, add=add)
        want = [
            r"tensor 'layers\.1\.attn\.wq_a\.weight' in .* is int8 but quant_model_description\.json is absent"
        ]
    else:
        add = {"layers.0.ffn.gate.tid2eid": tensors["layers.0.ffn.gate.tid2eid"].float()}
        path = _variant(tmp_path, tiny, add=add)
        want = [
            r"tensor 'layers\.0\.ffn\.gate\.tid2eid' in .* is F32; tid2eid must hold integer expert ids"
        ]
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, dtype=torch.float32, device=CPU)
    msg = str(info.value)
    assert str(path) in msg
    for pattern in want:
        import re

        assert re.search(pattern, msg), f"{pattern!r} not in:\n{msg}"


def _any_shard() -> str:
    return r"model-\d{5}-of-\d{5}\.safetensors"


def test_all_problems_reported_together(tmp_path: Path, tiny, monkeypatch) -> None:
    """One error with every problem, raised before the model is allocated."""

    def no_allocation(*args, **kwargs):
        raise AssertionError("the model was allocated before the checkpoint was validated")

    monkeypatch.setattr(DeepseekV4Model, "__init__", no_allocation)
    add = {
        "embed.weight": torch.zeros(500, 256),
        "norm.weight": tiny[1]["norm.weight"].double(),
        "bogus.weight": torch.ones(1),
    }
    path = _variant(tmp_path, tiny, drop=["head.weight"], add=add)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, dtype=torch.float32, device=CPU)
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert any("unexpected tensor 'bogus.weight'" in p for p in problems)


def test_unknown_compress_ratio_names_key_and_file(tmp_path: Path, tiny) -> None:
    path = _variant(tmp_path, tiny, config={"compress_ratios": [0, 0, 4, 64, 4, 0]})
    with pytest.raises(CheckpointError, match=r"compress_ratios.*\(3, 64\)") as info:
        load_checkpoint(path, dtype=torch.float32, device=CPU)
    assert str(path / "config.json") in str(info.value)


def test_missing_path_and_preset(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError,
        match=r"no DeepSeek-V4 checkpoint given: set model\.path=/dir/of/DeepSeek-V4-Flash",
    ):
        load_model(_cfg(), device=CPU, max_rollback=2)
    with pytest.raises(ConfigError, match="known: tiny"):
        load_model(_cfg(preset="huge"), device=CPU, max_rollback=2)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(_cfg(path=tmp_path / "absent"), device=CPU, max_rollback=2)


def test_import_is_light() -> None:
    """Importing the package must not import the model code (no weights, no device work)."""
    import subprocess
    import sys

    code = "import sys, xspec.models.deepseek_v4; print('xspec.models.deepseek_v4.model' in sys.modules, 'safetensors' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# -- what a header or config.json cannot be trusted with ------------------------------------


def _with_config(tmp_path: Path, src: Path, **changes) -> Path:
    """``src``'s files hard-linked (no copy) into a new directory whose config.json has
    ``changes`` applied."""
    path = tmp_path / "config_variant"
    path.mkdir()
    for file in src.iterdir():
        if file.name != "config.json":
            os.link(file, path / file.name)
    config = json.loads((src / "config.json").read_text()) | changes
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("expert", [1000, -1])
def test_hash_routing_ids_outside_the_experts_are_refused_at_load(
    tmp_path: Path, tiny, expert: int
) -> None:
    """A poisoned ``tid2eid`` entry would index past the experts at the first prompt
    holding its token; the load refuses it, naming the tensor, its file and the entry."""
    table = tiny[1]["layers.1.ffn.gate.tid2eid"].clone()  # [vocab, top-k]
    table[7, 1] = expert
    path = _variant(tmp_path, tiny, add={"layers.1.ffn.gate.tid2eid": table})
    shard = _shard(path, "layers.1.ffn.gate.tid2eid")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, dtype=torch.float32, device=CPU)
    assert (
        f"tensor 'layers.1.ffn.gate.tid2eid' in {path / shard} routes token 7 to expert "
        f"{expert} (entry [7, 1]); every entry must be an expert id in [0, 8)"
    ) in str(info.value)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"quantization_config": "fp8"}, "quantization_config must be an object, got 'fp8'"),
        (
            {"rope_scaling": DeepseekV4Args.tiny().rope_scaling | {"beta_fast": "32"}},
            "rope_scaling.beta_fast must be a positive number, got '32'",
        ),
        ({"bos_token_id": 512}, r"bos_token_id \(512\) is outside the vocabulary"),
        ({"bos_token_id": [0]}, r"bos_token_id must be a token id .* got \[0\]"),
        ({"hidden_size": 10**30}, "hidden_size must be at most 2147483647"),
        (  # each expert has tensors of its own: the headers cannot hold this many
            {"n_routed_experts": 10_000},
            r"n_routed_experts = 10000, but the checkpoint holds \d+ tensors in all",
        ),
    ],
)
def test_config_fields_of_the_wrong_type_or_size_are_named(
    tmp_path: Path, tiny, changes: dict, why: str
) -> None:
    """Refused by the load and by the header-only footprint (the memory plan), as one
    CheckpointError naming config.json and the key, never a traceback from later code."""
    from xspec.models.deepseek_v4 import footprint

    path = _with_config(tmp_path, tiny[0], **changes)
    for attempt in (
        lambda: load_checkpoint(path, dtype=torch.float32, device=CPU),
        lambda: footprint(_cfg(path), max_rollback=4),
    ):
        with pytest.raises(CheckpointError, match=why) as info:
            attempt()
        assert str(path / "config.json") in str(info.value)


def _relabel(path: Path, tensor: str, dtype: str) -> Path:
    """Rewrite the header of ``tensor``'s shard so that it claims ``dtype`` (its bytes
    and byte range unchanged)."""
    shard = Checkpoint(path).file_of(tensor)
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header[tensor]["dtype"] = dtype
    blob = json.dumps(header).encode()
    shard.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n :])
    return path


def test_a_mislabelled_tensor_exits_2_with_one_message(tmp_path: Path, tiny) -> None:
    """An F32 tensor whose header says BF16 (its range then holds twice its bytes): the
    run and the plan-only entry refuse it before reading any tensor, exit 2, with one
    message (the run's: "this run cannot be built" and this one problem), no traceback."""
    import contextlib
    import io

    from tests.clirun import run_cli_in_process
    from xspec.plan import main as plan_main

    path = tmp_path / "ckpt"
    shutil.copytree(tiny[0], path)
    _relabel(path, "layers.2.attn_norm.weight", "BF16")
    why = "tensor 'layers.2.attn_norm.weight': BF16[256] holds 512 bytes but its data_offsets"
    args = ("model=dsv4_flash", f"model.path={path}", "model.tokenizer=byte", "spec=none",
            "platform=cpu", "workload.num_requests=1")  # fmt: skip
    run = run_cli_in_process(*args, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    head, *problems = run.stderr.splitlines()
    assert head == "xspec: error: this run cannot be built:", run.stderr
    assert len(problems) == 1 and problems[0].startswith("  - ") and why in problems[0]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = plan_main([*args[:2], "spec=none", "engine.device_memory_gib=64"])
    assert code == 2 and why in stderr.getvalue(), stderr.getvalue()
