"""Platform plugins: where the hardware-dependent answers live (see :mod:`.base`).

Light to import: this package imports neither torch nor any platform module; the
selected platform's module is imported by :func:`get_platform`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xspec.platforms.base import Platform, PlatformSettings

__all__ = ["get_platform"]


def get_platform(cfg: PlatformSettings) -> Platform:
    """Build the platform named ``cfg.name`` from its config section.

    Unknown names raise ConfigError listing the known ones; a platform that cannot run
    here raises PlatformError with its own reason and install hint; ``auto`` returns the
    platform it resolves to.
    """
    from xspec.registry import platforms

    return platforms.get(cfg.name).create(cfg)
