"""The committed rows a drafter observes: one flat ragged batch gathered from the target's
forwards, bitwise what the former per-sequence split (then concatenation) delivered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from xspec.config import ModelConfig, PlatformConfig
from xspec.metrics import SpecDecodeMetrics
from xspec.models.base import ForwardBatch, KvBytes, ModelOutput
from xspec.models.qwen3 import load_model
from xspec.platforms.cpu import CpuPlatform
from xspec.sampling import SamplingParams
from xspec.spec.drafter import CommittedRows, Drafter, DraftProposal, DraftRequest
from xspec.spec.step import RunningSeq, decode_step, prefill

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100)), [300, 7], list(range(200, 211))]
GAMMA = 3
CHUNK = 4  # prefill in chunks: the longer prompts take several forwards


@dataclass
class Script:
    """A test drafter's state: the target's greedy continuation it reads drafts from."""

    seq: int  # the sequence's index in the batch
    reference: list[int]  # prompt + the target's greedy continuation
    num_tokens: int = 0


class ScriptedDrafter(Drafter):
    """Proposes the target's greedy continuation with every draft of sequence ``b`` from
    the ``b``-th on one id off, so the sequences of a batch accept 0, 1, 2, 3 drafts; it
    records every :class:`CommittedRows` it observes."""

    gamma = GAMMA

    def __init__(self, capture_layer_ids: list[int], vocab_size: int) -> None:
        self.capture_layer_ids = capture_layer_ids
        self.vocab_size = vocab_size
        self.seen: list[CommittedRows] = []

    def new_state(self, max_tokens: int | None = None) -> Any:
        raise NotImplementedError  # the test builds Script states itself

    def kv_bytes(self) -> KvBytes:
        return KvBytes()

    def snapshot(self, state: Any, start: int) -> Any:
        raise NotImplementedError  # the test runs no prefix cache

    def restore(self, state: Any, chain: Any) -> Any:
        raise NotImplementedError

    def observe(self, states: list[Script], rows: CommittedRows) -> None:
        self.seen.append(rows)
        for s, n in zip(states, rows.seq_lens):
            s.num_tokens += n

    def propose(
        self, states: list[Script], requests: list[DraftRequest], num_tokens: int
    ) -> DraftProposal:
        drafts = []
        for s in states:  # the token after the anchor at position s.num_tokens
            row = s.reference[s.num_tokens + 1 : s.num_tokens + 1 + num_tokens]
            drafts.append(
                [t if k < s.seq else (t + 1) % self.vocab_size for k, t in enumerate(row)]
            )
        return DraftProposal(tokens=torch.tensor(drafts, dtype=torch.long))


class Recording:
    """A target whose forwards are recorded: (batch, output) per call."""

    def __init__(self, target: Any) -> None:
        self.target, self.calls = target, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        out = self.target.forward(batch)
        self.calls.append((batch, out))
        return out


def split_then_cat(
    calls: list[tuple[ForwardBatch, ModelOutput]], states: list[Any], keep: list[int]
) -> dict[str, torch.Tensor]:
    """What the step used to deliver, concatenated as the drafters used to: each
    sequence's (target ``states[b]``) rows of every call, the first ``keep[b]`` in all."""
    parts: dict[str, list[torch.Tensor]] = {"ids": [], "hidden": [], "aux": []}
    for state, k in zip(states, keep):
        for batch, out in calls:
            live = [i for i, s in enumerate(batch.states) if s is state]
            if not live or k == 0:
                continue
            lo = sum(batch.seq_lens[: live[0]])
            hi = lo + min(batch.seq_lens[live[0]], k)
            k -= hi - lo
            parts["ids"].append(batch.input_ids[lo:hi])
            parts["hidden"].append(out.hidden[lo:hi])
            parts["aux"].append(out.aux_hidden[lo:hi])  # type: ignore[index]
    return {name: torch.cat(p) for name, p in parts.items()}


@torch.no_grad()
@pytest.mark.parametrize("layer_ids", [[1, 3], [0]])
def test_drafter_sees_what_split_and_concat_delivered(layer_ids: list[int]) -> None:
    model = load_model(
        ModelConfig(arch="qwen3", preset="tiny"), device=torch.device("cpu"), max_rollback=8
    )
    platform = CpuPlatform(PlatformConfig(name="cpu"))
    capture = [platform.capture_point(i) for i in layer_ids]
    reference = []  # the target's greedy continuation of each prompt
    for p in PROMPTS:
        state, ids = model.new_state(), list(p)
        logits = model.forward(ForwardBatch(torch.tensor(ids), [len(ids)], [state])).logits
        for _ in range(8):
            ids.append(int(logits[-1].argmax()))
            logits = model.forward(ForwardBatch(torch.tensor(ids[-1:]), [1], [state])).logits
        reference.append(ids)

    target = Recording(model)
    drafter = ScriptedDrafter(layer_ids, model.vocab_size)
    seqs = [
        RunningSeq(list(p), model.new_state(), Script(b, r), SamplingParams(), None, len(p) + 6)
        for b, (p, r) in enumerate(zip(PROMPTS, reference))
    ]
    tstates = [s.target_state for s in seqs]

    first = prefill(target, drafter, seqs, capture, CHUNK)
    rows = drafter.seen[-1]
    want = split_then_cat(target.calls, tstates, [len(p) for p in PROMPTS])
    nxt = [torch.tensor([*p[1:], *f]) for p, f in zip(PROMPTS, first.new_tokens)]
    assert len(target.calls) == 10  # ceil(40 / CHUNK): the chunked prefill
    # each chunk's forward scored only the last rows of the prompts that end in it
    ending = [sum(lo < len(p) <= lo + CHUNK for p in PROMPTS) for lo in range(0, 40, CHUNK)]
    assert [out.logits.shape[0] for _, out in target.calls] == ending == [1, 1, 1, *[0] * 6, 1]
    assert first.new_tokens == [[r[len(p)]] for p, r in zip(PROMPTS, reference)]
    assert rows.seq_lens == [len(p) for p in PROMPTS] and rows.starts == [0] * len(PROMPTS)
    assert rows.offsets == [0, 5, 45, 47, 58]
    assert torch.equal(rows.input_ids, want["ids"])
    assert torch.equal(rows.next_ids, torch.cat(nxt))
    assert torch.equal(rows.hidden, want["hidden"]) and rows.hidden.dtype == want["hidden"].dtype
    assert rows.aux_hidden is not None and torch.equal(rows.aux_hidden, want["aux"])
    assert torch.equal(rows.positions(), torch.cat([torch.arange(len(p)) for p in PROMPTS]))

    target.calls.clear()
    starts = [s.target_state.num_tokens for s in seqs]
    step = decode_step(target, drafter, seqs, capture, SpecDecodeMetrics())
    assert step.num_accepted == [0, 1, 2, 3]  # a mixed batch: each sequence its own length
    rows, keep = drafter.seen[-1], [len(t) for t in step.new_tokens]
    want = split_then_cat(target.calls, tstates, keep)
    assert rows.seq_lens == keep and rows.starts == starts
    assert torch.equal(rows.input_ids, want["ids"])
    assert torch.equal(rows.next_ids, torch.tensor([t for new in step.new_tokens for t in new]))
    assert torch.equal(rows.hidden, want["hidden"])
    assert rows.aux_hidden is not None and torch.equal(rows.aux_hidden, want["aux"])
