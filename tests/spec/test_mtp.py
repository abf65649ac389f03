"""``spec=mtp`` on the dsv4_tiny_random preset: exact greedy equality with the baseline, the
drafter against a written-out reference, the exported layout, preflight errors, sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import xspec
from xspec.config import ModelConfig, PlatformConfig, SpecConfig
from xspec.errors import ConfigError
from xspec.models.base import EAGER_STEPS, ForwardBatch
from xspec.models.deepseek_v4 import load_model
from xspec.models.deepseek_v4.model import DeepseekV4Model
from xspec.models.deepseek_v4.mtp import EXPORTED_MODEL_TYPE
from xspec.models.deepseek_v4.state import BlockContext
from xspec.models.deepseek_v4.tiny import tiny_dir
from xspec.models.loading import Checkpoint, write_checkpoint
from xspec.platforms.cpu import CpuPlatform
from xspec.sampling import SamplingParams, logits_to_probs, make_generator
from xspec.spec.drafter import CommittedRows, DraftRequest
from xspec.spec.mtp import MtpDrafter


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# 120 + 40 new tokens crosses the 128-token window and the first 128-compression entry
# during decode; 250 wraps the SWA ring in prefill and crosses 256 while decoding; CSA
# (ratio 4) boundaries are crossed every 4 tokens, so every rollback depth hits one.
PROMPTS = [ids(120, 1), ids(250, 2), ids(7, 3)]
NEW = 40


def build(spec: str, **overrides: object) -> xspec.LLM:
    return xspec.LLM(model="dsv4_tiny_random", spec=spec, platform="cpu", overrides=overrides)


@pytest.fixture(scope="module")
def baseline() -> xspec.LLM:
    return build("none")


@pytest.fixture(scope="module")
def reference_tokens(baseline: xspec.LLM) -> dict[int, list[list[int]]]:
    """Baseline greedy outputs of PROMPTS, per concurrency."""
    return {
        c: [g.token_ids for g in baseline.generate(PROMPTS, NEW, ignore_eos=True, concurrency=c)]
        for c in (1, 2, 3)
    }


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_greedy_equals_baseline_batched(reference_tokens: dict, gamma: int) -> None:
    llm = build("mtp", **{"spec.num_speculative_tokens": gamma})
    outs = llm.generate(PROMPTS, NEW, ignore_eos=True, concurrency=3)
    assert [o.token_ids for o in outs] == reference_tokens[3]
    report = llm.metrics.report()
    # every row drafted gamma, except where the request's budget had room for fewer
    assert report.num_draft_tokens <= gamma * report.num_row_steps
    assert report.num_committed_tokens == 3 * (NEW - 1)  # the first token comes from prefill


@pytest.mark.parametrize("concurrency", [1, 2])
def test_greedy_equals_baseline_continuous_batching(
    reference_tokens: dict, concurrency: int
) -> None:
    """Requests admitted as slots free up, each with its own MTP state. With 2 slots the
    first two finish at different steps (accepted drafts), so the third is admitted while
    the other one is still decoding."""
    llm = build("mtp", **{"spec.num_speculative_tokens": 2})
    outs = llm.generate(PROMPTS, NEW, ignore_eos=True, concurrency=concurrency)
    assert [o.token_ids for o in outs] == reference_tokens[concurrency]
    if concurrency == 2:  # the premise: the first two did finish at different steps
        assert outs[0].num_steps != outs[1].num_steps


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_greedy_equals_baseline_long(baseline: xspec.LLM, gamma: int) -> None:
    """Longer runs, continuous batching (4 requests, 2 slots), several 128-boundaries."""
    prompts = [ids(300, 4), ids(130, 5), ids(3, 6), ids(200, 7)]
    want = baseline.generate(prompts, 220, ignore_eos=True, concurrency=2)
    llm = build("mtp", **{"spec.num_speculative_tokens": gamma})
    got = llm.generate(prompts, 220, ignore_eos=True, concurrency=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_sampled_runs_are_reproducible() -> None:
    llm = build("mtp", **{"spec.num_speculative_tokens": 2})
    runs = [
        llm.generate(PROMPTS[::2], 30, temperature=0.8, seed=11, ignore_eos=True) for _ in range(2)
    ]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(len(o.token_ids) == 30 for o in runs[0])
    other = llm.generate(PROMPTS[::2], 30, temperature=0.8, seed=12, ignore_eos=True)
    assert [o.token_ids for o in other] != [o.token_ids for o in runs[0]]


# -- the drafter against a written-out reference -------------------------------------------


MODEL_CFG = ModelConfig(arch="deepseek_v4", preset="tiny_random")


@pytest.fixture(scope="module")
def target() -> DeepseekV4Model:
    return load_model(MODEL_CFG, device=torch.device("cpu"), max_rollback=8)


def drafter(target: DeepseekV4Model, gamma: int, draft_path: str | None = None) -> MtpDrafter:
    spec = SpecConfig(method="mtp", num_speculative_tokens=gamma, draft_path=draft_path)
    return MtpDrafter(
        spec,
        target=target,
        model_cfg=MODEL_CFG,
        platform=CpuPlatform(PlatformConfig(name="cpu")),
        steps=EAGER_STEPS,
    )


def reference_chain(
    d: MtpDrafter, hidden: torch.Tensor, nxt: torch.Tensor, drafts: list[int]
) -> list[torch.Tensor]:
    """Fresh MTP cache over all committed rows (``hidden [n, hc, d]``, ``nxt [n]``), then one
    chained row per given draft: the logits ``[V]`` each draft position was sampled from."""
    m = d.module
    n = nxt.shape[0]
    cache = m.new_cache(max_rollback=0, max_context=4096)
    x = m.draft_hidden(hidden, nxt, BlockContext(nxt, torch.arange(n), [n], [0], [cache]))[-1:]
    out = [m.draft_logits(x)[0]]
    for k, tok in enumerate(drafts[:-1]):
        t = torch.tensor([tok])
        ctx = BlockContext(t, torch.tensor([n + k]), [1], [n + k], [cache])
        x = m.draft_hidden(x, t, ctx, own=True)  # chained: the MTP's own hidden
        out.append(m.draft_logits(x)[0])
    return out


@torch.no_grad()
def test_drafter_matches_reference_across_steps(target: DeepseekV4Model) -> None:
    """Two sequences at different positions: prefill, propose (greedy), a verify step with
    2 accepted drafts committed, propose again (sampled) -> every draft distribution equals
    the MTP run from scratch over the committed context, and the MTP state is rolled back."""
    gamma = 3
    d = drafter(target, gamma)
    prompts = [torch.tensor(ids(140, 8)), torch.tensor(ids(9, 9))]
    firsts = [17, 300]
    states, tstates = [d.new_state() for _ in prompts], [target.new_state() for _ in prompts]
    out = target.forward(ForwardBatch(torch.cat(prompts), [len(p) for p in prompts], tstates))
    hidden = list(out.hidden.split([len(p) for p in prompts]))
    nxt = [torch.cat([p[1:], torch.tensor([f])]) for p, f in zip(prompts, firsts)]
    lens = [len(p) for p in prompts]
    d.observe(
        states, CommittedRows(torch.cat(prompts), torch.cat(nxt), out.hidden, None, lens, [0, 0])
    )

    greedy = [DraftRequest(f, SamplingParams(), None, max_drafts=gamma) for f in firsts]
    prop = d.propose(states, greedy, gamma)
    assert prop.probs is None and prop.tokens.shape == (2, gamma)
    for b in range(2):
        assert states[b].num_tokens == len(prompts[b])  # speculative rows rolled back
        want = [
            int(lg.argmax())
            for lg in reference_chain(d, hidden[b], nxt[b], prop.tokens[b].tolist())
        ]
        assert prop.tokens[b].tolist() == want

    # verify [anchor, d1, d2, d3]; accept d1, d2; the correction c becomes the new anchor
    rows = torch.cat([torch.tensor(firsts)[:, None], prop.tokens], 1)  # [2, gamma+1]
    verify = target.forward(ForwardBatch(rows.flatten(), [gamma + 1] * 2, tstates))
    committed = []
    for b in range(2):
        target.truncate(tstates[b], len(prompts[b]) + 3)
        c = (int(prop.tokens[b, 2]) + 1) % 512
        new_next = torch.cat([prop.tokens[b, :2], torch.tensor([c])])
        h = verify.hidden[b * (gamma + 1) : b * (gamma + 1) + 3]
        committed.append((rows[b, :3], new_next, h))
        hidden[b], nxt[b] = torch.cat([hidden[b], h]), torch.cat([nxt[b], new_next])
    ins, outs, hs = (torch.cat(t) for t in zip(*committed))
    d.observe(states, CommittedRows(ins, outs, hs, None, [3, 3], lens))

    params = [SamplingParams(temperature=0.8, top_k=50, seed=s) for s in (1, 2)]
    sampled = [
        DraftRequest(int(n[-1]), p, make_generator(p), max_drafts=gamma)
        for n, p in zip(nxt, params)
    ]
    prop = d.propose(states, sampled, gamma)
    assert prop.probs is not None and prop.probs.shape == (2, gamma, 512)
    for b in range(2):
        assert states[b].num_tokens == len(nxt[b])
        logits = reference_chain(d, hidden[b], nxt[b], prop.tokens[b].tolist())
        want = logits_to_probs(torch.stack(logits), [params[b]] * gamma)  # [gamma, V]
        diff = (prop.probs[b] - want).abs().max().item()
        assert diff <= 1e-5, f"draft q differs from the reference: max abs diff {diff:.3g}"
        assert (prop.probs[b].gather(1, prop.tokens[b][:, None]) > 0).all()  # drafts are in q


# -- the exported layout -------------------------------------------------------------------


def export_preset(path: Path, *, vocab: bool, **config_overrides: object) -> Path:
    """An xLLM export_mtp-style copy of the preset's ``mtp.0.*`` (``model.layers.0.*``)."""
    ckpt = Checkpoint(tiny_dir())
    names = [n for n in ckpt.names() if n.startswith("mtp.0.")]
    tensors = {"model.layers.0." + n[len("mtp.0.") :]: t for n, t in ckpt.iter_tensors(names)}
    if vocab:  # copies of the target's, under the exported names
        tensors["model.embed_tokens.weight"] = ckpt.get("embed.weight").clone()
        tensors["model.layers.0.shared_head.head.weight"] = ckpt.get("head.weight").clone()
    config = ckpt.config | {
        "model_type": EXPORTED_MODEL_TYPE,
        "architectures": ["DeepseekV4MtpForCausalLM"],
        "num_hidden_layers": 1,
        "num_hash_layers": 0,
        "quantization_config": "",
        **config_overrides,
    }
    write_checkpoint(path, tensors, config)
    return path


@pytest.mark.parametrize("vocab", [False, True], ids=["shared-vocab", "exported-vocab"])
@torch.no_grad()
def test_exported_layout_drafts_like_the_official(
    target: DeepseekV4Model, tmp_path: Path, vocab: bool
) -> None:
    official = drafter(target, 3)
    exported = drafter(target, 3, str(export_preset(tmp_path / "mtp", vocab=vocab)))
    assert exported.module.owns_vocab == (vocab, vocab)
    prompt = torch.tensor(ids(30, 10))
    h = target.forward(ForwardBatch(prompt, [30], [target.new_state()])).hidden
    rows = CommittedRows(prompt, torch.cat([prompt[1:], torch.tensor([5])]), h, None, [30], [0])
    props = []
    for d in (official, exported):
        state = d.new_state()
        d.observe([state], rows)
        p = SamplingParams(temperature=0.8, seed=3)
        props.append(d.propose([state], [DraftRequest(5, p, make_generator(p), max_drafts=3)], 3))
    assert torch.equal(props[0].tokens, props[1].tokens)
    assert props[0].probs is not None and props[1].probs is not None
    assert torch.equal(props[0].probs, props[1].probs)


@torch.no_grad()
def test_quarot_target_drafts_like_the_original(target: DeepseekV4Model, tmp_path: Path) -> None:
    """A QuaRot-rotated target (hidden H R) with ``rot.weight = R`` and dedicated MTP
    vocabulary in the original basis drafts what the unrotated model drafts."""
    from xspec.models.deepseek_v4.convert import quarot_rotate

    src = Checkpoint(tiny_dir())
    dedicated = {
        "mtp.0.embed.weight": src.get("embed.weight").clone(),
        "mtp.0.head.weight": src.get("head.weight").clone(),
    }
    write_checkpoint(tmp_path / "src", dict(src.iter_tensors()) | dedicated, src.config)
    quarot_rotate(tmp_path / "src", tmp_path / "rot", seed=1)
    rotated = load_model(
        ModelConfig(arch="deepseek_v4", path=str(tmp_path / "rot")),
        device=torch.device("cpu"),
        max_rollback=8,
    )
    prompt = torch.tensor(ids(150, 11))
    props = []
    for model in (target, rotated):
        d = drafter(model, 3)
        h = model.forward(ForwardBatch(prompt, [150], [model.new_state()])).hidden
        state = d.new_state()
        nxt = torch.cat([prompt[1:], torch.tensor([9])])
        d.observe([state], CommittedRows(prompt, nxt, h, None, [150], [0]))
        p = SamplingParams(temperature=0.8, seed=4)
        props.append(d.propose([state], [DraftRequest(9, p, make_generator(p), max_drafts=3)], 3))
    assert d.module.rot is not None and d.module.owns_vocab == (True, True)
    assert torch.equal(props[0].tokens, props[1].tokens)
    diff = (props[0].probs - props[1].probs).abs().max().item()  # type: ignore[operator]
    assert diff <= 1e-4, f"rotated vs original draft q: max abs diff {diff:.3g}"


# -- errors before any target weight is allocated ---------------------------------------------


@pytest.fixture
def no_target_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target was loaded before the drafter's problems were reported")

    monkeypatch.setattr("xspec.models.deepseek_v4.weights.load_checkpoint", refuse)


@pytest.fixture(scope="module")
def target_without_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = Checkpoint(tiny_dir())
    names = [n for n in ckpt.names() if not n.startswith("mtp.")]
    path = tmp_path_factory.mktemp("no_mtp") / "ckpt"
    write_checkpoint(path, dict(ckpt.iter_tensors(names)), ckpt.config)
    return path


@pytest.mark.usefixtures("no_target_loading")
def test_preflight_errors(tmp_path: Path, target_without_mtp: Path) -> None:
    def error(model: str = "dsv4_tiny_random", **overrides: object) -> str:
        with pytest.raises(ConfigError) as e:
            xspec.LLM(model=model, spec="mtp", platform="cpu", overrides=overrides)
        return str(e.value)

    assert "spec=mtp drafts between 1 and 16" in error(**{"spec.num_speculative_tokens": 17})
    msg = error(**{"model.path": str(target_without_mtp)})
    assert f"the checkpoint at {target_without_mtp} has no mtp.0.* tensors" in msg
    assert "set spec.draft_path=/dir/of/exported/mtp" in msg
    bad = export_preset(tmp_path / "small", vocab=False, hidden_size=128, vocab_size=300)
    msg = error(**{"spec.draft_path": str(bad)})
    assert "hidden_size is 128 but the target's is 256" in msg
    assert "vocab_size is 300 but the target's is 512" in msg
    assert "does not exist" in error(**{"spec.draft_path": str(tmp_path / "nowhere")})
    assert "needs a DeepSeek-V4 target" in error(model="qwen3_tiny")


@pytest.mark.usefixtures("no_target_loading")
def test_preflight_names_a_bad_draft_tensor(tmp_path: Path) -> None:
    path = export_preset(tmp_path / "mtp", vocab=False)
    config = json.loads((path / "config.json").read_text())
    config["moe_intermediate_size"] = 64  # the experts on disk are 128 wide
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError,
        match=r"'model.layers.0.ffn.experts.0.w1.weight' .* has shape \[128, 256\], expected \[64, 256\]",
    ):
        build("mtp", **{"spec.draft_path": str(path)})


def test_preflight_accepts_both_layouts(tmp_path: Path) -> None:
    spec = SpecConfig(method="mtp", num_speculative_tokens=2)
    assert MtpDrafter.preflight(spec, MODEL_CFG) == []
    spec.draft_path = str(export_preset(tmp_path / "mtp", vocab=True))
    assert MtpDrafter.preflight(spec, MODEL_CFG) == []
