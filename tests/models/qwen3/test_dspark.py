"""Qwen3 DSpark / DFlash drafts: the cached batched draft forward against a naive one,
config key fallbacks, checkpoint layouts, preflight errors, the heads, and (slow) the
DeepSpec reference implementation on the same draft directory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from xspec.config import ModelConfig, PlatformConfig, SpecConfig
from xspec.errors import CheckpointError, ConfigError
from xspec.models.base import CaptureSite, ForwardBatch
from xspec.models.block_draft import BlockLayout
from xspec.models.draft_heads import ConfidenceHead, MarkovHead
from xspec.models.loading import Checkpoint, write_checkpoint
from xspec.models.qwen3 import load_model
from xspec.models.qwen3.block_drafts import load_block_draft
from xspec.models.qwen3.draft_config import parse_config, trained_layout
from xspec.models.qwen3.dspark import HEAD_PREFIXES, DraftCache, Qwen3BlockDraft
from xspec.models.qwen3.model import Qwen3Model
from xspec.models.qwen3.tiny import tiny_draft_dir
from xspec.platforms.cpu import CpuPlatform
from xspec.sampling import SamplingParams
from xspec.spec.block import BlockDrafter, sample_block
from xspec.spec.drafter import CommittedRows, DraftRequest
from xspec.spec.dspark import DFlashDrafter, DSparkDrafter

MODEL_CFG = ModelConfig(arch="qwen3", preset="tiny")
PLATFORM = CpuPlatform(PlatformConfig(name="cpu"))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def target() -> Qwen3Model:
    return load_model(MODEL_CFG, device=torch.device("cpu"), max_rollback=8)


def load(
    target: Qwen3Model, layout: BlockLayout, draft_path: str | None = None
) -> tuple[Qwen3BlockDraft, list[int], int]:
    spec = SpecConfig(method=layout.value, draft_path=draft_path)
    loaded = load_block_draft(layout, spec, target=target, model_cfg=MODEL_CFG, platform=PLATFORM)
    assert isinstance(loaded.model, Qwen3BlockDraft)
    return loaded.model, loaded.capture_layer_ids, loaded.trained_block_size


def target_rows(
    target: Qwen3Model, state: object, tokens: list[int], layer_ids: list[int]
) -> torch.Tensor:
    """Run ``tokens`` through the target state; the captured aux ``[n, K*d]``."""
    capture = [PLATFORM.capture_point(i) for i in layer_ids]
    out = target.forward(ForwardBatch(torch.tensor(tokens), [len(tokens)], [state], capture))
    assert out.aux_hidden is not None
    return out.aux_hidden


# -- a naive reference: full K/V from every aux row, explicit visibility mask -------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX RoPE of x [T, heads, hd] at positions [T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = pos[:, None].float() * inv  # [T, hd/2]
    cos, sin = ang.cos().repeat(1, 2)[:, None], ang.sin().repeat(1, 2)[:, None]
    rotated = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + rotated * sin


def naive_block(
    m: Qwen3BlockDraft, aux: torch.Tensor, tokens: torch.Tensor, head: torch.Tensor
) -> torch.Tensor:
    """Logits [W, V] of one sequence: context = every aux row [p, K*d], block at p.."""
    a, sd = m.args, {k: v.float() for k, v in m.state_dict().items()}
    eps, p, W = a.rms_norm_eps, aux.shape[0], tokens.shape[0]
    H, KV, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    ctx = rms(aux @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)  # [p, d]
    h = m._embed_weight()[tokens].float()  # [W, d]
    pos = torch.arange(p + W)
    # row i of the block sees every context position and every block row
    visible = torch.ones(W, p + W, dtype=torch.bool)
    for i in range(a.num_hidden_layers):
        L = f"layers.{i}."
        x = rms(h, sd[L + "input_layernorm.weight"], eps)
        both = torch.cat([ctx, x])  # [p+W, d]: context rows, then block rows
        q = rms(
            (x @ sd[L + "self_attn.q_proj.weight"].T).view(W, H, hd),
            sd[L + "self_attn.q_norm.weight"],
            eps,
        )
        k = rms(
            (both @ sd[L + "self_attn.k_proj.weight"].T).view(p + W, KV, hd),
            sd[L + "self_attn.k_norm.weight"],
            eps,
        )
        v = (both @ sd[L + "self_attn.v_proj.weight"].T).view(p + W, KV, hd)
        q, k = rope(q, pos[p:], a.rope_theta), rope(k, pos, a.rope_theta)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)  # [S, H, hd]
        scores = torch.einsum("whd,shd->hws", q, k) / math.sqrt(hd)
        attn = scores.masked_fill(~visible, -math.inf).softmax(-1)
        o = torch.einsum("hws,shd->whd", attn, v).reshape(W, H * hd)
        h = h + o @ sd[L + "self_attn.o_proj.weight"].T
        x = rms(h, sd[L + "post_attention_layernorm.weight"], eps)
        gate, up = x @ sd[L + "mlp.gate_proj.weight"].T, x @ sd[L + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ sd[L + "mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"], eps) @ head.float().T  # [W, V]


@pytest.mark.parametrize("layout", list(BlockLayout))
@torch.no_grad()
def test_batched_cached_forward_matches_naive(target: Qwen3Model, layout: BlockLayout) -> None:
    """Two sequences at different positions, three steps of commits of different sizes:
    the cached, ragged-batched block forward equals the naive per-sequence one."""
    m, layer_ids, _ = load(target, layout)
    W = layout.width(4)
    prompts = [ids(19, 1), ids(6, 2)]
    tstates = [target.new_state() for _ in prompts]
    caches = [m.new_cache(4) for _ in prompts]
    history = [target_rows(target, s, p, layer_ids) for s, p in zip(tstates, prompts)]
    m.write_context(caches, torch.cat(history), [len(p) for p in prompts])
    anchors = [17, 300]
    for step, commits in enumerate([(3, 1), (1, 5), (2, 2)]):
        tokens = torch.full((2, W), m.fill_token_id)
        tokens[:, 0] = torch.tensor(anchors)
        _, logits = m.forward_block(caches, tokens)  # [2, W, V]
        for b in range(2):
            assert caches[b].num_tokens == history[b].shape[0]
            want = naive_block(m, history[b], tokens[b], m._head_weight())
            diff = (logits[b] - want).abs().max().item()
            assert diff < 1e-4, f"step {step} seq {b}: max |logit diff| {diff:.3g}"
        new = [[anchors[b], *ids(commits[b] - 1, 10 * step + b)] for b in range(2)]
        rows = [target_rows(target, s, t, layer_ids) for s, t in zip(tstates, new)]
        m.write_context(caches, torch.cat(rows), list(commits))
        history = [torch.cat([h, r]) for h, r in zip(history, rows)]
        anchors = [(a * 7 + 3) % 256 for a in anchors]


def test_capture_minus_one_is_the_embedding_output(target: Qwen3Model) -> None:
    point = PLATFORM.capture_point(-1)
    assert (point.layer, point.site) == (0, CaptureSite.INPUT)
    toks = ids(9, 3)
    aux = target_rows(target, target.new_state(), toks, [-1, 2])
    d = target.hidden_size
    assert torch.equal(aux[:, :d], target.model.embed_tokens(torch.tensor(toks)))
    assert not torch.equal(aux[:, d:], aux[:, :d])


# -- config.json --------------------------------------------------------------------------


def preset_config() -> dict:
    return json.loads((tiny_draft_dir(False, BlockLayout.DSPARK) / "config.json").read_text())


@pytest.mark.parametrize(
    ("edit", "field", "want"),
    [
        ({"dspark_target_layer_ids": [0, 2]}, "target_layer_ids", [0, 2]),  # wins over target_
        ({"target_layer_ids": None, "dflash_config": {"target_layer_ids": [1]}}, "target_layer_ids", [1]),
        ({"dflash_config": {"mask_token_id": 7}}, "fill_token_id", 7),  # wins over mask_token_id
        ({"mask_token_id": None, "dspark_noise_token_id": 9}, "fill_token_id", 9),
        ({"markov_rank": None, "dspark_markov_rank": 8}, "markov_rank", 8),
        ({"block_size": None, "dflash_config": {"block_size": 16}}, "block_size", 16),
        ({"block_size": None}, "block_size", None),
        ({"enable_confidence_head": False}, "confidence", False),
    ],
)  # fmt: skip
def test_config_key_fallbacks(edit: dict, field: str, want: object) -> None:
    config = {k: v for k, v in (preset_config() | edit).items() if v is not None}
    assert getattr(parse_config(config, Path("config.json")), field) == want


def test_moe_target_config_gives_dense_draft_layers() -> None:
    cfg = parse_config(
        json.loads((tiny_draft_dir(True, BlockLayout.DSPARK) / "config.json").read_text()),
        Path("c"),
    )
    assert cfg.args.model_type == "qwen3" and not cfg.args.layer_is_sparse(0)


# -- checkpoint layouts ---------------------------------------------------------------------


def rewrite(src: Path, dst: Path, *, config: dict | None = None, tensors: dict | None = None, drop: tuple = (), prefix: str = "") -> Path:  # fmt: skip
    ckpt = Checkpoint(src)
    out = {prefix + n: t for n, t in ckpt.iter_tensors() if n not in drop}
    write_checkpoint(dst, out | (tensors or {}), ckpt.config | (config or {}))
    return dst


@torch.no_grad()
def test_prefixed_layout_and_target_vocab_draft_the_same(
    target: Qwen3Model, tmp_path: Path
) -> None:
    """``model.``-prefixed names, and no embed_tokens / lm_head (the target's are used: the
    preset's own are copies of them) draft exactly what the preset drafts."""
    src = tiny_draft_dir(False, BlockLayout.DSPARK)
    head = {"lm_head.weight": Checkpoint(src).get("lm_head.weight")}  # unprefixed, the rest not
    variants = [
        None,
        str(rewrite(src, tmp_path / "prefixed", prefix="model.")),
        str(
            rewrite(
                src, tmp_path / "mixed", drop=("lm_head.weight",), tensors=head, prefix="model."
            )
        ),
        str(rewrite(src, tmp_path / "shared", drop=("embed_tokens.weight", "lm_head.weight"))),
    ]
    toks = ids(15, 4)
    props = []
    for path in variants:
        m, layer_ids, gamma = load(target, BlockLayout.DSPARK, path)
        assert (m.embed_tokens is None) == (path == variants[-1])
        d = BlockDrafter(m, layout=BlockLayout.DSPARK, gamma=gamma, capture_layer_ids=layer_ids, device=torch.device("cpu"))  # fmt: skip
        state = d.new_state()
        aux = target_rows(target, target.new_state(), toks, layer_ids)
        nxt = torch.tensor([*toks[1:], 5])
        d.observe([state], CommittedRows(torch.tensor(toks), nxt, aux, aux, [len(toks)], [0]))
        props.append(d.propose([state], [DraftRequest(5, SamplingParams(), None, gamma)], gamma))
    for p in props[1:]:
        assert torch.equal(p.tokens, props[0].tokens)
        assert torch.equal(p.confidence, props[0].confidence)  # type: ignore[arg-type]


def test_presets_load_in_their_own_layouts(target: Qwen3Model) -> None:
    """The DSpark preset (DeepSpec) has both heads and gamma = block; the DFlash preset
    (z-lab: ``DFlashDraftModel``, ``dflash_config``) none, gamma = block - 1."""
    spec = {layout: SpecConfig(method=layout.value) for layout in BlockLayout}
    for layout in BlockLayout:
        loaded = load_block_draft(
            layout, spec[layout], target=target, model_cfg=MODEL_CFG, platform=PLATFORM
        )
        assert loaded.layout is layout and loaded.trained_block_size == 4
    m, _, _ = load(target, BlockLayout.DSPARK)
    assert m.markov is not None and m.markov.rank == 32 and m.confidence is not None
    assert m.confidence.with_markov and m.confidence.proj.bias is not None
    m, _, _ = load(target, BlockLayout.DFLASH)
    assert m.markov is None and m.confidence is None and m.embed_tokens is None


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"architectures": ["Qwen3DSparkModel"], "dflash_config": {}}, "dspark"),  # arch wins
        ({"architectures": ["DFlashDraftModel"], "dspark_markov_rank": 8}, "dflash"),
        ({"dflash_config": {"mask_token_id": 3}}, "dflash"),
        ({"dspark_target_layer_ids": [1]}, "dspark"),
        ({"architectures": ["Qwen3ForCausalLM"], "target_layer_ids": [1]}, None),
    ],
)
def test_trained_layout_is_read_from_the_config(config: dict, want: str | None) -> None:
    assert trained_layout(config)[0] == want


def test_method_that_cannot_use_the_draft_is_refused_naming_the_other(target: Qwen3Model) -> None:
    """A DSpark draft with heads under spec=dflash, a z-lab DFlash draft under spec=dspark:
    either would read every block row one position off (the old behaviour, silently)."""
    dspark, dflash = (str(tiny_draft_dir(False, layout)) for layout in BlockLayout)
    with pytest.raises(CheckpointError, match=r"DSpark draft .*Qwen3DSparkModel.* with a Markov head \(markov_rank=32\) and a confidence head, .* use it with spec=dspark"):  # fmt: skip
        load(target, BlockLayout.DFLASH, dspark)
    with pytest.raises(CheckpointError, match=r"DFlash draft .*DFlashDraftModel.*use it with spec=dflash"):  # fmt: skip
        load(target, BlockLayout.DSPARK, dflash)
    [problem] = DFlashDrafter.preflight(SpecConfig(method="dflash", draft_path=dspark), MODEL_CFG)
    assert problem.startswith(f"spec=dflash draft {dspark}: ") and "spec=dspark" in problem


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_a_deepseek_v4_dspark_dir_as_qwen3_draft_names_the_real_problem(method: str) -> None:
    """Regression: the family mismatch was dropped ("invalid ... config (0 problem(s))")."""
    import xspec
    from xspec.__main__ import check_jobs

    dsv4 = Path(xspec.__file__).parent / "assets" / "dsv4_tiny_dspark"
    overrides = ["model=qwen3_tiny", f"spec={method}", f"spec.draft_path={dsv4}"]
    with pytest.raises(ConfigError) as e:
        check_jobs([overrides])
    msg = str(e.value)
    assert "this is a DeepSeek-V4 DSpark checkpoint ('deepseek_v4'), not a Qwen3" in msg, msg
    assert "model=dsv4_flash spec=dspark" in msg and "0 problem(s)" not in msg, msg


# -- preflight: every problem, before any allocation -------------------------------------


def w2(rank: int) -> dict:
    return {"markov_head.markov_w2.weight": torch.zeros(512, rank)}


PREFLIGHT_CASES = {
    "hidden": ({"config": {"hidden_size": 64}}, "hidden_size is 64 but the target's is 128"),
    "vocab": ({"config": {"vocab_size": 300}}, "vocab_size is 300 but the target's is 512"),
    "layer_id": ({"config": {"target_layer_ids": [-1, 1, 4]}}, "target layer ids [4] are outside -1..3"),
    "layer_id_neg": ({"config": {"target_layer_ids": [-2, 1, 2]}}, "target layer ids [-2] are outside"),
    "mask": ({"config": {"mask_token_id": 512}}, "'mask_token_id' = 512 is outside the draft vocabulary"),
    "markov_type": ({"config": {"markov_head_type": "gated"}}, "markov_head_type='gated' is not supported yet"),
    "no_layer_ids": ({"config": {"target_layer_ids": None}}, "missing key: one of ['dspark_target_layer_ids'"),
    "w2_rank": ({"tensors": w2(16)}, "'markov_head.markov_w2.weight' in model.safetensors has shape [512, 16], expected [512, 32]"),
    "missing": ({"drop": ("norm.weight",)}, "missing: no tensor provides 'norm.weight'"),
    "unexpected": ({"tensors": {"layers.7.mlp.up_proj.weight": torch.zeros(2)}}, "unexpected tensor 'layers.7.mlp.up_proj.weight'"),
    "misshapen": ({"tensors": {"fc.weight": torch.zeros(128, 256)}}, "'fc.weight' in model.safetensors has shape [128, 256], expected [128, 384]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PREFLIGHT_CASES))
def test_preflight_errors(tmp_path: Path, case: str) -> None:
    edits, want = PREFLIGHT_CASES[case]
    config = edits.get("config")
    src = tiny_draft_dir(False, BlockLayout.DSPARK)
    path = tmp_path / "draft"
    rewrite(src, path, tensors=edits.get("tensors"), drop=edits.get("drop", ()))
    if config:
        merged = {k: v for k, v in (Checkpoint(path).config | config).items() if v is not None}
        (path / "config.json").write_text(json.dumps(merged))
    spec = SpecConfig(method="dspark", draft_path=str(path))
    problems = DSparkDrafter.preflight(spec, MODEL_CFG)
    assert any(want in p for p in problems), problems
    assert all(str(path) in p for p in problems)  # every message names the draft directory


def test_preflight_directories(tmp_path: Path) -> None:
    assert DSparkDrafter.preflight(SpecConfig(method="dspark"), MODEL_CFG) == []
    assert DFlashDrafter.preflight(SpecConfig(method="dflash"), MODEL_CFG) == []
    nowhere = SpecConfig(method="dflash", draft_path=str(tmp_path / "nowhere"))
    assert "does not exist" in DFlashDrafter.preflight(nowhere, MODEL_CFG)[0]
    own = ModelConfig(arch="qwen3", path=str(Checkpoint(tiny_draft_dir(False, BlockLayout.DSPARK)).path.parent / "qwen3_tiny-1"))  # fmt: skip
    msg = DSparkDrafter.preflight(SpecConfig(method="dspark"), own)
    assert len(msg) == 1 and "set spec.draft_path=" in msg[0], msg


def test_preflight_runs_before_the_target_is_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import xspec

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target was loaded before the draft's problems were reported")

    # header checks may build shape-only (meta) modules; no weights may stream in
    monkeypatch.setattr("xspec.models.loading.load_params", refuse)
    monkeypatch.setattr("xspec.models.qwen3.block_drafts.load_params", refuse)
    path = rewrite(tiny_draft_dir(False, BlockLayout.DSPARK), tmp_path / "d", drop=("fc.weight",))
    with pytest.raises(ConfigError, match=r"no tensor provides 'fc\.weight'"):
        xspec.LLM(
            model="qwen3_tiny",
            spec="dspark",
            platform="cpu",
            overrides={"spec.draft_path": str(path)},
        )


# -- the heads --------------------------------------------------------------------------------


def test_confidence_batched_equals_per_position() -> None:
    torch.manual_seed(0)
    head = ConfidenceHead(16, 4, bias=True, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
    h, e = torch.randn(3, 5, 16), torch.randn(3, 5, 4)
    batched = head(h, e)  # [3, 5]
    per_position = torch.stack([head(h[:, k], e[:, k]) for k in range(5)], 1)
    assert batched.shape == (3, 5)
    assert torch.allclose(batched, per_position, atol=1e-6, rtol=0)


def test_markov_bias_is_added_to_raw_logits_before_temperature() -> None:
    """base [2, 1, 0] + bias(prev=0) [0, 1.5, -1] = [2, 2.5, -1]: token 1 wins, at any
    temperature. Adding the bias after dividing by T=0.5 would give [4, 3.5, -1]: token 0."""
    markov = MarkovHead(3, 1, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        markov.markov_w1.weight.copy_(torch.tensor([[1.0], [0.0], [2.0]]))
        markov.markov_w2.weight.copy_(torch.tensor([[0.0], [1.5], [-1.0]]))
    base = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 0.1]]])  # [B=1, G=2, V=3]
    anchor = torch.tensor([0])
    tokens, probs, prev = sample_block(base, anchor, markov, [SamplingParams()], [None])
    assert tokens.tolist() == [[1, 2]] and prev.tolist() == [[0, 1]]  # prev = the sampled draft
    hot = SamplingParams(temperature=0.5, seed=0)
    gen = torch.Generator().manual_seed(0)
    _, probs, _ = sample_block(base[:, :1], anchor, markov, [hot], [gen])
    want = torch.softmax(torch.tensor([2.0, 2.5, -1.0]) / 0.5, -1)
    assert torch.allclose(probs[0, 0], want) and int(probs[0, 0].argmax()) == 1


def test_cache_grows_by_doubling(target: Qwen3Model) -> None:
    m, _layer_ids, _ = load(target, BlockLayout.DSPARK)
    cache: DraftCache = m.new_cache(4)
    caps = []
    for n in (3, 20, 1, 40):
        aux = torch.randn(n, 3 * 128)
        m.write_context([cache], aux, [n])
        caps.append(cache.capacity)
    assert cache.num_tokens == 64 and caps == [16, 32, 32, 64]


# -- the DeepSpec reference (slow; skipped without its source snapshot) -------------------

DEEPSPEC_MIRROR = Path("/work/.mirror/deepseek-ai+DeepSpec/repo")


@pytest.fixture(scope="module")
def deepspec(tmp_path_factory: pytest.TempPathFactory) -> object:
    """DeepSpec's draft code, extracted from a local snapshot of its repository."""
    pytest.importorskip("transformers")
    if not DEEPSPEC_MIRROR.exists():
        pytest.skip(f"no DeepSpec snapshot at {DEEPSPEC_MIRROR}")
    root = tmp_path_factory.mktemp("deepspec")
    archive = subprocess.run(
        ["git", "-C", str(DEEPSPEC_MIRROR), "archive", "HEAD", "deepspec"],
        capture_output=True,
        check=False,
    )
    if archive.returncode:
        pytest.skip(f"cannot read the DeepSpec snapshot: {archive.stderr.decode()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    sys.path.insert(0, str(root))
    try:
        import deepspec.eval.dspark.draft_ops as ops
        from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    except ImportError as e:
        pytest.skip(f"DeepSpec does not import here: {e}")
    finally:
        sys.path.remove(str(root))
    return ops, Qwen3DSparkModel


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("method", ["dspark", "dflash"])
@torch.no_grad()
def test_greedy_proposals_match_deepspec(
    target: Qwen3Model, deepspec: tuple, method: str, tmp_path: Path
) -> None:
    """The preset DSpark draft under spec=dspark, and a DeepSpec DFlash draft under
    spec=dflash, loaded by DeepSpec's ``Qwen3DSparkModel`` and by xspec, fed the same
    target hidden states over four decode steps (batch 1, temperature 0): identical
    drafts, base logits and confidences."""
    from transformers import DynamicCache

    ops, model_cls = deepspec

    class Cache(DynamicCache):  # DeepSpec calls transformers' older crop(max_length)
        def crop(self, max_length: int) -> None:
            if max_length < self.get_seq_length():
                super().crop(max_length - self.get_seq_length())

    dspark = method == "dspark"
    path = tiny_draft_dir(False, BlockLayout.DSPARK) if dspark else deepspec_dflash_dir(tmp_path)
    ref = model_cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    spec = SpecConfig(method=method, draft_path=str(path))
    loaded = load_block_draft(
        BlockLayout(method), spec, target=target, model_cfg=MODEL_CFG, platform=PLATFORM
    )
    m, layer_ids, gamma = loaded.model, loaded.capture_layer_ids, loaded.trained_block_size
    assert isinstance(m, Qwen3BlockDraft) and (m.confidence is None) != dspark
    d = BlockDrafter(m, layout=loaded.layout, gamma=gamma, capture_layer_ids=layer_ids, device=torch.device("cpu"))  # fmt: skip
    toks, anchor, tstate = ids(23, 5), 77, target.new_state()
    aux = target_rows(target, tstate, toks, layer_ids)
    state, cache, start = d.new_state(), Cache(), len(toks)
    nxt = torch.tensor([*toks[1:], anchor])
    d.observe([state], CommittedRows(torch.tensor(toks), nxt, aux, aux, [len(toks)], [0]))
    worst = 0.0
    for step in range(4):
        block = torch.full((1, gamma), m.fill_token_id)
        block[0, 0] = anchor
        hidden = ops.forward_dspark_draft_block(
            ref, draft_input_ids=block, position_ids=torch.arange(4096)[None],
            past_key_values_draft=cache, target_hidden_states=aux[None], start=start,
            block_size=gamma,
        )  # fmt: skip
        want = ops.build_dspark_proposal(
            ref, draft_input_ids=block, block_hidden=hidden, block_size=gamma,
            temperature=0.0, confidence_threshold=0.0,
        )  # fmt: skip
        got = d.propose([state], [DraftRequest(anchor, SamplingParams(), None, gamma)], gamma)
        assert got.tokens.tolist() == want.verify_input_ids[:, 1:].tolist(), f"step {step}"
        diff = (m.forward_block([state], block)[1] - ref.compute_logits(hidden)).abs().max()
        worst = max(worst, diff.item())
        if dspark:
            conf = want.confidence_logits.sigmoid()
            assert torch.allclose(got.confidence, conf, atol=1e-5), f"step {step}"  # type: ignore[arg-type]
        else:
            assert got.confidence is None and want.confidence_logits is None
        committed = [anchor, *got.tokens[0, :2].tolist()]  # accept two drafts
        aux = target_rows(target, tstate, committed, layer_ids)
        anchor = (int(got.tokens[0, 2]) + 5) % 512  # a correction token
        nxt = torch.tensor([*committed[1:], anchor])
        d.observe([state], CommittedRows(torch.tensor(committed), nxt, aux, aux, [3], [start]))
        start += 3
    print(f"DeepSpec vs xspec: max |base logit diff| {worst:.3g}")
    assert worst < 1e-4


def deepspec_dflash_dir(path: Path) -> Path:
    """A draft directory as DeepSpec's ``config/dflash/*.py`` trains it: ``Qwen3DSparkModel``
    with ``markov_rank`` 0 and no confidence head; ``block_size`` = gamma (the DSpark block
    ``[anchor, noise x (gamma-1)]``, not z-lab's ``[anchor, mask x gamma]``)."""
    src = tiny_draft_dir(False, BlockLayout.DSPARK)
    heads = tuple(n for n in Checkpoint(src).names() if n.startswith(HEAD_PREFIXES))
    config = {
        "markov_rank": 0,
        "enable_confidence_head": False,
        "markov_head_type": None,  # DeepSpec writes neither key without the heads
        "confidence_head_with_markov": None,
    }
    rewrite(src, path, config=config, drop=heads)
    kept = {k: v for k, v in Checkpoint(path).config.items() if v is not None}
    (path / "config.json").write_text(json.dumps(kept))
    return path


def test_dspark_layout_without_markov_head(tmp_path: Path) -> None:
    """DeepSpec's DFlash configs: the sample-from-anchor block with markov_rank 0 (no
    Markov or confidence head) runs under spec=dspark, exactly."""
    import xspec

    path = deepspec_dflash_dir(tmp_path / "d")
    base = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu")
    llm = xspec.LLM(
        model="qwen3_tiny", spec="dspark", platform="cpu", overrides={"spec.draft_path": str(path)}
    )
    model = llm._built.drafter.model  # type: ignore[attr-defined]
    assert model.markov is None and model.confidence is None
    prompts = [[5, 6, 7, 8], [9, 10]]
    want = [g.token_ids for g in base.generate(prompts, 12, ignore_eos=True)]
    assert [g.token_ids for g in llm.generate(prompts, 12, ignore_eos=True)] == want
