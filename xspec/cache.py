"""Where xspec keeps what it generates or builds once: presets, native kernels, profiles."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$XSPEC_CACHE_DIR, default ~/.cache/xspec."""
    return Path(os.environ.get("XSPEC_CACHE_DIR") or "~/.cache/xspec").expanduser()
