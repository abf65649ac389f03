"""Linear layers whose weights stay quantized in memory, as the checkpoint stores them.

:class:`QuantLinear` replaces an ``nn.Linear`` whose checkpoint weight is FP8, MXFP4 or
W8A8: its buffers carry the checkpoint's own names and stored dtypes (``weight`` + ``scale``,
or ``weight`` + ``weight_scale`` + ``weight_offset``), so the generic loader streams the
stored bytes straight into them, and :meth:`QuantLinear.quantized` hands the call sites a
:class:`~xspec.models.quantized.QuantizedWeight` for the ``linear`` op. Call sites read a
linear's weight with :func:`weight_of` (a float tensor, or the quantized weight).

:func:`make_resident` swaps the linears of a module built on the meta device (so no float
copy of a quantized weight is ever allocated) before it is materialised and loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from xspec.models.ops import REFERENCE_OPS, ModelOps, linear
from xspec.models.quantized import FORMATS, QuantizedWeight

# buffer names of each format: (data, scale, offset or None); the checkpoint's siblings
SIBLINGS: dict[str, tuple[str, str, str | None]] = {
    "fp8": ("weight", "scale", None),
    "mxfp4": ("weight", "scale", None),
    "w8a8": ("weight", "weight_scale", "weight_offset"),
}


@dataclass(frozen=True)
class StoredWeight:
    """How one quantized weight is stored (from the safetensors headers): ``format``,
    ``tensors`` = buffer name -> (shape, dtype), FP8's scale ``block``."""

    format: str
    tensors: dict[str, tuple[list[int], torch.dtype]]
    block: tuple[int, int] = (128, 128)


class QuantLinear(nn.Module):
    """A bias-free linear ``[out, in]`` holding its weight as stored (see the module
    docstring); ``dtype``: the model dtype it computes in; ``compute``:
    ``model.quant_compute`` (``auto | dequant | native``); ``ops``: the platform's, for
    :meth:`forward`."""

    def __init__(
        self,
        stored: StoredWeight,
        *,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        compute: str,
        device: torch.device | str,
        ops: ModelOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.ops = ops
        if stored.format not in FORMATS:
            raise ValueError(f"unknown quantized format {stored.format!r}; known: {list(FORMATS)}")
        self.format, self.block = stored.format, stored.block
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.compute = dtype, compute
        for name, (shape, dt) in stored.tensors.items():
            self.register_buffer(name, torch.empty(shape, dtype=dt, device=device))

    def quantized(self) -> QuantizedWeight:
        """The weight as the op interface takes it (views of the buffers, no copy)."""
        data, scale, offset = SIBLINGS[self.format]
        return QuantizedWeight(
            self.format,
            self._buffers[data],  # type: ignore[arg-type]
            self._buffers[scale],  # type: ignore[arg-type]
            None if offset is None else self._buffers.get(offset),
            self.dtype,
            self.compute,
            self.block,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]`` (what ``nn.Linear`` computes, through the op)."""
        return linear(self.ops, x, self.quantized())

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, format={self.format}"


def weight_of(linear: nn.Module) -> torch.Tensor | QuantizedWeight:
    """A linear layer's weight as the ops take it: the float parameter, or a
    :class:`QuantizedWeight` for a :class:`QuantLinear`."""
    if isinstance(linear, QuantLinear):
        return linear.quantized()
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def float_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight as a float tensor in the model dtype (a quantized one is
    dequantized for this call: for call sites that reshape the weight, e.g. ``wo_a``)."""
    w = weight_of(linear)
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


def make_resident(
    module: nn.Module,
    stored: dict[str, StoredWeight],
    *,
    dtype: torch.dtype,
    compute: str,
    ops: ModelOps = REFERENCE_OPS,
) -> set[str]:
    """Replace each ``nn.Linear`` at ``key`` of ``stored`` (module path, e.g.
    ``layers.0.attn.wq_b``) with a :class:`QuantLinear` on the linear's device ->
    the keys replaced (a key naming anything but an ``nn.Linear`` without bias is skipped:
    its weight is dequantized while loading)."""
    done: set[str] = set()
    for key, how in stored.items():
        parent_key, _, leaf = key.rpartition(".")
        try:
            parent = module.get_submodule(parent_key) if parent_key else module
            old = getattr(parent, leaf)
        except AttributeError:
            continue
        if type(old) is not nn.Linear or old.bias is not None:
            continue
        new = QuantLinear(
            how,
            in_features=old.in_features,
            out_features=old.out_features,
            dtype=dtype,
            compute=compute,
            device=old.weight.device,
            ops=ops,
        )
        setattr(parent, leaf, new)
        done.add(key)
    return done
