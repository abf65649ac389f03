"""xspec: speculative decoding for large MoE language models.

``import xspec`` is light: no torch device work, no model or platform implementation is
imported until used. ``xspec.LLM`` is the Python API (see ``xspec.api``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xspec.version import __version__

if TYPE_CHECKING:
    from xspec.api import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from xspec.api import LLM

        return LLM
    raise AttributeError(f"module 'xspec' has no attribute {name!r}")


__all__ = ["LLM", "__version__"]
