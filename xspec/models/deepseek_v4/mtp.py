"""The DeepSeek-V4 MTP (multi-token prediction) module and its two checkpoint layouts.

One MTP block is a full V4 :class:`~xspec.models.deepseek_v4.model.Block` (SWA-only
attention, learned top-k MoE, mHC) plus an input combiner and its own output head. Row
``i`` (position ``i``) reads the target's pre-``hc_head`` residual ``H_i [hc, d]`` (which
predicts ``tok_{i+1}``) and the token ``tok_{i+1}``, and predicts ``tok_{i+2}``::

    X = e_proj(enorm(embed(tok_{i+1})))[None] + h_proj(hnorm(rot(H_i)))   # [hc, d]
    X = Block(X)                                                          # its own SWA cache
    logits = head(norm(hc_head(X)))

``hnorm`` normalises each stream; ``rot`` (QuaRot ``rot.weight``) exists only when the
checkpoint ships it (xLLM applies it to the target hidden before ``hnorm``). The block
output ``X`` is the MTP's own "hidden": drafting more than one token feeds it back in
place of the target's ``H``. ``embed`` / ``head`` are the target's unless the checkpoint
has dedicated vocabulary tensors, which then always win (whatever shard they sit in).

Position 0: vLLM and xLLM zero the token embedding of the row at position 0. The
official reference forward (and the MTP training objective) has no such mask, so xspec
does not zero it: every row, position 0 included, combines a real (H_i, tok_{i+1}) pair.

Layouts, as a declarative name map (:data:`OFFICIAL`, :data:`EXPORTED`):

* **official** (``mtp.0.*`` next to the target's tensors; ``compress_ratios[N]`` is the
  MTP layer's ratio, N = ``num_hidden_layers``, absent = 0): the block's tensors are
  ``mtp.0.<module key>`` (``mtp.0.e_proj.weight``, ``mtp.0.attn.wq_a.weight``,
  ``mtp.0.hc_head_fn``...); optional ``mtp.0.embed.weight`` / ``mtp.0.head.weight``;
  optional top-level ``rot.weight``.
* **exported** (xLLM ``tools/export_mtp.py``: ``config.json`` with ``model_type:
  deepseek_v4_mtp``, ``num_hidden_layers: 1``, ``num_hash_layers: 0``; the MTP layer is
  the model's layer 0, so its ratio is ``compress_ratios[0]``): ``model.layers.0.<module
  key>``; vocabulary tensors, when exported at all, as ``model.embed_tokens.weight``,
  ``model.layers.0.{embed,embed_tokens,emb.tok_emb}.weight``,
  ``model.layers.0.{head,shared_head.head}.weight`` or ``lm_head.weight``; when absent the
  target's are used (so the draft's ``hidden_size`` / ``vocab_size`` must equal the
  target's, which :func:`plan_mtp` checks); ``model.rot.weight``.

Both layouts may be W8A8 (msModelSlim) or FP8-block quantised like the target; the
tensors are dequantised while streaming, with the target loader's rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from xspec.errors import CheckpointError
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.draft_plan import crossover_problems, plan_tensors
from xspec.models.deepseek_v4.mhc import HyperHead, RMSNorm
from xspec.models.deepseek_v4.model import Block, init_random
from xspec.models.deepseek_v4.state import BlockContext
from xspec.models.deepseek_v4.weights import load_drafter
from xspec.models.loading import CONFIG_NAME, Checkpoint, require_tensors_for
from xspec.models.ops import EAGER_STEPS, StepOptions

if TYPE_CHECKING:
    from xspec.parallel.expert import ExpertParallel

EXPORTED_MODEL_TYPE = "deepseek_v4_mtp"
VOCAB_KEYS = ("embed.weight", "head.weight")


@dataclass(frozen=True)
class MtpLayout:
    """Where a checkpoint layout keeps the MTP block: ``prefix + <module key>`` plus a few
    names outside the prefix (``extra``: checkpoint name -> module key)."""

    name: str
    prefix: str
    extra: dict[str, str] = field(default_factory=dict)


# Module keys some exporters spell differently under the prefix (V3 / vLLM names).
PREFIX_ALIASES = {
    "emb.tok_emb.weight": "embed.weight",
    "embed_tokens.weight": "embed.weight",
    "shared_head.head.weight": "head.weight",
    "shared_head.norm.weight": "norm.weight",
}
OFFICIAL = MtpLayout("official", "mtp.0.", {"rot.weight": "rot.weight"})
EXPORTED = MtpLayout(
    "exported",
    "model.layers.0.",
    {
        "model.embed_tokens.weight": "embed.weight",
        "lm_head.weight": "head.weight",
        "model.rot.weight": "rot.weight",
    },
)


def module_key(layout: MtpLayout, name: str) -> str | None:
    """The :class:`MtpBlock` state_dict key of checkpoint tensor ``name``; None = not MTP."""
    if name in layout.extra:
        return layout.extra[name]
    if name.startswith(layout.prefix):
        rest = name[len(layout.prefix) :]
        return PREFIX_ALIASES.get(rest, rest)
    return None


class MtpBlock(Block, HyperHead):
    """One MTP layer. State_dict keys are the official names without ``mtp.0.``.

    ``embed`` / ``head``: the target's modules to share, or None to own a dedicated
    ``embed.weight`` / ``head.weight`` (loaded from the checkpoint). ``rot``: own a QuaRot
    ``rot.weight [d, d]`` applied to the incoming hidden before ``hnorm``.
    """

    def __init__(
        self,
        args: DeepseekV4Args,
        *,
        layer_id: int,
        embed: nn.Embedding | None,
        head: nn.Linear | None,
        rot: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        expert_parallel: ExpertParallel | None = None,
        steps: StepOptions = EAGER_STEPS,
    ) -> None:
        # the MTP layer is sliding-window only (ratio 0) with learned (not hash) routing
        super().__init__(
            args,
            layer_id,
            0,
            False,
            dtype=dtype,
            device=device,
            expert_parallel=expert_parallel,
            steps=steps,
        )
        d, vocab, eps = args.hidden_size, args.vocab_size, args.rms_norm_eps
        kw: dict = dict(bias=False, dtype=dtype, device=device)
        self.e_proj = nn.Linear(d, d, **kw)
        self.h_proj = nn.Linear(d, d, **kw)
        self.enorm = RMSNorm(d, eps, device=device, ops=self.ops)
        self.hnorm = RMSNorm(d, eps, device=device, ops=self.ops)
        self.norm = RMSNorm(d, eps, device=device, ops=self.ops)
        self.init_hyper_head(args, device)
        self.rot = nn.Linear(d, d, **kw) if rot else None
        # Shared vocabulary modules live in a tuple: not registered, so they are neither
        # part of this module's state_dict (the loader would demand them) nor moved by .to().
        own_embed = nn.Embedding(vocab, d, dtype=dtype, device=device) if embed is None else None
        own_head = nn.Linear(d, vocab, **kw) if head is None else None
        self.embed, self.head = own_embed, own_head
        self._vocab: tuple[nn.Embedding, nn.Linear] = (
            embed if embed is not None else own_embed,  # type: ignore[assignment]
            head if head is not None else own_head,
        )

    @property
    def owns_vocab(self) -> tuple[bool, bool]:
        """(dedicated embedding, dedicated head)."""
        return self.embed is not None, self.head is not None

    def combine(
        self, hidden: torch.Tensor, tokens: torch.Tensor, *, own: bool = False
    ) -> torch.Tensor:
        """The block input: ``hidden [T, hc, d]``, ``tokens [T]`` -> ``[T, hc, d]``.

        ``rot`` maps the target's (QuaRot-rotated) residual basis into the MTP's; the
        MTP's own hidden (``own``, chained drafts) is already in its basis.
        """
        e = self.e_proj(self.enorm(self._vocab[0](tokens)))  # [T, d]
        if self.rot is not None and not own:
            hidden = self.rot(hidden)
        return e.unsqueeze(1) + self.h_proj(self.hnorm(hidden))  # hnorm: per stream

    def draft_hidden(
        self, hidden: torch.Tensor, tokens: torch.Tensor, ctx: BlockContext, *, own: bool = False
    ) -> torch.Tensor:
        """MTP rows appended to ``ctx.caches``: ``hidden [T, hc, d]`` (the target's
        pre-hc_head residual at each row's position, or with ``own`` the MTP's own output
        when chaining), ``tokens [T]`` (the token at position + 1) -> the MTP's own hidden
        ``[T, hc, d]``."""
        return self(self.combine(hidden, tokens, own=own), ctx)

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hc, d]`` (from :meth:`draft_hidden`) -> logits ``[T, V]`` fp32."""
        return self._vocab[1](self.norm(self.hyper_head(x))).float()

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Deterministic random weights, the target's ``init_random_`` scheme (tests, the
        tiny preset): linears N(0, 1/fan_in), norm gains ~1, mHC mixes O(1)."""
        init_random(self, self.args, seed)


# -- planning from headers -------------------------------------------------------------


@dataclass
class MtpPlan:
    """Everything needed to allocate and fill an :class:`MtpBlock`, read from headers."""

    ckpt: Checkpoint
    layout: MtpLayout
    args: DeepseekV4Args  # the block's geometry (the draft checkpoint's config.json)
    layer_id: int
    names: dict[str, str]  # checkpoint name -> module key
    dequant: dict[str, str]  # checkpoint name -> "w8a8" | "fp8" | "mxfp4"

    @property
    def keys(self) -> set[str]:
        return set(self.names.values())


def detect_layout(ckpt: Checkpoint) -> MtpLayout:
    """Exported when config.json says ``deepseek_v4_mtp`` (or only ``model.layers.0.*``
    tensors exist); otherwise the official ``mtp.0.*`` layout."""
    if ckpt.config.get("model_type") == EXPORTED_MODEL_TYPE:
        return EXPORTED
    names = ckpt.names()
    if not any(n.startswith(OFFICIAL.prefix) for n in names) and any(
        n.startswith(EXPORTED.prefix) for n in names
    ):
        return EXPORTED
    return OFFICIAL


def plan_mtp(path: str | Path, target_args: DeepseekV4Args | None) -> MtpPlan:
    """Validate an MTP checkpoint from config.json and tensor headers only.

    ``target_args``: the target's config, to check that hidden states and token ids can
    cross over (None skips those checks). Raises one CheckpointError listing every problem.
    """
    ckpt = Checkpoint(path)
    layout = detect_layout(ckpt)
    args = DeepseekV4Args.from_config(ckpt.config, ckpt.path / CONFIG_NAME)
    layer_id = args.num_hidden_layers if layout is OFFICIAL else 0
    problems = _config_problems(ckpt, layout, args, layer_id, target_args)
    if problems:  # geometry is off: per-tensor shape messages would only add noise
        raise _error(ckpt, layout, problems)
    require_tensors_for(ckpt, {"n_routed_experts": args.n_routed_experts})
    names, dequant, problems = plan_tensors(
        ckpt,
        lambda name: module_key(layout, name),
        lambda found: expected_mtp_tensors(
            args, layer_id, "embed.weight" in found, "head.weight" in found, "rot.weight" in found
        ),
        "MTP",
        label=lambda key: layout.prefix + key,
    )
    if problems:
        raise _error(ckpt, layout, problems)
    return MtpPlan(ckpt, layout, args, layer_id, names, dequant)


def _error(ckpt: Checkpoint, layout: MtpLayout, problems: list[str]) -> CheckpointError:
    return CheckpointError(
        f"MTP checkpoint {ckpt.path} ({layout.name} layout, {layout.prefix}*) cannot be used",
        problems=problems,
    )


def _config_problems(
    ckpt: Checkpoint,
    layout: MtpLayout,
    args: DeepseekV4Args,
    layer_id: int,
    target_args: DeepseekV4Args | None,
) -> list[str]:
    where = ckpt.path / CONFIG_NAME
    problems: list[str] = []
    if layout is OFFICIAL and not any(n.startswith(OFFICIAL.prefix) for n in ckpt.names()):
        problems.append(
            f"spec=mtp needs MTP weights: the checkpoint at {ckpt.path} has no mtp.0.* tensors; "
            "set spec.draft_path=/dir/of/exported/mtp (an xLLM export_mtp directory)"
        )
    if layout is OFFICIAL and (
        args.dspark_block_size is not None or "mtp.0.main_proj.weight" in ckpt
    ):
        problems.append(
            f"{ckpt.path} stores DSpark stages under mtp.0/1/2 (Flash-0731), not an MTP layer; "
            "use spec=dspark with this checkpoint"
        )
    ratios = args.compress_ratios
    if layer_id < len(ratios) and ratios[layer_id] != 0:
        problems.append(
            f"{where}: compress_ratios[{layer_id}] (the MTP layer) is {ratios[layer_id]}; the MTP "
            "layer is sliding-window only, set it to 0"
        )
    if target_args is not None:
        problems += crossover_problems(where, args, target_args, "MTP")
    return problems


def expected_mtp_tensors(
    args: DeepseekV4Args, layer_id: int, embed: bool, head: bool, rot: bool
) -> dict[str, list[int]]:
    """Module key -> shape of every MTP tensor (built on the meta device: no memory)."""
    meta = MtpBlock(args, layer_id=layer_id, embed=None, head=None, rot=rot, device="meta")
    shapes = {k: list(v.shape) for k, v in meta.state_dict().items()}
    for key, own in zip(VOCAB_KEYS, (embed, head)):
        if not own:
            del shapes[key]
    return shapes


def load_mtp(
    plan: MtpPlan,
    *,
    embed: nn.Embedding,
    head: nn.Linear,
    dtype: torch.dtype,
    device: torch.device | str,
    expert_parallel: ExpertParallel | None = None,
    steps: StepOptions = EAGER_STEPS,
    quant_compute: str = "auto",
) -> MtpBlock:
    """Allocate the MTP block of ``plan`` and stream its weights in.

    ``embed`` / ``head``: the target's, used unless the checkpoint has dedicated ones.
    ``expert_parallel``: only this rank's experts (the target's EP share). ``steps``:
    the platform's ops and compiler (``Platform.step_options``); quantized linears stay
    resident, computed per ``quant_compute`` (the target's ``model.quant_compute``).
    """
    keys = plan.keys

    def build(on: torch.device | str) -> MtpBlock:
        return MtpBlock(
            plan.args,
            layer_id=plan.layer_id,
            embed=None if "embed.weight" in keys else embed,
            head=None if "head.weight" in keys else head,
            rot="rot.weight" in keys,
            dtype=dtype,
            device=on,
            expert_parallel=expert_parallel,
            steps=steps,
        )

    return load_drafter(
        build,
        plan.ckpt,
        plan.names,
        plan.dequant,
        plan.args,
        expert_parallel,
        device=device,
        dtype=dtype,
        steps=steps,
        quant_compute=quant_compute,
    )


def mtp_tensors(module: MtpBlock, layout: MtpLayout = OFFICIAL) -> dict[str, torch.Tensor]:
    """``module``'s tensors under ``layout``'s names (writing checkpoints, tests)."""
    inverse = {v: k for k, v in layout.extra.items()}
    return {
        inverse.get(key, layout.prefix + key): t.detach() for key, t in module.state_dict().items()
    }
