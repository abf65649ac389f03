"""Logprobs of what a step committed, from the rows its forward already scored.

No extra forward: a decode step's are the verify rows (row j scored the token committed
at column j), a prefill's the prompt's rows, which it scores for the sequences asking
(``SamplingParams.prompt_logprobs``) besides each prompt's last row.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from xspec.sampling import SamplingParams, TokenLogprob, token_logprobs

__all__ = ["SampledRows", "committed_logprobs", "prompt_token_logprobs"]


class HasParams(Protocol):
    @property
    def params(self) -> SamplingParams: ...


@dataclass
class SampledRows:
    """The target's rows of one forward as the sampler saw them, for logprobs."""

    raw: torch.Tensor  # [R, V] the model's logits (a non-finite sequence's zeroed)
    processed: torch.Tensor  # [R, V] after the request's logits processors
    probs: torch.Tensor  # [R, V] the distributions sampled from (logits_to_probs)
    lens: list[int]  # [B] rows per sequence


def committed_logprobs(
    seqs: Sequence[HasParams], rows: SampledRows, tokens: torch.Tensor, committed: list[int]
) -> list[list[TokenLogprob] | None] | None:
    """The logprobs of each committed token, for the sequences asking: sequence b's
    tokens ``tokens[b, :committed[b]]`` from its first rows. ``raw`` (vLLM's default):
    the model's log-softmax; ``processed``: of the distribution sampled from (greedy:
    the log-softmax of the processed logits, whose argmax it takes)."""
    if all(s.params.logprobs is None for s in seqs):
        return None
    out: list[list[TokenLogprob] | None] = []
    starts = [0, *itertools.accumulate(rows.lens)]
    for b, s in enumerate(seqs):
        p = s.params
        if p.logprobs is None:
            out.append(None)
            continue
        r = slice(starts[b], starts[b] + committed[b])
        if p.logprobs_mode == "raw":
            lp = torch.log_softmax(rows.raw[r].float(), dim=-1)
        elif p.greedy:
            lp = torch.log_softmax(rows.processed[r].float(), dim=-1)
        else:
            lp = rows.probs[r].log()
        ids = tokens[b, : committed[b]].to(lp.device)
        out.append(token_logprobs(lp, ids, p.logprobs))
    return out


def prompt_token_logprobs(
    seqs: Sequence[HasParams], prompts: list[torch.Tensor], rows: list[list[torch.Tensor]]
) -> list[list[TokenLogprob | None] | None] | None:
    """Each asking prompt's token logprobs (the model's: row i scores token i + 1), the
    first token's None."""
    if all(s.params.prompt_logprobs is None for s in seqs):
        return None
    out: list[list[TokenLogprob | None] | None] = []
    for s, prompt, parts in zip(seqs, prompts, rows):
        k = s.params.prompt_logprobs
        if k is None:
            out.append(None)
            continue
        lp = torch.log_softmax(torch.cat(parts)[:-1].float(), dim=-1)  # [n-1, V]
        first: list[TokenLogprob | None] = [None]
        out.append(first + list(token_logprobs(lp, prompt[1:], k)))
    return out
