from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # CI machines have 2 cores; keep runs comparable and quiet


@pytest.fixture(scope="session", autouse=True)
def xspec_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Presets are generated once per test session into a private cache (or $XSPEC_CACHE_DIR)."""
    if "XSPEC_CACHE_DIR" not in os.environ:
        os.environ["XSPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("xspec_cache"))
    return Path(os.environ["XSPEC_CACHE_DIR"])
