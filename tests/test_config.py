"""Config composition: every model x spec x platform option composes and types; bad input is refused."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from xspec.compose import compose_run, overrides_from
from xspec.config import DType, NativeSas, RunConfig, validate
from xspec.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


NEEDS_PATH = {"dsv4_flash", "qwen3"}


@pytest.mark.parametrize(
    ("model", "spec", "platform"),
    list(itertools.product(options("model"), options("spec"), options("platform"))),
)
def test_every_combination_composes(model: str, spec: str, platform: str) -> None:
    extra = ["model.path=/ckpt"] if model in NEEDS_PATH else []
    cfg = compose_run([f"model={model}", f"spec={spec}", f"platform={platform}", *extra])
    assert isinstance(cfg, RunConfig)
    assert cfg.spec.method == spec and cfg.platform.name == platform
    assert isinstance(cfg.model.dtype, DType) and isinstance(cfg.platform.native_sas, NativeSas)
    validate(cfg)  # registry names and ranges


def test_defaults_and_overrides() -> None:
    cfg = compose_run(
        overrides_from(
            "qwen3_tiny", "none", "cpu", {"model.dtype": "float32", "sampling.top_p": 0.9}
        )
    )
    assert cfg.model.arch == "qwen3" and cfg.model.preset == "tiny"
    assert cfg.model.dtype is DType.float32 and cfg.sampling.top_p == 0.9


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model=nope"], "Available options in 'model'"),
        (["spec=nope"], "Available options in 'spec'"),
        (["workload.num_requests=abc"], "workload.num_requests"),
        (["+unknown.key=1"], "unknown"),
        (["+model.unknown_key=1"], "unknown_key"),
        (["model=dsv4_flash"], "model.path"),  # via validate()
        (["model.dtype=float8"], "model.dtype"),
        (["platform.native_sas=maybe"], "native_sas"),
    ],
)
def test_bad_overrides_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate(compose_run(overrides))
    assert needle in str(e.value)


def test_validate_lists_every_problem() -> None:
    cfg = compose_run(
        [
            "workload.num_requests=0",
            "sampling.temperature=-1",
            "model.arch=nope",
        ]
    )
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    for key in (
        "workload.num_requests",
        "sampling.temperature",
        "model.arch",
    ):
        assert key in msg
    assert "known: " in msg


def float_keys(schema: type, prefix: str = "") -> list[str]:
    """Every float field of the schema tree (``float`` or ``float | None``), dotted."""
    from dataclasses import fields, is_dataclass
    from typing import get_type_hints

    out = []
    for name, hint in get_type_hints(schema).items():
        if name not in {f.name for f in fields(schema)}:
            continue
        if is_dataclass(hint):
            out += float_keys(hint, f"{prefix}{name}.")  # type: ignore[arg-type]
        elif float in getattr(hint, "__args__", (hint,)):
            out.append(prefix + name)
    return out


def test_every_float_field_refuses_nan_and_infinity() -> None:
    """Walked generically: a float field added later is covered without a new check."""
    keys = float_keys(RunConfig)
    assert {"engine.memory_budget", "parallel.timeout_s", "sampling.top_p"} <= set(keys)
    for key in keys:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(ConfigError) as e:
                validate(compose_run([f"{key}={value}"]))
            assert e.value.problems == [
                f"{key} must be a finite number (got {float(value)}): NaN and infinity are "
                "not allowed; give a finite value or leave the key at its default"
            ], (key, value)
