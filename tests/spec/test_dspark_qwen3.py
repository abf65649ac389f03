"""``spec=dspark`` / ``spec=dflash`` on the qwen3 tiny presets (their companion random
drafts): exact greedy equality with the baseline, continuous batching, seeded sampling,
the target distribution through the Markov loop (chi-square), acceptance metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import xspec
from xspec.config import ModelConfig, PlatformConfig, SpecConfig
from xspec.models.base import EAGER_STEPS, ForwardBatch
from xspec.models.block_draft import BlockLayout
from xspec.models.qwen3 import load_model
from xspec.models.qwen3.model import Qwen3State
from xspec.platforms.cpu import CpuPlatform
from xspec.sampling import SamplingParams, logits_to_probs, make_generator
from xspec.spec.block import BlockDrafter
from xspec.spec.drafter import CommittedRows, DraftRequest
from xspec.spec.dspark import DFlashDrafter, DSparkDrafter
from xspec.spec.verify import rejection_sample

METHODS = ("dspark", "dflash")
NEW = 24


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [ids(5, 1), ids(37, 2), ids(14, 3)]  # different positions in one batch


def build(spec: str, model: str = "qwen3_tiny", **overrides: object) -> xspec.LLM:
    return xspec.LLM(model=model, spec=spec, platform="cpu", overrides=overrides)


@pytest.fixture(scope="module")
def baseline() -> xspec.LLM:
    return build("none")


@pytest.fixture(scope="module")
def reference(baseline: xspec.LLM) -> list[list[int]]:
    return [g.token_ids for g in baseline.generate(PROMPTS, NEW, ignore_eos=True)]


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_baseline_batched(reference: list, method: str, gamma: int) -> None:
    llm = build(method, **{"spec.num_speculative_tokens": gamma})
    outs = llm.generate(PROMPTS, NEW, ignore_eos=True, concurrency=3)
    assert [o.token_ids for o in outs] == reference
    r = llm.metrics.report()
    assert r.num_draft_tokens <= gamma * r.num_row_steps  # fewer near the end of the budget
    assert r.num_committed_tokens == len(PROMPTS) * (NEW - 1)  # every decode-step token
    assert r.num_committed_tokens == r.num_accepted_tokens + r.num_row_steps
    assert all(a >= b for a, b in zip(r.accepted_per_position, r.accepted_per_position[1:]))
    assert r.survival == sorted(r.survival, reverse=True)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_baseline_continuous_batching(baseline: xspec.LLM, method: str) -> None:
    """4 requests through 2 slots: requests join while others are mid-decode."""
    prompts = [*PROMPTS, ids(60, 4)]
    want = baseline.generate(prompts, 40, ignore_eos=True, concurrency=2)
    llm = build(method)  # gamma = the draft's trained block
    got = llm.generate(prompts, 40, ignore_eos=True, concurrency=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_greedy_moe_target() -> None:
    want = build("none", "qwen3_moe_tiny").generate(PROMPTS, 16, ignore_eos=True)
    for method in METHODS:
        got = build(method, "qwen3_moe_tiny").generate(PROMPTS, 16, ignore_eos=True)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], method


def test_dspark_preset_drafts_get_accepted() -> None:
    """The preset's Markov prior makes the random draft useful on the looping tiny target,
    so multi-token accepts (and full blocks) are exercised, and reported consistently."""
    llm = build("dspark")
    llm.generate(PROMPTS, NEW, ignore_eos=True)
    r = llm.metrics.report()
    assert r.num_accepted_tokens > 0 and r.num_full_blocks > 0
    assert r.accepted_per_position[0] >= r.accepted_per_position[-1] > 0
    assert r.num_committed_tokens == r.num_accepted_tokens + r.num_row_steps


@pytest.mark.parametrize("method", METHODS)
def test_sampled_runs_are_reproducible(method: str) -> None:
    llm = build(method, **{"spec.num_speculative_tokens": 3})
    runs = [llm.generate(PROMPTS, 20, temperature=0.8, seed=11, ignore_eos=True) for _ in "ab"]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    other = llm.generate(PROMPTS, 20, temperature=0.8, seed=12, ignore_eos=True)
    assert [o.token_ids for o in other] != [o.token_ids for o in runs[0]]


@pytest.mark.parametrize("spec", ["spec=dspark", "spec=dflash"])
def test_cli_runs_with_no_other_flags(spec: str, tmp_path: Path, xspec_cache: Path) -> None:
    from tests.test_cli import run_cli

    r = run_cli(
        "model=qwen3_tiny", spec, "workload.max_new_tokens=8", cache=xspec_cache, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert "acceptance" in r.stdout.lower()


# -- DeepSpec's "dflash" drafts: the DSpark block without heads ----------------------------


@torch.no_grad()
def test_deepspec_dflash_draft_runs_its_own_block_under_spec_dflash(
    reference: list, tmp_path: Path
) -> None:
    """spec=dflash on a DeepSpec DFlash directory drafts exactly what spec=dspark drafts on
    it (the block it was trained on), with gamma = its block_size, and greedy output equals
    spec=none. Reading it with z-lab's layout (the old behaviour) drafts other tokens."""
    from tests.models.qwen3.test_dspark import deepspec_dflash_dir

    path = str(deepspec_dflash_dir(tmp_path / "deepspec_dflash"))
    outs = build("dflash", **{"spec.draft_path": path}).generate(PROMPTS, NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == reference

    model_cfg = ModelConfig(arch="qwen3", preset="tiny")
    platform = CpuPlatform(PlatformConfig(name="cpu"))
    target = load_model(model_cfg, device=torch.device("cpu"), max_rollback=8)

    def drafter(cls: type[DSparkDrafter]) -> BlockDrafter:
        spec = SpecConfig(method=cls.method.value, draft_path=path)
        assert cls.draft_depth(spec, model_cfg).trained == 4  # its block_size
        spec.num_speculative_tokens = 4  # what build resolves (xspec.build.resolve_gamma)
        return cls(spec, target=target, model_cfg=model_cfg, platform=platform, steps=EAGER_STEPS)

    dflash, dspark = drafter(DFlashDrafter), drafter(DSparkDrafter)
    assert (dflash.layout, dflash.gamma) == (dspark.layout, dspark.gamma) == (BlockLayout.DSPARK, 4)
    assert dflash.model.markov is None and dflash.model.confidence is None
    layer_ids = dflash.capture_layer_ids
    zlab = BlockDrafter(dflash.model, layout=BlockLayout.DFLASH, gamma=4, capture_layer_ids=layer_ids, device=torch.device("cpu"))  # fmt: skip
    drafts: dict[str, list[list[int]]] = {"dflash": [], "dspark": [], "zlab": []}
    for prompt, anchor in zip(PROMPTS, (17, 150, 300)):
        capture = [platform.capture_point(i) for i in layer_ids]
        batch = ForwardBatch(torch.tensor(prompt), [len(prompt)], [target.new_state()], capture)
        out = target.forward(batch)
        nxt = torch.tensor([*prompt[1:], anchor])
        rows = CommittedRows(
            torch.tensor(prompt), nxt, out.hidden, out.aux_hidden, [len(prompt)], [0]
        )
        for name, d in (("dflash", dflash), ("dspark", dspark), ("zlab", zlab)):
            state = d.new_state()
            d.observe([state], rows)
            prop = d.propose([state], [DraftRequest(anchor, SamplingParams(), None, 4)], 4)
            drafts[name].append(prop.tokens[0].tolist())
    assert drafts["dflash"] == drafts["dspark"]
    assert drafts["zlab"] != drafts["dspark"]


# -- the target distribution through the Markov loop ----------------------------------------

N = 10_000  # copies of one decode step
CELLS = 40  # the most likely tokens get a chi-square cell each, the rest share one


def binned(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cell per token [M], cell probabilities [CELLS + 1]): keeps dof within the table."""
    top = probs.topk(CELLS).indices
    cell_of = torch.full((probs.shape[0],), CELLS, dtype=torch.long)
    cell_of[top] = torch.arange(CELLS)
    cells = torch.zeros(CELLS + 1, dtype=probs.dtype).index_add_(0, cell_of, probs)
    return cell_of[tokens], cells


@torch.no_grad()
def test_committed_tokens_follow_the_target_through_the_markov_loop() -> None:
    """N copies of one sampled DSpark step (T=0.9, dense q from the Markov loop) over the
    same context: the first committed token ~ p(. | context, anchor), and the second,
    given the first was the accepted draft t, ~ p(. | context, anchor, t). The negative
    control verifies the same drafts against q without the Markov bias: it must fail."""
    from tests.spec.test_verify_stats import CHI2_CRIT_0001, assert_follows, chi_square

    model_cfg = ModelConfig(arch="qwen3", preset="tiny")
    platform = CpuPlatform(PlatformConfig(name="cpu"))
    target = load_model(model_cfg, device=torch.device("cpu"), max_rollback=8)
    gamma = 2
    spec = SpecConfig(method="dspark", num_speculative_tokens=gamma)
    drafter = DSparkDrafter(
        spec, target=target, model_cfg=model_cfg, platform=platform, steps=EAGER_STEPS
    )
    capture = [platform.capture_point(i) for i in drafter.capture_layer_ids]
    prompt, anchor = (
        torch.tensor([*ids(8, 5), 150, 150, 150, 150]),
        150,
    )  # a loop: drafts of 150 get accepted
    tstate = target.new_state()
    out = target.forward(ForwardBatch(prompt, [len(prompt)], [tstate], capture))
    state = drafter.new_state()
    nxt = torch.cat([prompt[1:], torch.tensor([anchor])])
    rows = CommittedRows(prompt, nxt, out.hidden, out.aux_hidden, [len(prompt)], [0])
    drafter.observe([state], rows)

    params = SamplingParams(temperature=0.9, seed=21)
    gen = make_generator(params)  # one stream shared by every copy
    prop = drafter.propose(
        [state] * N, [DraftRequest(anchor, params, gen, drafter.gamma)] * N, drafter.gamma
    )
    assert prop.probs is not None
    d1 = prop.tokens[:, 0]

    def p_after(prefix: list[int]) -> torch.Tensor:
        """The target's processed distribution of the token after prompt + prefix."""
        s = Qwen3State(num_tokens=tstate.num_tokens, kv=tstate.kv.clone())
        logits = target.forward(ForwardBatch(torch.tensor(prefix), [len(prefix)], [s])).logits
        return logits_to_probs(logits[-1:], [params])[0]  # [V]

    p0 = p_after([anchor])
    rows = {t: p_after([anchor, t]) for t in d1.unique().tolist()}  # p(. | anchor, d1)
    p = torch.stack([p0.expand(N, -1), torch.stack([rows[t] for t in d1.tolist()]), p0.expand(N, -1)], 1)  # fmt: skip
    result = rejection_sample(p, prop.tokens, prop.probs, [gen] * N)
    first = result.output_tokens[:, 0]
    assert_follows(*binned(first, p0), "first committed token")
    # second token, given the first was the accepted draft t (the most frequent one)
    accepted = result.num_accepted >= 1
    t = int(torch.mode(first[accepted]).values)
    picked = accepted & (first == t)
    assert int(picked.sum()) > 400, "too few accepted first drafts for the conditional test"
    second = result.output_tokens[picked, 1]
    assert_follows(*binned(second, rows[t]), f"second token | first = {t}")

    # negative control: the same drafts judged against q without the Markov bias
    base = drafter.model.forward_block(
        [state], torch.tensor([[anchor, drafter.model.fill_token_id]])
    )[1]
    q_wrong = logits_to_probs(base[0, :gamma], [params] * gamma)  # [gamma, V]
    wrong = rejection_sample(p, prop.tokens, q_wrong.expand(N, -1, -1).contiguous(), [gen] * N)
    stat, dof = chi_square(*binned(wrong.output_tokens[:, 0], p0))
    assert stat > CHI2_CRIT_0001[dof - 1], f"negative control passed: chi2={stat:.1f}"
