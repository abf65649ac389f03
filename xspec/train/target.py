"""Training the tiny DeepSeek-V4 target from scratch on the corpus.

The model is :class:`~xspec.models.deepseek_v4.model.DeepseekV4Model` itself: each step
scores whole windows as a prefill through :meth:`DeepseekV4Model.score` (fresh states,
the inference attention, compressors, indexer, mHC and MoE), with next-token
cross-entropy. The learned routers' selection bias follows DeepSeek's auxiliary-loss-free
balancing: after each step every bias moves by ``bias_rate`` towards the mean load
(``+`` for under-loaded experts, ``-`` for over-loaded ones); it has no gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from xspec.models.base import ForwardBatch
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.model import DeepseekV4Model
from xspec.models.deepseek_v4.moe import Gate
from xspec.train.corpus import BOS, EOS, sample_windows
from xspec.train.loop import LossFn


def target_args(vocab_size: int, num_layers: int = 12) -> DeepseekV4Args:
    """The trained tiny target: ``DeepseekV4Args.tiny()`` (every Flash feature: SWA, CSA
    with the indexer, HCA, hash layers, mHC with 4 streams, sqrtsoftplus top-2 of 8
    experts + 1 shared) made deeper (``num_layers``, alternating CSA / HCA after two SWA
    layers, the last SWA), narrower experts and the trained vocabulary."""
    cycle = [0, 0, *[4, 128] * num_layers]
    pattern = [*cycle[: num_layers - 1], 0]
    return dataclasses.replace(
        DeepseekV4Args.tiny(),
        vocab_size=vocab_size,
        num_hidden_layers=num_layers,
        compress_ratios=[*pattern, 0],  # the last entry: the MTP layer
        moe_intermediate_size=32,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def router_balancer(model: torch.nn.Module, rate: float) -> tuple[Callable[[], None], list]:
    """Hooks counting expert loads on every learned router, and the after-step update of
    their selection biases (auxiliary-loss-free balancing). Returns (update, handles)."""
    gates = [m for m in model.modules() if isinstance(m, Gate) and not m.hash_routed]
    loads = {id(g): torch.zeros(g.args.n_routed_experts) for g in gates}

    def count(gate: Gate, _inputs: object, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        loads[id(gate)].add_(torch.bincount(out[1].flatten(), minlength=len(loads[id(gate)])))

    handles = [g.register_forward_hook(count) for g in gates]

    @torch.no_grad()
    def update() -> None:
        for g in gates:
            load = loads[id(g)]
            assert g.bias is not None
            g.bias.add_(rate * torch.sign(load.mean() - load))
            load.zero_()

    return update, handles


def lm_loss(model: DeepseekV4Model, stream: torch.Tensor, batch: int, length: int) -> LossFn:
    """Next-token cross-entropy on ``batch`` random windows of ``length`` tokens."""

    def loss_fn(gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        ids = sample_windows(stream, batch, length, gen)  # [B, T]
        states = [model.new_state(length) for _ in range(batch)]
        out = model.score(ForwardBatch(ids.flatten(), [length] * batch, states))
        logits = out.logits.view(batch, length, -1)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        return loss, {"loss": loss.item()}

    return loss_fn
