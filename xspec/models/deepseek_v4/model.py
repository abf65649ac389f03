"""The DeepSeek-V4 target model (TargetModel protocol of xspec/models/base.py).

Parameter names equal the official checkpoint names (``embed.weight``,
``layers.{i}.attn.wq_a.weight``, ``layers.{i}.hc_attn_fn``, ``hc_head_fn``...), so
``model.load_state_dict(official_tensors)`` is an identity map and
``safetensors.torch.save_file(model.state_dict())`` + ``args.to_config()`` is a checkpoint
that transformers' ``DeepseekV4ForCausalLM`` loads through its renaming table.

``Block`` (mHC + attention + MoE) is reusable on its own: the MTP / DSpark drafters build
their SWA-only stages as ``Block(args, layer_id, compress_ratio=0, hash_routed=False)``
with a cache from ``block.new_cache(...)`` and a :class:`BlockContext`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from xspec.errors import ConfigError, RequestError
from xspec.models.base import (
    CapturePoint,
    CaptureSite,
    ForwardBatch,
    KvBytes,
    ModelOutput,
)
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.attention import Attention
from xspec.models.deepseek_v4.mhc import HyperHead, RMSNorm, hc_post, hc_pre, new_hc_params
from xspec.models.deepseek_v4.moe import MoE
from xspec.models.deepseek_v4.state import (
    BlockContext,
    DeepseekV4State,
    LayerCache,
    StateSnapshot,
    kv_bytes,
)
from xspec.models.deepseek_v4.steps import Steps, steps_for
from xspec.models.ops import EAGER_STEPS, StepOptions

if TYPE_CHECKING:
    from xspec.parallel.expert import ExpertParallel


class Block(nn.Module):
    """One decoder layer: ``hc_attn`` + attention, ``hc_ffn`` + MoE, on the mHC streams.

    Checkpoint tensors (``layers.{i}.``): ``attn_norm, ffn_norm``, ``hc_{attn,ffn}_{fn,base,
    scale}``, ``attn.*``, ``ffn.*``. ``steps``: how the stateless steps run (the
    platform's ops, the compiler; ``models.ops.StepOptions``), handed to every submodule.
    """

    def __init__(
        self,
        args: DeepseekV4Args,
        layer_id: int,
        compress_ratio: int,
        hash_routed: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        expert_parallel: ExpertParallel | None = None,
        steps: StepOptions = EAGER_STEPS,
    ) -> None:
        super().__init__()
        self.args = args
        self.layer_id = layer_id
        self.compress_ratio = compress_ratio
        self.ops = ops = steps.ops
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, device=device, ops=ops)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, device=device, ops=ops)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = new_hc_params(
            args, head=False, device=device
        )
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = new_hc_params(
            args, head=False, device=device
        )
        self.attn = Attention(args, compress_ratio, dtype=dtype, device=device, ops=ops)
        self.ffn = MoE(
            args,
            hash_routed,
            dtype=dtype,
            device=device,
            expert_parallel=expert_parallel,
            tag=layer_id,
            steps=steps,
        )
        self.steps: Steps = steps_for(
            steps, Block.mix_in, Attention.project, Block.mix_out, moe=expert_parallel is None
        )

    def forward(self, x: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        """``x [T, hc, d]`` streams -> ``[T, hc, d]``; ``ctx.caches`` are this block's.

        The stateless parts run through ``self.steps`` (eager or compiled, with the
        platform's ops: see ``steps.py`` and ``models.ops``);
        the attention core between them reads and writes the caches eagerly.
        """
        h, post, comb = self.steps.mix_in(self, x)
        out, rot = self.attend(h, ctx)
        return self.steps.mix_out(self, out, rot[0], rot[1], x, post, comb, ctx.input_ids)

    def mix_in(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streams ``x [T, hc, d]`` -> the normed attention input ``[T, d]`` and the
        ``post, comb`` mixes of the attention site."""
        site = (self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        u, post, comb = hc_pre(x, *site, self.args, self.ops)
        return self.attn_norm(u), post, comb

    def mix_out(
        self,
        out: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        x: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        input_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The rest of the block after the attention core: ``out [T, H, D]`` fp32 (its
        result), ``cos, sin`` its rows' rotation, the streams ``x`` it read with their
        ``post, comb`` -> the block output ``[T, hc, d]``."""
        x = hc_post(self.attn.output(out, (cos, sin), x.dtype), x, post, comb)
        site = (self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        u, post, comb = hc_pre(x, *site, self.args, self.ops)
        return hc_post(self.ffn(self.ffn_norm(u), input_ids), x, post, comb)

    def attend(
        self, x: torch.Tensor, ctx: BlockContext
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The attention core on the normed input ``x [T, d]`` -> its result ``[T, H, D]``
        fp32 (before the output projection) and the rows' rotation ``cos, sin`` (the
        DSpark stages replace it with block attention over their context windows)."""
        return self.attn(x, ctx, self.steps)

    def new_cache(self, *, max_rollback: int, max_context: int) -> LayerCache:
        """Empty per-sequence cache of this block (truncate it with ``cache.truncate(n)``)."""
        return self.attn.new_cache(max_rollback=max_rollback, max_context=max_context)


class DeepseekV4Model(nn.Module, HyperHead):
    """DeepSeek-V4 target: logits, the pre-``hc_head`` residual and captured hidden states."""

    checkpoint_dir: Path | None = None  # set by load_checkpoint: tokenizer.json, drafters
    quant_compute: str = "auto"  # set by load_checkpoint (model.quant_compute): drafters

    def __init__(
        self,
        args: DeepseekV4Args,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_rollback: int = 8,
        max_context: int | None = None,
        expert_parallel: ExpertParallel | None = None,
        steps: StepOptions = EAGER_STEPS,
    ) -> None:
        super().__init__()
        problems = args.problems()
        if problems:
            raise ConfigError("invalid DeepSeek-V4 arguments", problems=problems)
        if max_rollback < 0:
            raise ConfigError(f"max_rollback must be >= 0, got {max_rollback}")
        self.args = args
        self.vocab_size = args.vocab_size
        self.hidden_size = args.hidden_size
        self.num_layers = args.num_hidden_layers
        self.max_context = max_context or args.max_position_embeddings
        self.max_rollback = max_rollback
        self.dtype = dtype
        # this rank's share of the experts (None: all of them); the drafters share it
        self.expert_parallel = expert_parallel
        # the platform's ops and compiler (the drafters get the same from the platform)
        self.steps = steps
        self.ops = steps.ops
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            Block(
                args,
                i,
                ratio,
                args.is_hash_layer(i),
                dtype=dtype,
                device=device,
                expert_parallel=expert_parallel,
                steps=steps,
            )
            for i, ratio in enumerate(args.target_compress_ratios)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, device=device, ops=self.ops)
        self.head = nn.Linear(
            args.hidden_size, args.vocab_size, bias=False, dtype=dtype, device=device
        )
        self.init_hyper_head(args, device)

    # -- TargetModel -------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_state(self, max_tokens: int | None = None) -> DeepseekV4State:
        blocks: list[Block] = list(self.layers)  # type: ignore[arg-type]
        limit = min(self.max_context, max_tokens or self.max_context)  # entry growth cap
        layers = [
            block.new_cache(max_rollback=self.max_rollback, max_context=limit) for block in blocks
        ]
        return DeepseekV4State(layers, self.max_rollback)

    def kv_bytes(self) -> KvBytes:
        fixed, per_token = kv_bytes(self.args, self.dtype, self.max_rollback)
        return KvBytes(fixed, per_token)

    @property
    def prefix_granularity(self) -> int:
        """Blocks hold whole compressed entries: a multiple of every compression ratio."""
        return math.lcm(1, *(r for r in self.args.target_compress_ratios if r))

    def snapshot(self, state: DeepseekV4State, start: int) -> StateSnapshot:
        return state.snapshot(start)

    def restore(self, state: DeepseekV4State, chain: Sequence[StateSnapshot]) -> None:
        state.restore(chain)

    def truncate(self, state: DeepseekV4State, num_tokens: int) -> None:
        state.truncate(num_tokens)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """Score ``batch`` (see ForwardBatch); every state advances by its row count."""
        with self.steps.rows():  # batch-invariant GEMMs where the platform pads rows
            return self.score(batch)

    def score(self, batch: ForwardBatch) -> ModelOutput:
        """:meth:`forward` under the caller's grad mode: training runs the inference
        modules themselves through it (fresh states, whole sequences as prefill)."""
        self._check_batch(batch)
        boundary = self._capture_boundaries(batch.capture)  # validated before any state moves
        device = self.embed.weight.device
        ids = batch.input_ids.to(device)
        starts = [s.num_tokens for s in batch.states]
        for state, n in zip(batch.states, batch.seq_lens):
            state.reserve(state.num_tokens + n)
        ctx = BlockContext(ids, batch.positions().to(device), list(batch.seq_lens), starts)
        captured: dict[int, torch.Tensor] = {}
        x = self.embed(ids)  # [T, d]
        x = x.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()  # [T, hc, d]
        for i, block in enumerate(self.layers):
            if i in boundary:
                captured[i] = x.float().mean(dim=1)
            x = block(x, ctx.for_block([s.layers[i] for s in batch.states]))
        if self.num_layers in boundary:  # (not otherwise: an fp32 copy of every row)
            captured[self.num_layers] = x.float().mean(dim=1)
        for state, n in zip(batch.states, batch.seq_lens):
            state.advance(n)
        logits = self.head(self.norm(self.hyper_head(batch.scored(x)))).float()  # [T', V]
        aux = torch.cat([captured[b] for b in boundary], dim=-1) if boundary else None
        return ModelOutput(logits=logits, hidden=x, aux_hidden=aux)

    # -- helpers -----------------------------------------------------------------------

    def _capture_boundaries(self, points: list[CapturePoint]) -> list[int]:
        """Residual index of each capture point: ``b`` = the residual entering layer ``b``
        (``b == num_layers``: the final residual). OUTPUT of ``l`` is boundary ``l+1``."""
        out, bad = [], []
        for p in points:
            b = p.layer + 1 if p.site == CaptureSite.OUTPUT else p.layer
            if not (
                0 <= p.layer < self.num_layers
                or (p.layer == self.num_layers and p.site == CaptureSite.INPUT)
            ):
                bad.append(f"{p} (the model has layers 0..{self.num_layers - 1})")
            out.append(b)
        if bad:
            raise ConfigError("capture points outside the DeepSeek-V4 target", problems=bad)
        return out

    def _check_batch(self, batch: ForwardBatch) -> None:
        ids = batch.input_ids
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise RequestError(
                f"input_ids must be a 1-D integer tensor, got {tuple(ids.shape)} {ids.dtype}"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise RequestError(
                f"input_ids contain ids outside [0, {self.vocab_size}) (min {int(ids.min())}, "
                f"max {int(ids.max())}); the tokenizer does not match this checkpoint"
            )
        for i, (state, n) in enumerate(zip(batch.states, batch.seq_lens)):
            if not isinstance(state, DeepseekV4State) or len(state.layers) != self.num_layers:
                raise ValueError(f"sequence {i}: state was not made by this model's new_state()")
            if state.num_tokens + n > self.max_context:
                raise RequestError(
                    f"sequence {i} would hold {state.num_tokens + n} tokens, more than "
                    f"max_context={self.max_context}; shorten the prompt or max_new_tokens"
                )

    # -- random weights ----------------------------------------------------------------

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Deterministic, well-conditioned random weights (tests, toy training start).

        Projections ~ N(0, 1/fan_in) so every activation stays O(1) through the norms;
        mHC ``fn`` rows scaled so mixes are O(1), random ``base``/``scale`` give non-trivial
        stream mixing; random sinks, ``ape``, router bias; ``tid2eid`` rows hold distinct
        valid expert ids.
        """
        init_random(self, self.args, seed)


@torch.no_grad()
def init_random(module: nn.Module, args: DeepseekV4Args, seed: int) -> None:
    """Fill every tensor of ``module``'s state_dict with :func:`random_like` values, from
    one generator seeded with ``seed`` (the target, the MTP layer and the DSpark stages
    all use this scheme)."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in module.state_dict(keep_vars=True).items():
        tensor.copy_(random_like(name, tensor, gen, args))


def random_like(
    name: str, t: torch.Tensor, gen: torch.Generator, args: DeepseekV4Args
) -> torch.Tensor:
    """Random values for checkpoint tensor ``name`` (shape of ``t``), by tensor kind; shared
    by the target and the drafters so every random preset follows one scheme."""

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        order = torch.rand(t.shape[0], args.n_routed_experts, generator=gen).argsort(dim=1)
        return order[:, : t.shape[1]]
    if name == "embed.weight":
        return normal(1.0)
    if leaf.endswith("_fn"):  # mHC projections read the RMS-normalised [hc*d] streams
        return normal(1.0 / math.sqrt(t.shape[1]))
    if leaf.endswith("_base"):
        return normal(0.5)
    if leaf.endswith("_scale"):
        return 0.5 + torch.rand(t.shape, generator=gen)
    if leaf == "attn_sink":
        return normal(1.0)
    if leaf == "ape":
        return normal(0.5)
    if leaf == "bias":  # router selection bias
        return normal(0.1)
    if t.dim() == 1:  # norm weights
        return normal(0.1, mean=1.0)
    w = normal(1.0 / math.sqrt(t.shape[1]))  # linear [out, in]
    if name.endswith("indexer.wq_b.weight"):
        # Query heads in +/- pairs: one head of each pair has a positive ReLU term for
        # every (query, entry), so index scores are never exactly 0. Exact ties, whose
        # top-k order the official code leaves unspecified, then cannot occur and
        # random models compare tie-free against other implementations.
        heads = w.view(args.index_n_heads, -1, w.shape[1])
        pairs = args.index_n_heads // 2
        heads[1 : 2 * pairs : 2] = -heads[0 : 2 * pairs : 2]
    return w
