"""Exact speculative verification: the rejection sampler every method shares.

One verify step, per request b with n = num_drafts[b] draft tokens d_1..d_n:

    for k = 1..n:   accept d_k with probability min(1, p_k(d_k) / q_k(d_k))
                    on the first rejection emit y ~ normalize(max(p_k - q_k, 0)), stop
    all accepted:   emit a bonus y ~ p_{n+1}

p_k is the target's distribution at row k (scored on ``[anchor, d_1..d_gamma]``), q_k
the FULL draft distribution d_k was drawn from, both processed by
``xspec.sampling.logits_to_probs`` with the request's own parameters. With the full q
the emitted tokens follow p exactly (Leviathan et al. 2023, Chen et al. 2023). Engines
that keep only q_k(d_k) and resample from p with d_k zeroed are not exact (see
``tests/spec/test_verify_stats.py``). Deterministic drafts (draft_probs=None) have a
one-hot q_k at d_k: accept with probability p_k(d_k), else y ~ p_k with d_k removed.

Greedy requests (generator None) accept d_k iff it is the target's argmax; the
correction/bonus is the argmax. They consume no randomness. A random request draws
n + 1 uniforms per step from its own generator (n acceptance tests, one final draw),
however many drafts it accepts, so its stream is independent of its batch mates.

Output per row: ``[d_1 .. d_a, y, -1 ...]`` of width gamma+1, a = num_accepted; the
row commits a + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from xspec.sampling import draw_uniforms, inverse_cdf

__all__ = ["VerifyResult", "rejection_sample"]


@dataclass
class VerifyResult:
    # [B, gamma+1] int64: accepted drafts, then the correction/bonus token, -1 padded
    output_tokens: Tensor
    # [B] int64: accepted draft tokens (the correction/bonus token is not counted)
    num_accepted: Tensor


def rejection_sample(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    generators: Sequence[torch.Generator | None],
    num_drafts: Tensor | Sequence[int] | None = None,
    *,
    check_tokens: bool = True,
) -> VerifyResult:
    """Verify one block of drafts per request; see the module docstring.

    target_probs: [B, gamma+1, V] float32, processed target distributions
    draft_tokens: [B, gamma] int64 (columns >= num_drafts[b] are ignored, may be -1)
    draft_probs:  [B, gamma, V] float32 full draft distributions, or None (one-hot q)
    generators:   B entries; None = greedy row
    num_drafts:   [B] ints in [0, gamma] (a host list costs no device sync), or None = gamma
    check_tokens: refuse draft ids outside the vocabulary (reads the device: one sync);
                  the speculative step skips it, its drafts come from a sampler

    Every tensor is on ``target_probs.device``; nothing is read back to the host when
    ``num_drafts`` is a host list and ``check_tokens`` is False.
    """
    bsz, gamma = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    n_host = _check_inputs(target_probs, draft_tokens, draft_probs, generators, num_drafts)
    if check_tokens:
        _check_tokens(draft_tokens, n_host, vocab)
    n = torch.tensor(n_host, dtype=torch.long, device=device)  # [B]
    rows = torch.arange(bsz, device=device)  # [B]
    greedy_rows = [g is None for g in generators]
    is_greedy = torch.tensor(greedy_rows, dtype=torch.bool, device=device)  # [B]
    # [B, gamma]: positions that carry a draft
    in_block = torch.arange(gamma, device=device)[None, :] < n[:, None]
    tokens = draft_tokens.clamp(0, vocab - 1)  # [B, gamma] gather-safe copy of the -1 padding

    # Random rows draw n acceptance uniforms, then one for the final token; greedy rows none.
    counts = [0 if g is None else n_b + 1 for g, n_b in zip(generators, n_host)]
    u = draw_uniforms(generators, counts, device)  # [B, <= gamma+1]
    u = torch.nn.functional.pad(u, (0, gamma + 1 - u.shape[1]))  # [B, gamma+1]
    u_accept = u[:, :gamma]  # [B, gamma]
    u_final = u.gather(1, n[:, None]).squeeze(1)  # [B] column n: right after the row's own draws

    # p: target prob, q: draft prob, both of the drafted token d_k.
    p_d = target_probs[:, :gamma].gather(-1, tokens[..., None]).squeeze(-1)  # [B, gamma]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)  # deterministic drafts: q one-hot at d_k
    else:
        q_d = draft_probs.float().gather(-1, tokens[..., None]).squeeze(-1)  # [B, gamma]
    accept_random = u_accept * q_d < p_d  # P = min(1, p/q); p >= q always accepts, p = 0 never
    target_argmax = target_probs.argmax(dim=-1)  # [B, gamma+1] (ties -> lowest index)
    accept_greedy = draft_tokens == target_argmax[:, :gamma]  # [B, gamma]
    accepted = torch.where(is_greedy[:, None], accept_greedy, accept_random) & in_block
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B] a: stop at the first rejection

    # The final token sits at position a: a correction if d_{a+1} was rejected (a < n),
    # else the bonus from p_{n+1}. Both draw from target row a; a rejection removes q.
    p_a = target_probs[rows, num_accepted].float()  # [B, V]
    rejected = num_accepted < n  # [B]
    q_a = _draft_dist_at(tokens, draft_probs, num_accepted, vocab) * rejected[:, None]  # [B, V]
    residual = (p_a - q_a).clamp_(min=0.0)  # [B, V] max(p - q, 0), unnormalised
    # A rejection means p_a(d) < q_a(d), so p != q and sum(max(p - q, 0)) = TV(p, q) > 0
    # in exact arithmetic. An all-zero residual needs p == q (up to rounding) and a
    # drafted token outside both supports (q(d) = p(d) = 0: a draft that did not come
    # from q). No mass was moved away from p then, so sampling from p stays exact.
    degenerate = residual.sum(dim=-1) <= 0.0  # [B]
    residual = torch.where(degenerate[:, None], p_a, residual)
    final_random = inverse_cdf(residual, u_final)  # [B]
    final = torch.where(is_greedy, target_argmax[rows, num_accepted], final_random)  # [B]

    # Row: accepted prefix d_1..d_a, then the final token at column a, then -1.
    keep = torch.arange(gamma, device=device)[None, :] < num_accepted[:, None]  # [B, gamma]
    output = torch.full((bsz, gamma + 1), -1, dtype=torch.long, device=device)
    output[:, :gamma] = torch.where(keep, draft_tokens, -1)
    output.scatter_(1, num_accepted[:, None], final[:, None])
    return VerifyResult(output_tokens=output, num_accepted=num_accepted)


def _draft_dist_at(tokens: Tensor, draft_probs: Tensor | None, pos: Tensor, vocab: int) -> Tensor:
    """Draft distribution q at position ``pos[b]`` of each row: [B, V] float32.

    tokens [B, gamma], draft_probs [B, gamma, V] or None (one-hot q at the drafted
    token), pos [B] in [0, gamma]; pos == gamma (all accepted, no q) is clamped and
    must be masked by the caller.
    """
    bsz, gamma = tokens.shape
    if gamma == 0:
        return torch.zeros(bsz, vocab, device=tokens.device)
    rows = torch.arange(bsz, device=tokens.device)
    at = pos.clamp(max=gamma - 1)  # [B]
    if draft_probs is not None:
        return draft_probs[rows, at].float()
    one_hot = torch.zeros(bsz, vocab, device=tokens.device)
    return one_hot.scatter_(1, tokens[rows, at][:, None], 1.0)


def _check_inputs(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    generators: Sequence[torch.Generator | None],
    num_drafts: Tensor | Sequence[int] | None,
) -> list[int]:
    """Validate shapes and ranges (caller bugs -> ValueError); return num_drafts per row."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, gamma], got {tuple(draft_tokens.shape)}")
    bsz, gamma = draft_tokens.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (bsz, gamma + 1):
        raise ValueError(
            f"target_probs must be [B, gamma+1, V] = [{bsz}, {gamma + 1}, V], got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (bsz, gamma, vocab):
        raise ValueError(
            f"draft_probs must be [B, gamma, V] = {(bsz, gamma, vocab)}, got {tuple(draft_probs.shape)}"
        )
    if len(generators) != bsz:
        raise ValueError(
            f"need one generator (or None) per row: {bsz} rows, {len(generators)} generators"
        )
    if num_drafts is None:
        return [gamma] * bsz
    n = num_drafts.tolist() if isinstance(num_drafts, Tensor) else [int(k) for k in num_drafts]
    if len(n) != bsz or any(not 0 <= k <= gamma for k in n):
        raise ValueError(f"num_drafts must be [B] with values in [0, {gamma}], got {n}")
    return n


def _check_tokens(draft_tokens: Tensor, num_drafts: list[int], vocab: int) -> None:
    """Draft ids inside the vocabulary wherever a row carries a draft (ValueError)."""
    n = torch.tensor(num_drafts, device=draft_tokens.device)  # [B]
    in_block = torch.arange(draft_tokens.shape[1], device=draft_tokens.device)[None, :] < n[:, None]
    bad = in_block & ((draft_tokens < 0) | (draft_tokens >= vocab))
    if bool(bad.any()):
        raise ValueError(
            f"draft token ids outside [0, {vocab}) at (row, position) {bad.nonzero().tolist()[:5]}"
        )
