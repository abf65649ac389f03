"""``platform=auto``: a resolver, not a device.

``AutoPlatform.create(cfg)`` returns an instance of the first usable platform among
``npu``, ``cuda``, ``cpu`` (looked up in the platform registry, so detection stays the
candidates' own cheap ``unavailable_reason``). ``AutoPlatform`` itself is abstract and
never instantiated; ``get_platform`` goes through ``create``.
"""

from __future__ import annotations

from typing import ClassVar

from xspec.errors import PlatformError
from xspec.platforms.base import Platform, PlatformSettings


class AutoPlatform(Platform):
    """Resolves to the best usable built-in platform: npu, else cuda, else cpu."""

    name = "auto"
    description = "first usable of npu, cuda, cpu"
    candidates: ClassVar[tuple[str, ...]] = ("npu", "cuda", "cpu")

    @classmethod
    def resolve(cls) -> type[Platform]:
        """The first candidate class whose ``unavailable_reason()`` is None."""
        from xspec.registry import platforms

        reasons = []
        for name in cls.candidates:
            platform_cls = platforms.get(name)
            reason = platform_cls.unavailable_reason()
            if reason is None:
                return platform_cls
            reasons.append(f"{name}: {reason}")
        raise PlatformError("platform=auto found no usable platform", problems=reasons)

    @classmethod
    def create(cls, cfg: PlatformSettings) -> Platform:
        return cls.resolve().create(cfg)
