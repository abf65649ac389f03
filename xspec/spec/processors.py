"""Per-request logits processors, applied to every verify row with that row's own history.

A penalty changes the distribution of the next token with the tokens before it, so under
speculation each verify row must see what it would have seen without speculation: the
row that scores draft position j (row j - 1 of ``[anchor, d_1 .. d_n]``) counts the
generated tokens so far plus the drafts ``d_1 .. d_(j-1)``, and the bonus row every
draft. The processed rows then go through ``logits_to_probs`` and the rejection sampler
as usual, so the output follows the penalised target distribution exactly.

The drafter proposes under them too (:class:`DraftProcessors`, where the drafter passes
each position through it: MTP, DSpark, DFlash), position by position: the draft at
position k (predicting the token after ``d_k``) counts the generated tokens plus the
drafts ``d_1 .. d_k`` it sampled before, so it is processed with the history its verify
row will have. Its q is still exactly the distribution each draft was drawn from (the
processed, grammar-masked, tempered one), which is all the rejection sampler needs:
exactness holds by construction and does not depend on q matching p; acceptance does,
and without the processors in the drafter a penalty's repeated tokens are drafted and
rejected (``Drafter.process_drafts`` off proposes that way, for comparison).

Order, as vLLM's sampler: ``logit_bias`` is added, the stop ids are masked while fewer
than ``min_tokens`` tokens were generated, then vLLM's ``repetition_penalty`` (a seen
token's positive logit divided by it, a negative one multiplied; prompt and output
tokens), then OpenAI's ``frequency_penalty * count + presence_penalty * (count > 0)``
subtracted (output tokens only). Temperature, top-k and top-p come after, in
:func:`xspec.sampling.logits_to_probs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xspec.errors import RequestError
from xspec.sampling import SamplingParams

__all__ = ["DraftProcessors", "Processors", "process_rows"]


class Processors:
    """One request's processor state on the device: its output token counts (folded in
    from ``token_ids`` as they are committed), the prompt's token set, bias and stop ids."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        stop_ids: frozenset[int],
        vocab: int,
        device: torch.device,
    ) -> None:
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.counted = 0  # output tokens folded into counts so far
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # [V]
        self.prompt_seen: torch.Tensor | None = None  # [V] bool: repetition_penalty only
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.prompt_seen = seen.index_fill_(
                0, torch.tensor(prompt_ids, dtype=torch.long, device=device), True
            )
        self.bias: torch.Tensor | None = None  # [V]
        if params.logit_bias:
            ids = [t for t, _ in params.logit_bias]
            if bad := [t for t in ids if not 0 <= t < vocab]:
                raise RequestError(
                    f"logit_bias names token ids outside the vocabulary [0, {vocab}): {bad[:8]}"
                )
            self.bias = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(
                [b for _, b in params.logit_bias], device=device
            )
        self.stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)  # [S]

    def catch_up(self, token_ids: list[int]) -> int:
        """Fold the output tokens committed since the last call into the counts; returns
        how many tokens the request has generated."""
        out = token_ids[self.prompt_len + self.counted :]
        if out:
            new = torch.tensor(out, dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, new, torch.ones(len(out), device=self.counts.device))
            self.counted += len(out)
        return self.counted

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor, generated: int) -> torch.Tensor:
        """``logits [n+1, V]`` of one sequence's verify rows (row j after the drafts
        ``drafts[:j]``, ``drafts [n]``), ``generated`` tokens before row 0's -> processed
        ``[n+1, V]`` float32."""
        rows = logits.shape[0]
        counts = self.counts.expand(rows, -1)  # [n+1, V]
        if rows > 1:  # row j counts d_1 .. d_j too (strictly lower triangle of drafts)
            seen = torch.ones(rows, rows - 1, device=logits.device).tril(-1)  # [n+1, n]
            counts = counts.clone().scatter_add_(1, drafts[None, :].expand(rows, -1), seen)
        return self.process(logits, counts, generated)

    def process(self, logits: torch.Tensor, counts: torch.Tensor, generated: int) -> torch.Tensor:
        """``logits [R, V]`` with the output token ``counts [R, V]`` of each row's history;
        row r follows ``generated + r`` generated tokens -> processed ``[R, V]`` float32."""
        p, rows = self.params, logits.shape[0]
        out = logits.float()
        if self.bias is not None:
            out = out + self.bias
        if p.min_tokens and self.stop.numel():
            masked = torch.arange(rows, device=out.device) + generated < p.min_tokens  # [R]
            out = out.clone() if out is logits else out
            out[masked[:, None] & _in(self.stop, out.shape[1])] = float("-inf")
        if p.repetition_penalty != 1.0:
            assert self.prompt_seen is not None
            rep = self.prompt_seen | (counts > 0)  # [R, V]
            penalised = torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty)
            out = torch.where(rep, penalised, out)
        if p.frequency_penalty or p.presence_penalty:
            out = out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        return out


class DraftProcessors:
    """The processors of a batch of draft requests along one proposal, position by
    position: :meth:`logits` processes a position's raw logits (each row with its
    request's history and the drafts before it), :meth:`push` counts the drafts sampled
    there. ``processors [B]`` must have caught up with the committed tokens
    (:meth:`Processors.catch_up`); their counts are copied, never changed."""

    def __init__(self, processors: Sequence[Processors | None]) -> None:
        self.rows = [b for b, p in enumerate(processors) if p is not None]
        self.procs = [p for p in processors if p is not None]
        self.counts = torch.stack([p.counts for p in self.procs])  # [R, V]: a copy
        self.drafted = 0  # positions pushed so far
        self._index = torch.tensor(self.rows, dtype=torch.long, device=self.counts.device)

    @classmethod
    def of(cls, processors: Sequence[Processors | None]) -> DraftProcessors | None:
        """None when no request has processors: the drafter then pays nothing."""
        return cls(processors) if any(p is not None for p in processors) else None

    def logits(self, raw: torch.Tensor) -> torch.Tensor:
        """``raw [B, V]`` of one draft position -> ``[B, V]`` float32, the rows of requests
        with processors processed (a new tensor), the others as they were."""
        out = raw.float().clone()
        for i, (b, proc) in enumerate(zip(self.rows, self.procs)):
            generated = proc.counted + self.drafted
            out[b] = proc.process(raw[b : b + 1], self.counts[i : i + 1], generated)[0]
        return out

    def push(self, tokens: torch.Tensor) -> None:
        """Count the drafts ``tokens [B]`` sampled at this position (on the device)."""
        rows = torch.arange(len(self.rows), device=self.counts.device)
        self.counts.index_put_(
            (rows, tokens[self._index]), torch.ones_like(rows, dtype=torch.float32), accumulate=True
        )
        self.drafted += 1


def _in(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[1, V]`` bool: the vocabulary entries in ``ids``."""
    return torch.zeros(1, vocab, dtype=torch.bool, device=ids.device).index_fill_(1, ids, True)


def process_rows(
    logits: torch.Tensor,
    processors: list[Processors | None],
    lens: list[int],
    drafts: torch.Tensor,
    token_ids: list[list[int]],
) -> torch.Tensor:
    """``logits [sum(lens), V]``: sequence b's ``lens[b]`` verify rows, after the drafts
    ``drafts [B, >= max(lens)-1]``; each sequence with processors gets them, row by row
    with its own history (``token_ids[b]``: prompt + committed output). Returns the
    logits, processed where any sequence has processors (a new tensor then)."""
    if all(p is None for p in processors):
        return logits
    out = logits.float().clone()
    start = 0
    for b, (proc, n) in enumerate(zip(processors, lens)):
        if proc is not None:
            generated = proc.catch_up(token_ids[b])
            out[start : start + n] = proc.apply(
                logits[start : start + n], drafts[b, : n - 1], generated
            )
        start += n
    return out
