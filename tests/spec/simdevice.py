"""A simulated accelerator on the CPU, to catch host/device mixing without a GPU.

Tensors "on the device" are :class:`OnDevice` instances (a plain ``torch.Tensor``
subclass holding host memory). :class:`SimulatedDevice` is a ``TorchFunctionMode`` that

* places a tensor on the device when code asks for :data:`DEVICE` (``device=`` of a
  factory function, ``.to(DEVICE)``) and reports ``DEVICE`` as its ``.device``;
* records every op that mixes device tensors with host tensors of one or more
  dimensions (what CUDA and NPU refuse; 0-dim host scalars and indexing are allowed,
  as they are there);
* counts host synchronisations: a device tensor read back (``.tolist()``, ``.item()``,
  ``bool()``, ``int()``, ``.cpu()``, ``.to("cpu")``...).

Models run their own math on plain tensors: :class:`SimTarget` and :class:`SimModule`
take device inputs (refusing host ones), run the wrapped module with the mode bypassed,
and hand back device outputs. No device module is mocked: the real kernels run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from xspec.models.base import ForwardBatch, ModelOutput

DEVICE = torch.device("cuda", 0)  # a name only: nothing touches CUDA, memory stays on the host

_SYNCS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
_MIXING_OK = {"__getitem__", "__setitem__", "to", "copy_", "__get__", "__set__"}


class OnDevice(torch.Tensor):
    """A host tensor standing for one on the simulated device."""


def on_device(t: torch.Tensor) -> OnDevice:
    return t.as_subclass(OnDevice)


def on_host(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


def _is_device(d: Any) -> bool:
    return isinstance(d, torch.device | str) and torch.device(d) == DEVICE


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _tensors(y)


class SimulatedDevice(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.mixed: list[str] = []
        self._bypass = 0

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Model internals: plain tensors, no checks."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if self._bypass:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        first = args[0] if args else None
        if (
            name == "__get__"
            and isinstance(first, OnDevice)
            and func == torch.Tensor.device.__get__
        ):
            return DEVICE
        if name == "to":
            return self._to(func, args, kwargs)
        if name in _SYNCS and isinstance(first, OnDevice):
            self.syncs.append(name)
            out = func(*args, **kwargs)
            return on_host(out) if isinstance(out, torch.Tensor) else out
        if _is_device(kwargs.get("device")):  # a factory asked for the device
            kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            return on_device(out) if isinstance(out, torch.Tensor) else out
        flat = [*_tensors(list(args)), *_tensors(list(kwargs.values()))]
        device = any(isinstance(t, OnDevice) for t in flat)
        host = [t for t in flat if not isinstance(t, OnDevice) and t.dim() > 0]
        if device and host and name not in _MIXING_OK:
            self.mixed.append(f"{name}: host tensors {[tuple(t.shape) for t in host]}")
        return func(*args, **kwargs)

    def _to(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        src = args[0]
        targets = [a for a in (*args[1:], kwargs.get("device")) if _is_device(a)]
        to_host = any(
            isinstance(a, torch.device | str)
            and not _is_device(a)
            and torch.device(a).type == "cpu"
            for a in (*args[1:], kwargs.get("device"))
        )
        if targets:
            rest = [a for a in args[1:] if not _is_device(a)]
            kwargs.pop("device", None)
            return on_device(func(on_host(src), *rest, **kwargs))
        if to_host and isinstance(src, OnDevice):
            self.syncs.append("to(cpu)")
            return on_host(func(on_host(src), *args[1:], **kwargs))
        return func(*args, **kwargs)


def _unwrap(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if not isinstance(x, OnDevice) and x.dim() > 0:
            raise AssertionError(f"a host tensor {tuple(x.shape)} reached a device model")
        return on_host(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        tensors = {
            f.name: _unwrap(getattr(x, f.name))
            for f in dataclasses.fields(x)
            if isinstance(getattr(x, f.name), torch.Tensor)
        }
        return dataclasses.replace(x, **tensors)
    return x


def _wrap(x: Any) -> Any:
    return on_device(x) if isinstance(x, torch.Tensor) else x


class SimModule:
    """Calls of the wrapped module take device tensors and return device tensors."""

    def __init__(self, inner: Any, mode: SimulatedDevice, methods: tuple[str, ...]) -> None:
        self._inner, self._mode, self._methods = inner, mode, methods

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self._methods:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(_unwrap(a) for a in args)
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
            with self._mode.bypassed():
                out = attr(*args, **kwargs)
            return _wrap(out)

        return call


class SimTarget:
    """A real target model placed on the simulated device (``device`` is :data:`DEVICE`)."""

    device = DEVICE

    def __init__(self, inner: Any, mode: SimulatedDevice) -> None:
        self.inner, self.mode = inner, mode
        self.forwards = 0

    def __getattr__(self, name: str) -> Any:  # vocab_size, max_context, args, embed...
        return getattr(self.inner, name)

    def new_state(self, max_tokens: int | None = None) -> Any:
        with self.mode.bypassed():
            return self.inner.new_state(max_tokens)

    def truncate(self, state: Any, num_tokens: int) -> None:
        with self.mode.bypassed():
            self.inner.truncate(state, num_tokens)

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        self.forwards += 1
        ids = _unwrap(batch.input_ids)  # refuses host input ids
        with self.mode.bypassed():
            out = self.inner.forward(
                ForwardBatch(ids, batch.seq_lens, batch.states, batch.capture, batch.logit_rows)
            )
        aux = _wrap(out.aux_hidden) if out.aux_hidden is not None else None
        return ModelOutput(_wrap(out.logits), _wrap(out.hidden), aux)
