"""Compose a run config from overrides, exactly as the CLI does, with user-facing errors.

Hydra and OmegaConf report problems with their own exception types; this module turns
every one of them into a :class:`~xspec.errors.ConfigError` whose message names the key
and, for group options, lists the allowed values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from xspec.config import RunConfig, config_dir, register_configs, to_typed
from xspec.errors import ConfigError


def overrides_from(
    model: str | None = None,
    spec: str | None = None,
    platform: str | None = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
) -> list[str]:
    """Python-API arguments as Hydra override strings.

    ``overrides``: a mapping ``{"model.dtype": "float16"}`` or a list of ``"key=value"``
    strings. ``workload.prompts`` holds text only (token-id prompts go to ``generate``).
    """
    out = [f"{k}={v}" for k, v in (("model", model), ("spec", spec), ("platform", platform)) if v]
    if isinstance(overrides, Mapping):
        for k, v in overrides.items():
            _check_override_value(str(k), v)
        out += [f"{k}={_value(v)}" for k, v in overrides.items()]
    elif isinstance(overrides, str | bytes) or not isinstance(overrides, Iterable | None):
        raise ConfigError(
            f"overrides must be a mapping {{'model.dtype': 'float16'}} or a list of 'key=value' "
            f"strings, not {type(overrides).__name__} {overrides!r}; e.g. overrides=[{overrides!r}]"
        )
    elif overrides is not None:
        items = list(overrides)
        if bad := [o for o in items if not isinstance(o, str)]:
            raise ConfigError(f"overrides must be 'key=value' strings; got {bad[:4]!r}")
        out += items
    return out


def _check_override_value(key: str, value: Any) -> None:
    if key.lstrip("+~") != "workload.prompts" or not isinstance(value, list | tuple):
        return
    if bad := [p for p in value if not isinstance(p, str)]:
        raise ConfigError(
            f"workload.prompts holds text prompts; got {bad[:4]!r}. Pass token-id prompts "
            "to LLM.generate, or write numbers as strings to use them as text"
        )


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list | tuple):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, str) and any(c in v for c in " ,=[]{}'\"\\:"):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(v)


def user_message(e: BaseException) -> str:
    """The first useful lines of a Hydra/OmegaConf error, without stack noise.

    Hydra wraps the real reason of a failed override ("Error merging override K=V") around
    OmegaConf's (expected type, allowed enum values): the direct cause is appended.
    """
    msg = str(e).strip()
    cause = e.__cause__ or e.__context__  # the first cause only: deeper ones are templates
    if cause is not None and str(cause).strip() and str(cause).strip() not in msg:
        msg = f"{msg}: {str(cause).strip()}"
    lines = [
        ln
        for ln in msg.splitlines()
        if ln.strip() and not ln.startswith(("    object_type", "    reference_type"))
    ]
    return "\n".join(lines[:14])


# ``key=value`` shorthands for a boolean switch inside a config section
SHORTHANDS = {"spec.adaptive": "spec.adaptive.enabled"}


def normalise_override(override: str) -> str:
    """``spec.adaptive=true`` -> ``spec.adaptive.enabled=true`` (sweeps included:
    ``spec.adaptive=true,false``); a mapping value (``spec.adaptive={...}``) is kept."""
    key, eq, value = override.partition("=")
    if eq and key in SHORTHANDS and not value.lstrip().startswith("{"):
        return f"{SHORTHANDS[key]}={value}"
    return override


def compose_raw(overrides: list[str], search: Sequence[str] = ()) -> DictConfig:
    """``search``: extra config directories (the CLI's ``--config-dir``), searched after
    xspec's own ``conf/`` like Hydra's ``hydra.searchpath``."""
    register_configs()
    overrides = [normalise_override(o) for o in overrides]
    if search:
        dirs = ",".join(f"file://{Path(d).resolve()}" for d in search)
        overrides = [*overrides, f"hydra.searchpath=[{dirs}]"]
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except yaml.YAMLError as e:  # a user's YAML: a Python tag, a syntax error
        raise ConfigError(yaml_message(e)) from None
    except (UnicodeDecodeError, RecursionError) as e:  # Hydra does not say which file
        raise ConfigError(unreadable_yaml(search, e)) from None
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(user_message(e)) from None


def yaml_message(e: yaml.YAMLError) -> str:
    """One line: the file, line and column, and what is wrong there."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = "a config file" if mark is None else f"{mark.name}:{mark.line + 1}:{mark.column + 1}"
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    advice = (
        "config files hold plain values only (no Python tags); remove the tag"
        if isinstance(e, yaml.constructor.ConstructorError)
        else "fix the YAML there"
    )
    return f"{where}: not a valid config file: {problem}; {advice}"


# Nesting a config file may have before a failed composition blames it: xspec's own
# nest three or four levels; Hydra and OmegaConf recurse per level and give up at a few
# hundred, the YAML parser near a thousand.
DEEP_YAML = 64


def unreadable_yaml(search: Sequence[str], e: Exception) -> str:
    """Which ``*.yaml`` under the user's config directories (``search``) cannot be read
    (not UTF-8, or nested too deep), found again by reading each; else a message naming
    the directories."""
    for d in search:
        for file in sorted(Path(d).rglob("*.yaml")):
            try:
                depth = _depth(yaml.safe_load(file.read_bytes().decode("utf-8")))
            except UnicodeDecodeError as bad:
                where = f"{file}: not a valid config file"
                return f"{where}: not UTF-8 text ({bad.reason} at byte {bad.start})"
            except RecursionError:
                return f"{file}: not a valid config file: nested too deep to read"
            except (OSError, yaml.YAMLError):
                continue  # not the failure at hand (or a file this run does not read)
            if isinstance(e, RecursionError) and depth > DEEP_YAML:
                return f"{file}: not a valid config file: nested {depth} levels deep, too deep"
    where = ", ".join(search) or str(config_dir())
    kind = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "nested too deep to read"
    return f"a config file under {where} is {kind}; fix or remove it"


def _depth(node: Any) -> int:
    """How deep lists and mappings nest in ``node`` (0: a scalar), without recursion; a
    container that YAML aliases share is walked once (an alias bomb stays cheap)."""
    deepest, stack, seen = 0, [(node, 1)], set()
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list) and id(item) not in seen:
            seen.add(id(item))
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack += [(child, level + 1) for child in children]
    return deepest


def compose_run(overrides: list[str], search: Sequence[str] = ()) -> RunConfig:
    """Composed and typed run config (raises ConfigError on any user mistake)."""
    return typed(compose_raw(overrides, search))


def typed(cfg: DictConfig) -> RunConfig:
    try:
        return to_typed(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(user_message(e) + _hint(e)) from None


def _hint(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    if type(e).__name__ == "MissingMandatoryValue" and key:
        return f"\nset it on the command line, e.g. {key}=..."
    return ""


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
