"""The small heads block drafters (DSpark, DFlash) put on top of their draft backbone.

* :class:`MarkovHead` (DSpark, "vanilla"): a low-rank bigram bias on the draft logits.
  ``markov_w1 [V, r]`` embeds the previous token, ``markov_w2 [V, r]`` maps it back to
  the vocabulary: ``bias(prev) = markov_w2 @ markov_w1[prev]``, added to the *raw* draft
  logits of the next position, before temperature / top-k / top-p.
* :class:`ConfidenceHead`: ``c_k = sigmoid(proj([h_k ; markov_w1[prev_k]]))``, the
  draft's estimate of ``P(draft k accepted | drafts < k accepted)``. ``h_k`` is the
  draft hidden that feeds the LM head (DeepSeek-V4: the ``hc_head`` output *before* the
  final norm; Qwen3: the backbone output, which already includes the final norm).

Checkpoint names, relative to the module that owns them: ``markov_head.markov_w1.weight``,
``markov_head.markov_w2.weight``, ``confidence_head.proj.weight`` (+ optional ``.bias``).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    def __init__(
        self, vocab: int, rank: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank, dtype=dtype, device=device)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False, dtype=dtype, device=device)

    @property
    def rank(self) -> int:
        return int(self.markov_w1.weight.shape[1])

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """``prev [...]`` token ids -> ``W1[prev] [..., r]``."""
        return self.markov_w1(prev)

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """``prev [B]`` -> additive logit bias ``[B, V]`` fp32."""
        return self.markov_w2(self.markov_w1(prev)).float()


class ConfidenceHead(nn.Module):
    """``proj: Linear(d (+ r) -> 1)``; ``with_markov`` when its input includes ``W1[prev]``."""

    def __init__(
        self,
        hidden: int,
        markov_rank: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.with_markov = markov_rank > 0
        self.proj = nn.Linear(hidden + markov_rank, 1, bias=bias, dtype=dtype, device=device)

    def logits(self, h: torch.Tensor, markov_embed: torch.Tensor | None) -> torch.Tensor:
        """``h [..., d]``, ``markov_embed [..., r]`` (or None) -> raw logits ``z [...]`` fp32."""
        if self.with_markov:
            if markov_embed is None:
                raise ValueError("this confidence head reads the Markov embedding; pass it")
            h = torch.cat([h, markov_embed.to(h.dtype)], dim=-1)
        w = self.proj.weight.float()
        b = None if self.proj.bias is None else self.proj.bias.float()
        return nn.functional.linear(h.float(), w, b).squeeze(-1)

    def forward(self, h: torch.Tensor, markov_embed: torch.Tensor | None) -> torch.Tensor:
        """``sigmoid(logits)``: the uncalibrated confidence ``[...]`` fp32."""
        return torch.sigmoid(self.logits(h, markov_embed))
