"""Qwen3 DSpark / DFlash drafts (``spec=dspark`` / ``spec=dflash`` with ``model.arch=qwen3``).

A separate draft directory, as the DFlash and DeepSpec projects publish it: a small stack
of Qwen3 decoder layers conditioned on the target's hidden states captured at
``target_layer_ids`` (``-1`` = the embedding output), concatenated in config order.

* Context: ``ctx = hidden_norm(fc(aux))`` per committed position; every draft layer keeps
  its ``k_norm(k_proj(ctx))`` (RoPE at the context position) and ``v_proj(ctx)`` for the
  **whole** committed context (no window). Nothing speculative is ever written.
* Block: ``embed_tokens([anchor, fill ...])`` at positions ``p .. p+W-1``; each layer is
  the Qwen3 pre-norm block, its queries seeing all context K/V plus every block row's own
  K/V (no causal mask inside the block). Final ``norm`` (this is the confidence head's
  input, as in DeepSpec), logits through ``lm_head``.
* Vocabulary: the draft's own ``embed_tokens`` / ``lm_head`` when its directory has them
  (DeepSpec saves and can train them), else the target's.
* Layout: the draft's config.json says which block it was trained on
  (:func:`~xspec.models.qwen3.draft_config.trained_layout`), and that layout is used
  whatever the method: DeepSpec's "dflash" drafts (``Qwen3DSparkModel`` with
  ``markov_rank`` 0, no confidence head) run the DSpark block under ``spec=dflash``. A
  draft that needs the other method is refused naming it (a DSpark draft with a Markov /
  confidence head under ``spec=dflash``; a z-lab DFlash draft under ``spec=dspark``).
  Where config.json does not say, the method's layout is used, and DFlash skips any
  Markov / confidence tensors.

Checkpoint names (an optional leading ``model.`` is stripped) are the DeepSpec
``Qwen3DSparkModel.state_dict()`` keys; :data:`NAME_MAP` is the only renaming (the heads
live under the names the block drafter reads). The math reuses the target's modules
(:class:`~xspec.models.qwen3.model.DecoderLayer`, ``project_q`` / ``project_kv``, RoPE
tables): the draft is Qwen3 math, not a second copy of it. Draft layers are always dense
(DeepSpec builds ``Qwen3MLP`` even for a MoE target's copied config).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from xspec.errors import CheckpointError
from xspec.models.base import KvBytes
from xspec.models.block_draft import BlockLayout
from xspec.models.draft_heads import ConfidenceHead, MarkovHead
from xspec.models.loading import CONFIG_NAME, Checkpoint, check_params, require_tensors_for
from xspec.models.qwen3.args import Qwen3Args
from xspec.models.qwen3.draft_config import DraftConfig, parse_config
from xspec.models.qwen3.model import (
    DecoderLayer,
    KvRows,
    Qwen3State,
    RMSNorm,
    rope_inv_freq,
    rope_tables,
)

if TYPE_CHECKING:
    from xspec.models.qwen3.model import Qwen3Model

log = logging.getLogger(__name__)

DEFAULT_GAMMA = 4  # drafts per step when config.json has no block_size
# checkpoint prefix -> module prefix (everything else maps to itself)
NAME_MAP = {"markov_head.": "markov.", "confidence_head.": "confidence."}
HEAD_PREFIXES = tuple(NAME_MAP)


# -- the plan: everything checked before a parameter exists ------------------------------


@dataclass(frozen=True)
class DraftPlan:
    layout: BlockLayout
    cfg: DraftConfig
    own_embed: bool  # embed_tokens.weight in the directory
    own_head: bool  # lm_head.weight in the directory
    confidence_bias: bool  # confidence_head.proj.bias in the directory

    @property
    def use_markov(self) -> bool:
        return self.layout is BlockLayout.DSPARK and self.cfg.markov_rank > 0

    @property
    def use_confidence(self) -> bool:
        return self.layout is BlockLayout.DSPARK and self.cfg.confidence

    @property
    def trained_gamma(self) -> int:
        """gamma of the trained block: DSpark's block is gamma rows, DFlash's gamma + 1."""
        block = self.cfg.block_size
        if block is None:
            return DEFAULT_GAMMA
        return block if self.layout is BlockLayout.DSPARK else max(block - 1, 1)

    def rename(self, name: str) -> str | None:
        """Checkpoint tensor name -> module state_dict key; None = skip."""
        name = name.removeprefix("model.")  # a duplicate with and without it is an error
        if name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed from the config
        if name.startswith(HEAD_PREFIXES) and self.layout is BlockLayout.DFLASH:
            return None  # DFlash drafts without the DSpark heads
        for src, dst in NAME_MAP.items():
            if name.startswith(src):
                return dst + name[len(src) :]
        return name


def plan_for(layout: BlockLayout, cfg: DraftConfig, *, own_vocab: bool) -> DraftPlan:
    """The plan of a draft written from scratch (DeepSpec names, confidence bias)."""
    return DraftPlan(layout, cfg, own_vocab, own_vocab, confidence_bias=True)


def block_layout(method: BlockLayout, cfg: DraftConfig, where: Path) -> BlockLayout:
    """The layout to run a draft with under ``spec=<method>``: the one it was trained on.

    Raises a CheckpointError naming the other method when this one cannot use the draft.
    """
    trained = BlockLayout(cfg.layout) if cfg.layout is not None else method
    if trained is method:
        return method
    if trained is BlockLayout.DSPARK:
        heads = [f"a Markov head (markov_rank={cfg.markov_rank})"] if cfg.markov_rank else []
        heads += ["a confidence head"] if cfg.confidence else []
        if not heads:  # DeepSpec's DFlash: the sample-from-anchor block, nothing else
            log.info(
                "spec=dflash: %s is a DeepSpec DFlash draft (%s, markov_rank 0): running its "
                "block [anchor, noise x (gamma-1)], row i predicting p+i+1",
                where.parent, cfg.layout_source,
            )  # fmt: skip
            return trained
        raise CheckpointError(
            f"{where}: this is a DSpark draft ({cfg.layout_source}) with "
            f"{' and '.join(heads)}, which spec=dflash does not use; use it with spec=dspark"
        )
    raise CheckpointError(
        f"{where}: this is a DFlash draft ({cfg.layout_source}: block [anchor, mask x gamma], "
        "row i predicting p+i); DSpark would read every row one position off; use it with "
        "spec=dflash"
    )


def plan_draft(
    method: BlockLayout, draft_dir: Path, target: Qwen3Args
) -> tuple[Checkpoint, DraftPlan]:
    """Read and check the draft directory against the target (headers only)."""
    ckpt = Checkpoint(draft_dir)
    cfg = parse_config(ckpt.config, ckpt.path / CONFIG_NAME)
    require_tensors_for(ckpt, {"num_hidden_layers": cfg.args.num_hidden_layers})
    layout = block_layout(method, cfg, ckpt.path / CONFIG_NAME)
    problems = _target_problems(layout, cfg, target)
    if problems:
        raise CheckpointError(
            f"draft {ckpt.path} does not fit the target ({len(problems)} problem(s))",
            problems=problems,
        )
    stripped = {n.removeprefix("model.") for n in ckpt.names()}
    plan = DraftPlan(
        layout,
        cfg,
        own_embed="embed_tokens.weight" in stripped,
        own_head="lm_head.weight" in stripped,
        confidence_bias="confidence_head.proj.bias" in stripped,
    )
    check_params(Qwen3BlockDraft(plan, target=None, device="meta"), ckpt, plan.rename)
    return ckpt, plan


def _target_problems(layout: BlockLayout, cfg: DraftConfig, target: Qwen3Args) -> list[str]:
    d, t = cfg.args, target
    problems = []
    if d.hidden_size != t.hidden_size:
        problems.append(f"hidden_size is {d.hidden_size} but the target's is {t.hidden_size}")
    if d.vocab_size != t.vocab_size:
        problems.append(f"vocab_size is {d.vocab_size} but the target's is {t.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if not -1 <= i < t.num_hidden_layers]
    if bad:
        problems.append(
            f"target layer ids {bad} are outside -1..{t.num_hidden_layers - 1} (the target has "
            f"{t.num_hidden_layers} layers; -1 = the embedding output)"
        )
    # spec=dspark with markov_rank 0 is allowed: DeepSpec's DFlash configs train the
    # sample-from-anchor block without a Markov head
    return problems


# -- the model ---------------------------------------------------------------------------


# One sequence's draft context: per layer K/V of every committed position
# (``num_tokens`` = context rows written = the anchor's position at propose time); the
# same growable buffer as the target's state.
DraftCache = Qwen3State


class Qwen3BlockDraft(nn.Module):
    """A :class:`~xspec.spec.block.BlockDraftModel` over Qwen3 decoder layers.

    Built uninitialised (``device="meta"``: shapes only, for header checks); fill it with
    ``load_params(model, ckpt, plan.rename)`` or random values.
    """

    def __init__(
        self,
        plan: DraftPlan,
        *,
        target: Qwen3Model | None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_context: int | None = None,
    ) -> None:
        super().__init__()
        cfg, args = plan.cfg, plan.cfg.args
        d, V = args.hidden_size, args.vocab_size
        self.args, self.fill_token_id = args, cfg.fill_token_id
        self.max_context = max_context or args.max_position_embeddings
        with torch.device("meta"):
            self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
            self.hidden_norm = RMSNorm(d, args.rms_norm_eps)
            self.layers = nn.ModuleList(
                DecoderLayer(args, i) for i in range(args.num_hidden_layers)
            )
            self.norm = RMSNorm(d, args.rms_norm_eps)
            self.embed_tokens = nn.Embedding(V, d) if plan.own_embed else None
            self.lm_head = nn.Linear(d, V, bias=False) if plan.own_head else None
            rank = cfg.markov_rank if plan.use_markov else 0
            self.markov = MarkovHead(V, rank, dtype=dtype, device="meta") if rank else None
            self.confidence = (
                ConfidenceHead(
                    d,
                    rank if cfg.confidence_with_markov else 0,
                    bias=plan.confidence_bias,
                    dtype=dtype,
                    device="meta",
                )
                if plan.use_confidence
                else None
            )
        self.to(dtype)
        if torch.device(device).type != "meta":
            self.to_empty(device=device)
        inv_freq, self.rope_scale = rope_inv_freq(args)
        self.inv_freq = inv_freq.to(device)  # [hd/2] fp32, a plain tensor (stays fp32)
        # the target's vocabulary where the draft has none (plain tensors: not loaded)
        # (detached: a Parameter attribute would register, and be expected in the checkpoint)
        self._target_embed: torch.Tensor | None = None
        self._target_head: torch.Tensor | None = None
        if target is not None:
            embed = target.model.embed_tokens.weight
            head = embed if target.lm_head is None else target.lm_head.weight
            self._target_embed, self._target_head = embed.detach(), head.detach()

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def _layers(self) -> list[DecoderLayer]:
        return list(self.layers)  # type: ignore[arg-type]

    def _embed_weight(self) -> torch.Tensor:  # [V, d]
        w = self.embed_tokens.weight if self.embed_tokens is not None else self._target_embed
        assert w is not None, "a draft without embed_tokens needs the target's"
        return w

    def _head_weight(self) -> torch.Tensor:  # [V, d]
        w = self.lm_head.weight if self.lm_head is not None else self._target_head
        assert w is not None, "a draft without lm_head needs the target's"
        return w

    # -- BlockDraftModel ----------------------------------------------------------------

    def new_cache(self, gamma: int, max_tokens: int | None = None) -> DraftCache:
        a = self.args
        kv = torch.empty(
            a.num_hidden_layers, 2, a.num_key_value_heads, 0, a.head_dim,
            dtype=self.dtype, device=self.device,
        )  # fmt: skip
        return DraftCache(num_tokens=0, kv=kv, max_tokens=max_tokens)

    def snapshot(self, cache: DraftCache, start: int) -> KvRows:
        return cache.snapshot(start)  # context K/V rows: append-only, like the target's

    def restore(self, cache: DraftCache, chain: Sequence[KvRows]) -> None:
        cache.restore(chain, self.max_context)

    def kv_bytes(self, gamma: int) -> KvBytes:
        """Context K/V of every committed position, per draft layer; nothing fixed."""
        a = self.args
        es = torch.empty(0, dtype=self.dtype).element_size()
        return KvBytes(0, float(a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * es))

    @torch.no_grad()
    def write_context(
        self, caches: list[DraftCache], aux: torch.Tensor, seq_lens: list[int]
    ) -> None:
        """Append the K/V of ``seq_lens[b]`` committed positions per sequence, projected
        from the target's captured hidden ``aux [sum seq_lens, K*d]``."""
        ctx = self.hidden_norm(self.fc(aux.to(device=self.device, dtype=self.dtype)))  # [T, d]
        starts = [c.num_tokens for c in caches]
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, seq_lens)])
        rope = rope_tables(positions.to(self.device), self.inv_freq, self.rope_scale, self.dtype)
        for c, n in zip(caches, seq_lens):
            c.reserve(c.num_tokens + n, self.max_context)
        for i, layer in enumerate(self._layers()):
            k, v = layer.self_attn.project_kv(ctx, rope)  # [T, KV, hd] each
            row = 0
            for c, p, n in zip(caches, starts, seq_lens):
                c.kv[i, 0, :, p : p + n] = k[row : row + n].transpose(0, 1)
                c.kv[i, 1, :, p : p + n] = v[row : row + n].transpose(0, 1)
                row += n
        for c, n in zip(caches, seq_lens):
            c.num_tokens += n

    @torch.no_grad()
    def forward_block(
        self, caches: list[DraftCache], tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [B, W]`` at positions ``p_b .. p_b+W-1`` -> (``hidden [B, W, d]`` after
        the final norm, raw ``logits [B, W, V]`` fp32). Writes no cache.

        One attention call per layer over the ragged batch: context keys are left-aligned
        and padded to the longest context, block keys follow at ``P .. P+W-1``.
        """
        B, W = tokens.shape
        a, dev = self.args, self.device
        starts = torch.tensor([c.num_tokens for c in caches], device=dev)  # [B]
        P = int(starts.max()) if B else 0
        positions = (starts[:, None] + torch.arange(W, device=dev)).flatten()  # [B*W]
        rope = rope_tables(positions, self.inv_freq, self.rope_scale, self.dtype)
        key_pos = torch.arange(P + W, device=dev)
        visible = (key_pos[None] < starts[:, None]) | (key_pos[None] >= P)  # [B, P+W]
        mask = visible[:, None, None, :]  # [B, 1, 1, P+W]: context < p_b, and the block
        keys = torch.zeros(
            B, 2, a.num_key_value_heads, P + W, a.head_dim, dtype=self.dtype, device=dev
        )
        h = F.embedding(tokens.to(dev).flatten(), self._embed_weight())  # [B*W, d]
        for i, layer in enumerate(self._layers()):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.project_q(x, rope).view(B, W, attn.heads, a.head_dim)
            k, v = attn.project_kv(x, rope)  # [B*W, KV, hd] each
            for b, c in enumerate(caches):
                keys[b, :, :, : c.num_tokens] = c.kv[i, :, :, : c.num_tokens]
            keys[:, 0, :, P:] = k.view(B, W, -1, a.head_dim).transpose(1, 2)
            keys[:, 1, :, P:] = v.view(B, W, -1, a.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys[:, 0], keys[:, 1], attn_mask=mask, enable_gqa=True
            )  # [B, H, W, hd]
            h = h + attn.o_proj(out.transpose(1, 2).reshape(B * W, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = self.norm(h)  # [B*W, d]
        logits = F.linear(hidden, self._head_weight()).float()  # [B*W, V]
        return hidden.view(B, W, -1), logits.view(B, W, -1)
