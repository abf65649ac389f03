"""Capture points: where, relative to a decoder layer, the runtime reads a hidden state.

A platform maps a checkpoint's layer ids to them (``Platform.capture_point``); a model reads
its hidden states there (``models.base.ForwardBatch.capture``). Here, not in ``models/``, so
that platforms need nothing of the models beyond their op interfaces (``models.ops``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CaptureSite(str, enum.Enum):
    """Where, relative to a decoder layer, a hidden state is read."""

    INPUT = "input"  # the residual entering layer ``layer`` (== output of layer-1)
    OUTPUT = "output"  # the residual leaving layer ``layer``


@dataclass(frozen=True)
class CapturePoint:
    """A runtime capture location: decoder layer index + site.

    ``layer`` may equal ``num_layers`` with site INPUT: the final residual before
    the head (the output of the last layer).
    """

    layer: int
    site: CaptureSite
