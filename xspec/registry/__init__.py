"""The three extension points of xspec: platforms, models, speculative methods.

Each is a :class:`Registry` filled from the built-in table (:mod:`.builtins`) and from
installed packages' entry points. Importing this package imports no implementation and
no torch: ``registry.platforms.names()`` is safe anywhere; ``registry.platforms.get(n)``
imports exactly the platform ``n``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from xspec.errors import ConfigError, PlatformError
from xspec.registry.builtins import BUILTINS
from xspec.registry.registry import DuplicateNameError, Entry, Registry

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from xspec.models.base import TargetModel
    from xspec.platforms.base import Platform

__all__ = [
    "DuplicateNameError",
    "Entry",
    "ModelLoader",
    "Registry",
    "models",
    "platforms",
    "spec_methods",
]


class ModelLoader(Protocol):
    """What a ``models`` entry resolves to: builds a target model from its config section.

    ``device`` comes from the platform; ``max_rollback`` is the most rows a verify step
    may later truncate (gamma + 1), so the model can size rollback state once.
    """

    def __call__(self, cfg: Any, *, device: torch.device, max_rollback: int) -> TargetModel: ...


def _check_platform(name: str, value: Any) -> None:
    from xspec.platforms.base import Platform  # imported only once a platform is selected

    if not (isinstance(value, type) and issubclass(value, Platform)):
        raise PlatformError(
            f"platform '{name}' resolves to {value!r}, which is not a subclass of "
            "xspec.platforms.base.Platform; fix the plugin's entry point"
        )
    if getattr(value, "name", None) != name:
        raise PlatformError(
            f"platform '{name}' resolves to {value.__qualname__} whose name is "
            f"{getattr(value, 'name', None)!r}; set {value.__qualname__}.name = {name!r}"
        )


def _check_callable(kind: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not callable(value):
            raise ConfigError(f"{kind} '{name}' resolves to {value!r}, which is not callable")

    return check


platforms: Registry[type[Platform]] = Registry(
    "platform",
    "xspec.platforms",
    """Platforms (``platform=<name>``). A plugin provides a subclass of
    ``xspec.platforms.base.Platform`` whose ``name`` equals its entry-point name,
    constructible as ``cls(cfg)`` from the platform config section, whose
    ``unavailable_reason()`` detects cheaply (no optional imports, no device work), and
    whose module import touches no device.""",
    check=_check_platform,
)

models: Registry[ModelLoader] = Registry(
    "model",
    "xspec.models",
    """Target models (``model=<name>``). A plugin provides a factory
    ``load_model(cfg, *, device, max_rollback) -> xspec.models.base.TargetModel`` (see
    :class:`ModelLoader`) that loads weights from ``cfg`` and raises
    ``xspec.errors.CheckpointError`` naming the tensor and file for a bad checkpoint.""",
    check=_check_callable("model"),
)

spec_methods: Registry[Callable[..., Any]] = Registry(
    "spec method",
    "xspec.spec_methods",
    """Speculative methods (``spec=<name>``). A plugin provides a drafter factory (a class
    or function) following the drafter protocol in ``xspec.spec``; its module is
    imported only when the method is selected.""",
    check=_check_callable("spec method"),
)

for _registry in (platforms, models, spec_methods):
    for _name, (_target, _description) in BUILTINS[_registry.kind].items():
        _registry.register(_name, _target, description=_description)
