"""Resolving a ``model`` config section to a checkpoint directory and a dtype (torch-free).

Every model package resolves ``model.path`` / ``model.preset`` / ``model.dtype`` the same
way: an explicit path wins; otherwise a built-in preset: shipped in the package, or
generated on first use into ``$XSPEC_CACHE_DIR/presets`` (:func:`cached`, which refuses
a cache entry someone else could have written).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from xspec.cache import cache_dir, cache_root, private, tree_problem
from xspec.errors import CheckpointError, ConfigError

DTYPES = ("float32", "bfloat16", "float16")
ASSETS = Path(__file__).resolve().parent.parent / "assets"  # checkpoints shipped in the package


def shipped_dir(name: str) -> Path:
    """A checkpoint directory shipped inside the package (``xspec/assets/<name>``)."""
    path = ASSETS / name
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"the shipped checkpoint {path} is missing from this installation; rebuild it "
            f"with `python -m xspec.train all --work <dir>` (see docs/training.md), or use "
            f"a random preset (model=dsv4_tiny_random)"
        )
    return path


def cached(make: Callable[[], Path]) -> Callable[[], Path]:
    """``make`` (a generator of a preset under ``$XSPEC_CACHE_DIR/presets``, which returns
    its directory) with the cache's trust checks (:mod:`xspec.cache`), as the native
    kernels' cache applies them: before generating, the preset cache and the cache root
    must be this user's (or root's) and writable by nobody else (made 0700 when missing);
    after, every file of the preset must be a regular file owned by this user or root
    (and writable by nobody else, unless the preset cache is private). A preset that
    fails is a CheckpointError naming the path and the fix, never read."""

    @functools.wraps(make)
    def checked() -> Path:
        presets = cache_root() / "presets"
        try:
            real, why = cache_dir(presets)
        except OSError as e:
            raise CheckpointError(
                f"cannot create the preset cache {presets} ({e.strerror or e}); set "
                "XSPEC_CACHE_DIR to a writable directory (default ~/.cache/xspec)"
            ) from None
        if real is None:
            raise CheckpointError(
                f"the preset cache {presets} cannot be trusted: {why}; make it yours and "
                "writable by you only (chmod go-w), or set XSPEC_CACHE_DIR to a directory "
                "of your own"
            )
        path = make()
        try:
            problem = tree_problem(path, inside_private=private(real))
        except OSError as e:
            problem = f"cannot inspect {path} ({e.strerror or e})"
        if problem:
            raise CheckpointError(
                f"the cached preset {path} cannot be trusted: {problem}; delete {path} (the "
                "next run regenerates it), or set XSPEC_CACHE_DIR to a directory of your own"
            )
        return path

    return checked


def checkpoint_dir(
    cfg: Any, presets: Mapping[str, Callable[[], Path]], *, family: str, example: str
) -> Path:
    """``cfg.path``, else the directory of the built-in preset ``cfg.preset``.

    ``family`` names the model in messages; ``example`` is a sample ``model.path`` value.
    """
    if cfg.path:
        return Path(cfg.path)
    if cfg.preset is None:
        raise CheckpointError(
            f"no {family} checkpoint given: set model.path={example}, "
            f"or pick a built-in preset (model.preset: {', '.join(presets)})"
        )
    if cfg.preset not in presets:
        raise ConfigError(
            f"model.preset={cfg.preset!r} is not a {family} preset; known: {', '.join(presets)}"
        )
    return presets[cfg.preset]()


def dtype_name(value: Any) -> str:
    """``model.dtype`` (a str Enum or a str) as a torch dtype attribute name."""
    name = getattr(value, "value", value)
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not supported; use one of {', '.join(DTYPES)}")
    return str(name)


def draft_checkpoint_dir(
    spec_cfg: Any,
    model_cfg: Any,
    *,
    preset_drafts: Mapping[tuple[str, str], Callable[[], Path]],
    target_dir: Callable[[], Path] | None,
    example: str,
) -> Path:
    """Where the drafter of ``spec_cfg.method`` is read from.

    ``spec.draft_path`` wins; a built-in preset (no ``model.path``) may ship a companion
    draft directory per method (``preset_drafts[(preset, method)]``); otherwise the
    target's own directory (``target_dir``, for checkpoints that carry their drafter) or,
    when the family stores drafters separately (``target_dir`` None), an error.
    """
    if spec_cfg.draft_path:
        return Path(spec_cfg.draft_path)
    key = (model_cfg.preset, spec_cfg.method)
    if not model_cfg.path and key in preset_drafts:
        return preset_drafts[key]()
    if target_dir is not None:
        return target_dir()
    raise CheckpointError(
        f"spec={spec_cfg.method} reads its draft from a separate directory: set "
        f"spec.draft_path={example}"
    )
