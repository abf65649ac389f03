"""``spec=dspark`` on DeepSeek-V4 (dsv4_tiny_random + its 0731-layout companion): exact greedy
equality with the baseline at every gamma and SAS mode, with drafts that really get
accepted; the Markov loop's q; the distribution through the Markov loop; gamma defaults;
the NPU runtime SAS fallback; CLI on the NPU policy."""

from __future__ import annotations

import itertools
import logging
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

import xspec
from tests.platforms.conformance import NativeSas, PlatformCfg
from xspec.errors import PlatformError
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.dspark import DraftWindow
from xspec.models.deepseek_v4.tiny import dspark_config, dspark_tensors
from xspec.models.draft_heads import MarkovHead
from xspec.models.loading import Checkpoint, write_checkpoint
from xspec.platforms.base import SasMode
from xspec.platforms.npu.emulated import NpuPolicyCpuPlatform
from xspec.sampling import SamplingParams, logits_to_probs, sample
from xspec.spec.block import sample_block
from xspec.spec.processors import DraftProcessors, Processors, process_rows
from xspec.spec.verify import rejection_sample


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 511, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# 115 + 20 crosses the 128-token window while decoding, 250 wraps it in prefill and crosses
# the 256 (2 x 128 compression) boundary; ratio-4 boundaries are crossed every 4 tokens.
PROMPTS = [ids(115, 1), ids(250, 2), ids(7, 3)]
NEW = 20
RANK = 128  # > distinct tokens of the baseline's output: one Markov direction each


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    llm = xspec.LLM(model="dsv4_tiny_random", spec="none", platform="cpu")
    return [g.token_ids for g in llm.generate(PROMPTS, NEW, ignore_eos=True)]


@pytest.fixture(scope="module")
def forced_draft(tmp_path_factory: pytest.TempPathFactory, baseline: list[list[int]]) -> Path:
    """A 0731-layout draft whose Markov head encodes the baseline's bigrams (weight 100):
    its drafts follow the target's greedy text where that text is a function of the
    previous token, so verify steps accept, reject and roll back at every depth."""
    config = dspark_config(DeepseekV4Args.tiny(), markov_rank=RANK)
    tensors = dspark_tensors(config, 11)
    nxt: dict[int, Counter] = defaultdict(Counter)
    for prompt, out in zip(PROMPTS, baseline):
        seq = prompt[-1:] + out
        for a, b in itertools.pairwise(seq):
            nxt[a][b] += 1
    w1 = torch.zeros(512, RANK)
    w2 = torch.zeros(512, RANK)
    for slot, (a, counts) in enumerate(sorted(nxt.items())):
        w1[a, slot], w2[counts.most_common(1)[0][0], slot] = 10.0, 10.0
    tensors["mtp.2.markov_head.markov_w1.weight"] = w1
    tensors["mtp.2.markov_head.markov_w2.weight"] = w2
    path = tmp_path_factory.mktemp("forced_dspark")
    write_checkpoint(path, tensors, config)
    return path


@pytest.mark.parametrize("native_sas", ["auto", "off"])  # CPU: native, compatibility
@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 6])
def test_greedy_equals_baseline(
    baseline: list[list[int]], forced_draft: Path, gamma: int, native_sas: str
) -> None:
    llm = xspec.LLM(
        model="dsv4_tiny_random",
        spec="dspark",
        platform="cpu",
        overrides={
            "spec.draft_path": str(forced_draft),
            "spec.num_speculative_tokens": gamma,
            "platform.native_sas": native_sas,
        },
    )
    mode = llm._built.drafter.model.stages[0].window.mode  # type: ignore[attr-defined]
    assert mode is (SasMode.NATIVE if native_sas == "auto" else SasMode.COMPAT)
    out = llm.generate(PROMPTS, NEW, ignore_eos=True)
    assert [g.token_ids for g in out] == baseline
    rep = llm.metrics.report()
    assert rep.num_accepted_tokens > 0 and rep.num_full_blocks < rep.num_drafts  # accepts, rejects
    counts = rep.accepted_per_position
    assert all(a >= b for a, b in itertools.pairwise(counts))
    assert rep.num_committed_tokens == rep.num_accepted_tokens + rep.num_row_steps
    assert len(rep.calibration) == gamma  # the draft's confidence head, per position
    assert all(0.0 <= p <= 1.0 and 0.0 <= r <= 1.0 for p, r in rep.calibration)


def test_continuous_batching_and_default_preset(baseline: list[list[int]]) -> None:
    """The preset companion (random stages, gamma = the trained 5), requests admitted as
    others finish."""
    llm = xspec.LLM(model="dsv4_tiny_random", spec="dspark", platform="cpu")
    assert llm._built.drafter.gamma == 5
    out = llm.generate(PROMPTS, NEW, ignore_eos=True, concurrency=2)
    assert [g.token_ids for g in out] == baseline


def test_gamma_override_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        llm = xspec.LLM(
            model="dsv4_tiny_random",
            spec="dspark",
            platform="cpu",
            overrides={"spec.num_speculative_tokens": 3},
        )
    assert llm._built.drafter.gamma == 3
    assert "spec=dspark draft was trained to draft 5 per step" in caplog.text


def test_capture_points_follow_the_platform() -> None:
    """Raw ids [2, 3, 4] in config order: output of L on the CPU, input of L+1 on the NPU
    policy; both read the same hidden states, so the drafts agree."""
    cpu = xspec.LLM(model="dsv4_tiny_random", spec="dspark", platform="cpu")
    npu = xspec.LLM(model="dsv4_tiny_random", spec="dspark", platform="npu_emulated")
    assert cpu._built.drafter.capture_layer_ids == [2, 3, 4]
    assert [p.layer for p in npu._built.capture] == [3, 4, 5]
    prompts = PROMPTS[2:]
    a = cpu.generate(prompts, 8, temperature=0.9, seed=3, ignore_eos=True)
    b = npu.generate(prompts, 8, temperature=0.9, seed=3, ignore_eos=True)
    assert a[0].token_ids == b[0].token_ids


def test_npu_runtime_fallback_to_compatibility(
    baseline: list[list[int]], forced_draft: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The probe says native, the operator rejects explicit indices when called: the draft
    falls back once, with a logged reason, and the output is unchanged."""
    llm = xspec.LLM(
        model="dsv4_tiny_random",
        spec="dspark",
        platform="npu_emulated",
        overrides={"spec.draft_path": str(forced_draft)},
    )
    rejecting = NpuPolicyCpuPlatform(
        PlatformCfg(name="npu_emulated", native_sas=NativeSas.auto),
        operator_rejects_at_run_time=True,
    )
    window = DraftWindow(rejecting)
    assert window.mode is SasMode.NATIVE
    llm._built.drafter.model.set_window(window)  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING):
        out = llm.generate(PROMPTS, NEW, ignore_eos=True)
    assert [g.token_ids for g in out] == baseline
    assert window.mode is SasMode.COMPAT
    assert caplog.text.count("falling back to the compatibility layout") == 1

    strict = NpuPolicyCpuPlatform(
        PlatformCfg(name="npu_emulated", native_sas=NativeSas.on),
        operator_rejects_at_run_time=True,
    )
    llm._built.drafter.model.set_window(DraftWindow(strict))  # type: ignore[attr-defined]
    with pytest.raises(PlatformError, match="native_sas=on"):
        llm.generate(PROMPTS[2:], 4, ignore_eos=True)


def test_cli_headline_on_the_npu_policy(tmp_path: Path, xspec_cache: Path) -> None:
    from tests.test_cli import run_cli

    r = run_cli(
        "model=dsv4_tiny_random", "spec=dspark", "platform=npu_emulated",
        "workload.max_new_tokens=8", "workload.num_requests=2", cache=xspec_cache, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "spec=dspark gamma=5" in r.stdout and "survival[4]" in r.stdout


# -- the Markov loop -------------------------------------------------------------------------


def crafted_head(vocab: int, bias_row: list[float], prev: int) -> MarkovHead:
    """A rank-1 head whose bias for ``prev`` is ``bias_row`` (0 for other tokens)."""
    head = MarkovHead(vocab, 1, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        head.markov_w1.weight.zero_()
        head.markov_w1.weight[prev, 0] = 1.0
        head.markov_w2.weight[:, 0] = torch.tensor(bias_row)
    return head


def random_head(vocab: int, rank: int, gen: torch.Generator) -> MarkovHead:
    """A head with standard normal weights drawn from ``gen``."""
    head = MarkovHead(vocab, rank, dtype=torch.float32, device="cpu")
    torch.nn.init.normal_(head.markov_w1.weight, generator=gen)
    torch.nn.init.normal_(head.markov_w2.weight, generator=gen)
    return head


def test_markov_bias_goes_on_raw_logits_before_temperature() -> None:
    base = torch.tensor([[[2.0, 0.0, 0.0, 0.0]]])  # [1, 1, V]
    head = crafted_head(4, [0.0, 3.0, 0.0, 0.0], prev=2)
    greedy, _, _ = sample_block(base, torch.tensor([2]), head, [SamplingParams()], [None])
    assert greedy.tolist() == [[1]]  # 2 + 0 < 0 + 3: the bias flips the argmax
    params = SamplingParams(temperature=0.5, seed=0)
    gen = torch.Generator().manual_seed(0)
    _, probs, prev = sample_block(base, torch.tensor([2]), head, [params], [gen])
    want = torch.softmax(torch.tensor([2.0, 3.0, 0.0, 0.0]) / 0.5, -1)
    torch.testing.assert_close(probs[0, 0], want)  # softmax((U + B) / T)
    assert prev.tolist() == [[2]]


def test_markov_loop_follows_the_sampled_drafts() -> None:
    """prev_0 = anchor, then each position's own sampled token; q is what was sampled from."""
    gen = torch.Generator().manual_seed(1)
    vocab, g = 6, 4
    head = random_head(vocab, 3, gen)
    base = torch.randn(2, g, vocab, generator=gen)
    params = [SamplingParams(temperature=0.8, top_k=4, seed=s) for s in (1, 2)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    tokens, probs, prev = sample_block(base, torch.tensor([0, 5]), head, params, gens)
    assert prev[:, 0].tolist() == [0, 5] and torch.equal(prev[:, 1:], tokens[:, :-1])
    for k in range(g):
        want = logits_to_probs(base[:, k] + head.bias(prev[:, k]), params)
        torch.testing.assert_close(probs[:, k], want)


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_block_drafts_under_the_processors(temperature: float) -> None:
    """With a request's processors each position's biased logits are processed as its
    verify row will be (the drafts before it counted), before temperature: q is what was
    sampled from (greedy: the argmax); a request without processors is drafted as before."""
    gen = torch.Generator().manual_seed(2)
    vocab, g = 6, 4
    head = random_head(vocab, 3, gen)
    base = 3 * torch.randn(2, g, vocab, generator=gen)
    penalties = dict(frequency_penalty=1.5, presence_penalty=1.0, repetition_penalty=2.0)
    params = [
        SamplingParams(temperature=temperature, seed=1, logit_bias=((3, 1.0),), **penalties),
        SamplingParams(temperature=temperature, seed=2),
    ]

    def generators() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(s) for s in (1, 2)] if temperature else [None, None]

    history = [0, 4, 1]  # prompt [0, 4], one token generated
    proc = Processors(params[0], history[:2], frozenset({5}), vocab, torch.device("cpu"))
    proc.catch_up(history)
    drafts = DraftProcessors.of([proc, None])
    anchors = torch.tensor([1, 5])
    tokens, probs, prev = sample_block(base, anchors, head, params, generators(), None, drafts)
    raw = torch.stack([base[:, k] + head.bias(prev[:, k]) for k in range(g)], 1)  # [2, g, V]
    verify = Processors(params[0], history[:2], frozenset({5}), vocab, torch.device("cpu"))
    rows = process_rows(raw[0], [verify], [g], tokens[:1, : g - 1], [history])  # [g, V]
    torch.testing.assert_close(probs[0], logits_to_probs(rows, [params[0]] * g))
    torch.testing.assert_close(probs[1], logits_to_probs(raw[1], [params[1]] * g))
    free, _, _ = sample_block(base, anchors, head, params, generators())  # without them
    assert torch.equal(free[1], tokens[1])
    if not temperature:
        assert torch.equal(tokens[0], rows.argmax(-1))
        assert not torch.equal(free[0], tokens[0])  # the penalties changed the drafts


def test_block_draws_each_request_s_uniforms_in_position_order() -> None:
    """sample_block takes every position's uniform in one draw a request: the drafts are
    those of drawing position by position from each request's generator (greedy rows
    consume nothing), and each generator gives exactly one value a position."""
    gen = torch.Generator().manual_seed(2)
    vocab, g = 7, 4
    head = random_head(vocab, 3, gen)
    base = torch.randn(3, g, vocab, generator=gen)
    anchors = torch.tensor([1, 4, 6])
    params = [SamplingParams(temperature=0.9, seed=11), SamplingParams(), SamplingParams(1.2)]

    def generators() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(11), None, torch.Generator().manual_seed(12)]

    gens = generators()
    tokens, _, _ = sample_block(base, anchors, head, params, gens)
    ref_gens, prev, want = generators(), anchors, []
    for k in range(g):  # the reference: one sample (its own draw) per position
        prev = sample(logits_to_probs(base[:, k] + head.bias(prev), params), ref_gens)
        want.append(prev)
    assert torch.equal(tokens, torch.stack(want, 1))
    for used, ref in zip(gens, ref_gens):
        if used is not None and ref is not None:
            assert torch.equal(torch.rand(2, generator=used), torch.rand(2, generator=ref))


def test_greedy_block_is_the_processed_argmax_with_one_hot_q() -> None:
    """Every request greedy (no probabilities to draw from): the drafts, q and prev are
    what processing each position's logits and sampling them give, ties included."""
    gen = torch.Generator().manual_seed(3)
    vocab, g = 5, 4
    head = random_head(vocab, 2, gen)
    base = torch.randint(-1, 2, (6, g, vocab), generator=gen).float()  # many exact ties
    for markov in (None, head):
        with torch.no_grad():  # integer bias too: ties after the bias as well
            head.markov_w2.weight.copy_(torch.randint(-1, 2, (vocab, 2), generator=gen))
            head.markov_w1.weight.copy_(torch.randint(0, 2, (vocab, 2), generator=gen))
        params, gens = [SamplingParams()] * 6, [None] * 6
        tokens, probs, prev = sample_block(base, torch.arange(6) % vocab, markov, params, gens)
        last, want_q, want_t = torch.arange(6) % vocab, [], []
        for k in range(g):
            raw = base[:, k] if markov is None else base[:, k] + markov.bias(last)
            q = logits_to_probs(raw, params)
            assert torch.equal(prev[:, k], last)
            last = sample(q, gens)
            want_q.append(q)
            want_t.append(last)
        assert torch.equal(tokens, torch.stack(want_t, 1)), markov
        assert torch.equal(probs, torch.stack(want_q, 1)), markov


def test_sampled_output_follows_the_target_through_the_markov_loop() -> None:
    """Fixed target distributions p_0, p_1 (history-independent) and a Markov-biased draft:
    the committed tokens at positions 0 and 1 are distributed as p_0 and p_1 (chi-square,
    40k samples) because verification uses the dense q of the Markov loop."""
    gen = torch.Generator().manual_seed(5)
    vocab, g, n = 6, 3, 40_000
    head = MarkovHead(vocab, 2, dtype=torch.float32, device="cpu")
    torch.nn.init.normal_(head.markov_w1.weight, std=1.5, generator=gen)
    torch.nn.init.normal_(head.markov_w2.weight, std=1.5, generator=gen)
    base = torch.randn(1, g, vocab, generator=gen).expand(n, -1, -1)
    p = torch.softmax(torch.randn(g + 1, vocab, generator=gen), -1)  # [g+1, V]
    shared = torch.Generator().manual_seed(6)  # one generator, rows draw in order
    params = [SamplingParams(temperature=1.0)] * n
    drafts, q, _ = sample_block(base, torch.zeros(n, dtype=torch.long), head, params, [shared] * n)
    out = rejection_sample(p.expand(n, -1, -1), drafts, q, [shared] * n).output_tokens
    for pos in (0, 1):
        col = out[:, pos]
        seen = torch.bincount(col[col >= 0], minlength=vocab).float()
        if pos == 1:  # position 1 is committed only when position 0 was accepted
            assert seen.sum() > n / 10
        expected = p[pos] * seen.sum()
        chi2 = float(((seen - expected) ** 2 / expected).sum())
        assert chi2 < 25.0, (pos, chi2)  # dof 5: p-value ~1e-4


def test_checkpoint_directory_holds_target_and_stages() -> None:
    """The tiny companion is a real 0731 checkpoint: usable as model.path with spec=dspark
    (draft read from the target's own directory)."""
    from xspec.models.deepseek_v4.tiny import tiny_dspark_dir

    path = tiny_dspark_dir()
    names = Checkpoint(path).names()
    assert "embed.weight" in names and "mtp.2.markov_head.markov_w1.weight" in names
    llm = xspec.LLM(
        model="dsv4_flash",
        spec="dspark",
        platform="cpu",
        overrides={"model.path": str(path), "model.dtype": "float32", "model.tokenizer": "byte"},
    )
    assert llm._built.drafter.gamma == 5
    assert len(llm.generate([[5, 6, 7]], 4, ignore_eos=True)[0].token_ids) == 4


def test_dspark_keys_do_not_change_the_target() -> None:
    """The 0731 directory's target scores exactly like the plain tiny target: block
    attention is never armed on the target."""
    from xspec.models.deepseek_v4.tiny import tiny_dspark_dir

    plain = xspec.LLM(model="dsv4_tiny_random", spec="none", platform="cpu")
    flash = xspec.LLM(
        model="dsv4_flash",
        spec="none",
        platform="cpu",
        overrides={
            "model.path": str(tiny_dspark_dir()),
            "model.dtype": "float32",
            "model.tokenizer": "byte",
        },
    )
    tokens = PROMPTS[0][:40]
    assert torch.equal(plain.score(tokens), flash.score(tokens))


def test_dflash_on_deepseek_v4_is_a_config_error() -> None:
    from xspec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"spec=dflash needs a target .*model.arch: qwen3"):
        xspec.LLM(model="dsv4_tiny_random", spec="dflash", platform="cpu")


def test_mtp_checkpoint_under_spec_dspark_says_which_method() -> None:
    from xspec.errors import ConfigError
    from xspec.models.deepseek_v4.tiny import tiny_dir

    with pytest.raises(ConfigError, match="holds an MTP layer: use spec=mtp"):
        xspec.LLM(
            model="dsv4_tiny_random",
            spec="dspark",
            platform="cpu",
            overrides={"spec.draft_path": str(tiny_dir())},
        )


def test_capture_order_is_the_config_order(tmp_path: Path) -> None:
    """Unsorted dspark_target_layer_ids keep their order: the drafter asks for them in that
    order and the target concatenates its captures the same way."""
    config = dspark_config(DeepseekV4Args.tiny())
    tensors = dspark_tensors(config, 3)
    config["dspark_target_layer_ids"] = [4, 1, 3]
    write_checkpoint(tmp_path, tensors, config)
    llm = xspec.LLM(
        model="dsv4_tiny_random",
        spec="dspark",
        platform="npu_emulated",
        overrides={"spec.draft_path": str(tmp_path)},
    )
    assert llm._built.drafter.capture_layer_ids == [4, 1, 3]
    assert [p.layer for p in llm._built.capture] == [5, 2, 4]  # NPU: input of L+1
    from xspec.models.base import CapturePoint, CaptureSite, ForwardBatch

    target = llm._built.target
    ids = torch.tensor(PROMPTS[2])
    both = target.forward(
        ForwardBatch(ids, [len(ids)], [target.new_state()], llm._built.capture)
    ).aux_hidden
    d = target.hidden_size
    for k, layer in enumerate([4, 1, 3]):
        one = target.forward(
            ForwardBatch(
                ids, [len(ids)], [target.new_state()], [CapturePoint(layer, CaptureSite.OUTPUT)]
            )
        ).aux_hidden
        torch.testing.assert_close(both[:, k * d : (k + 1) * d], one)


def bigram_draft(path: Path, pairs: dict[int, int]) -> Path:
    """A 0731 draft whose Markov head maps each previous token to ``pairs[prev]``."""
    config = dspark_config(DeepseekV4Args.tiny(), markov_rank=RANK)
    tensors = dspark_tensors(config, 11)
    w1, w2 = torch.zeros(512, RANK), torch.zeros(512, RANK)
    for slot, (a, b) in enumerate(sorted(pairs.items())):
        w1[a, slot], w2[b, slot] = 10.0, 10.0
    tensors["mtp.2.markov_head.markov_w1.weight"] = w1
    tensors["mtp.2.markov_head.markov_w2.weight"] = w2
    write_checkpoint(path, tensors, config)
    return path


@pytest.mark.parametrize(("offset", "acceptance"), [(0, 1.0), (1, 0.0)])
def test_oracle_and_always_wrong_block_drafts(
    baseline: list[list[int]], tmp_path: Path, offset: int, acceptance: float
) -> None:
    """One request whose greedy continuation is a function of the previous token: a draft
    proposing exactly it is always accepted (gamma + 1 tokens per step, budget permitting);
    one proposing another token at every position never is; both outputs are the baseline's."""
    seq = PROMPTS[1][-1:] + baseline[1]
    pairs = dict(itertools.pairwise(seq))
    assert all(pairs[a] == b for a, b in itertools.pairwise(seq))  # a function of prev
    path = bigram_draft(tmp_path, {a: (b + offset) % 512 for a, b in pairs.items()})
    llm = xspec.LLM(
        model="dsv4_tiny_random",
        spec="dspark",
        platform="cpu",
        overrides={"spec.draft_path": str(path), "spec.num_speculative_tokens": 4},
    )
    out = llm.generate([PROMPTS[1]], NEW, ignore_eos=True)
    assert out[0].token_ids == baseline[1]
    rep = llm.metrics.report()
    assert rep.acceptance_rate == acceptance
    if acceptance == 1.0:  # 19 tokens after the first: steps of 5, 5, 5, then the budget's 4
        assert rep.num_steps == 4 and rep.full_block_fraction == 1.0
    else:
        assert rep.zero_accept_fraction == 1.0 and rep.mean_tokens_per_step == 1.0


@pytest.mark.parametrize("preset", ["tiny_random_0731", "tiny_random_0731_quarot"])
def test_0731_presets(baseline: list[list[int]], preset: str) -> None:
    """The 0731-layout presets carry their stages (the QuaRot-style one its own vocabulary)
    next to the tiny target: spec=dspark reads them from the target directory."""
    llm = xspec.LLM(
        model="dsv4_tiny_random", spec="dspark", platform="cpu", overrides={"model.preset": preset}
    )
    draft = llm._built.drafter.model  # type: ignore[attr-defined]
    own = preset.endswith("quarot")
    assert (draft._vocab[0] is not llm._built.target.embed) == own
    assert (draft._vocab[1] is not llm._built.target.head) == own
    out = llm.generate(PROMPTS[2:], NEW, ignore_eos=True)
    assert out[0].token_ids == baseline[2]


def test_block_drafters_on_an_unsupported_target_family() -> None:
    """A target family without block drafts (e.g. a model plugin) is a preflight problem,
    before anything is loaded; so is DFlash on DeepSeek-V4."""
    from xspec.config import ModelConfig, SpecConfig
    from xspec.spec.dspark import DFlashDrafter, DSparkDrafter

    plugin = ModelConfig(arch="toy_lm", path="/nowhere")
    [problem] = DSparkDrafter.preflight(SpecConfig(method="dspark"), plugin)
    assert "model.arch: deepseek_v4, qwen3" in problem and "not model.arch=toy_lm" in problem
    dsv4 = ModelConfig(arch="deepseek_v4", preset="tiny_random")
    [problem] = DFlashDrafter.preflight(SpecConfig(method="dflash"), dsv4)
    assert "model.arch: qwen3" in problem
    assert DSparkDrafter.draft_depth(SpecConfig(method="dspark"), plugin).default == 1
    assert DSparkDrafter.draft_depth(SpecConfig(method="dspark"), dsv4).trained == 5


def test_a_target_family_without_the_drafter_is_an_error_not_a_value() -> None:
    """Looking up the family a drafter needs raises a ConfigError naming the families that
    have it (the constructor lets it through; preflight reports its message)."""
    from xspec.errors import ConfigError
    from xspec.models.block_draft import BlockLayout
    from xspec.spec.dspark import _family
    from xspec.spec.mtp import _mtp_family

    with pytest.raises(ConfigError, match=r"spec=dflash needs .*\(model.arch: qwen3\)"):
        _family(BlockLayout.DFLASH, "deepseek_v4")
    assert _family(BlockLayout.DSPARK, "deepseek_v4") is not None
    with pytest.raises(ConfigError, match="spec=mtp needs a DeepSeek-V4 target"):
        _mtp_family("qwen3")
