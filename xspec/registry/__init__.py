"""The three extension points of xspec: platforms, models, speculative methods.

Each is a :class:`Registry` filled from the built-in table (:mod:`.builtins`) and from
installed packages' entry points. Importing this package imports no implementation and
no torch: ``registry.platforms.names()`` is safe anywhere; ``registry.platforms.get(n)``
imports exactly the platform ``n``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from xspec.errors import ConfigError, PlatformError, UserError
from xspec.registry.builtins import BUILTINS
from xspec.registry.registry import DuplicateNameError, Entry, Registry

if TYPE_CHECKING:
    from xspec.models.family import ModelFamily
    from xspec.platforms.base import Platform
    from xspec.spec.drafter import Drafter

__all__ = [
    "DuplicateNameError",
    "Entry",
    "Registry",
    "families_where",
    "family_named",
    "models",
    "platforms",
    "spec_methods",
]


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


def _check_model(name: str, value: Any) -> None:
    from xspec.models.family import ModelFamily  # torch-free

    if isinstance(value, type) and issubclass(value, ModelFamily):
        raise ConfigError(
            f"model '{name}' resolves to the class {value.__qualname__}; register an instance "
            f"of it (e.g. FAMILY = {value.__qualname__}() in its module); fix the plugin's "
            "entry point"
        )
    if not isinstance(value, ModelFamily):
        raise ConfigError(
            f"model '{name}' resolves to {value!r}, which is not an instance of a subclass of "
            "xspec.models.family.ModelFamily; fix the plugin's entry point"
        )
    if getattr(value, "arch", None) != name:
        cls = type(value).__qualname__
        raise ConfigError(
            f"model '{name}' resolves to a {cls} whose arch is {getattr(value, 'arch', None)!r}; "
            f"set {cls}.arch = {name!r}"
        )


def _check_spec_method(name: str, value: Any) -> None:
    from xspec.spec.drafter import Drafter  # imports torch: only once a method is selected

    if not (isinstance(value, type) and issubclass(value, Drafter)):
        raise ConfigError(
            f"spec method '{name}' resolves to {value!r}, which is not a subclass of "
            "xspec.spec.drafter.Drafter; fix the plugin's entry point"
        )


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

models: Registry[ModelFamily] = Registry(
    "model",
    "xspec.models",
    """Target model families (``model=<name>``). A plugin provides an instance of a
    subclass of ``xspec.models.family.ModelFamily`` whose ``arch`` equals its entry-point
    name: ``load(cfg, *, device, max_rollback, steps, expert_parallel=None)`` returns an
    ``xspec.models.base.TargetModel`` (a bad checkpoint raises
    ``xspec.errors.CheckpointError`` naming the tensor and file); ``preflight``,
    ``checkpoint_path``, ``num_routed_experts`` and the drafters it offers are optional.
    Its module import stays light (no torch).""",
    check=_check_model,
)

spec_methods: Registry[type[Drafter]] = Registry(
    "spec method",
    "xspec.spec_methods",
    """Speculative methods (``spec=<name>``). A plugin provides a subclass of
    ``xspec.spec.drafter.Drafter``, constructible as ``cls(spec_cfg, *, target,
    model_cfg, platform, steps)``; its module is imported only when the method is
    selected.""",
    check=_check_spec_method,
)

for _registry in (platforms, models, spec_methods):
    for _name, (_target, _description) in BUILTINS[_registry.kind].items():
        _registry.register(_name, _target, description=_description)


def family_named(arch: str) -> ModelFamily | None:
    """The registered family ``model.arch`` names, None when none is registered."""
    return models.get(arch) if arch in models else None


def families_where(offers: Callable[[ModelFamily], bool]) -> list[ModelFamily]:
    """Every importable registered family for which ``offers(family)`` holds, by name
    (for messages that list the alternatives)."""
    found = []
    for name in models.names():
        try:
            family = models.get(name)
        except (ImportError, UserError):  # a broken plugin is reported where selected
            continue
        if offers(family):
            found.append(family)
    return found
