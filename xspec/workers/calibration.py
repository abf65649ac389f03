"""Confidence calibration files: per-position temperatures for a draft's confidence head.

Sequential Temperature Scaling (DSpark paper section 4; fitted by ``python -m xspec.train
calibrate``, :mod:`xspec.train.calibrate`): the calibrated confidence of draft position k
is ``c_k = sigmoid(z_k / T_k)``, ``z_k`` the head's raw logit. The file sits next to the
draft weights as ``confidence_calibration.json`` (``spec.adaptive.calibration=auto``
reads it there when present) or anywhere a path points to::

    {"format": "xspec.confidence_calibration.v1",
     "temperatures": [T_1, ..., T_gamma],       # one per draft position, > 0
     "num_samples": N,                           # verify rows the fit saw
     "num_samples_per_position": [...],
     "ece_before": [...], "ece_after": [...],    # per position, cumulative product vs
     "ece_before_mean": e0, "ece_after_mean": e1,   # realised prefix acceptance
     "sampling_temperature": t, "source": "..."}

A file whose number of temperatures differs from the run's gamma is refused (temperatures
are fitted per position: a gamma-3 table says nothing about position 5).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xspec.errors import ConfigError

CALIBRATION_FILE = "confidence_calibration.json"
FORMAT = "xspec.confidence_calibration.v1"


@dataclass
class ConfidenceCalibration:
    temperatures: list[float]  # [gamma] T_k > 0
    num_samples: int = 0
    num_samples_per_position: list[int] = field(default_factory=list)
    ece_before: list[float] = field(default_factory=list)
    ece_after: list[float] = field(default_factory=list)
    ece_before_mean: float | None = None
    ece_after_mean: float | None = None
    sampling_temperature: float | None = None
    source: str = ""
    format: str = FORMAT


def save_calibration(cal: ConfidenceCalibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=2) + "\n", encoding="utf-8")


def load_calibration(path: Path, gamma: int, where: str) -> ConfidenceCalibration:
    """Read and check ``path`` for a run drafting ``gamma`` positions; ``where`` names the
    setting that chose the file in errors. ConfigError says what is wrong and how to fix."""
    fix = (
        "refit it for this draft and gamma (python -m xspec.train calibrate ...), or set "
        "spec.adaptive.calibration=off"
    )
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{where}: {path} does not exist; {fix}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {path} is not a readable JSON file ({e}); {fix}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(
            f"{where}: {path} is not an xspec confidence calibration ({FORMAT}); {fix}"
        )
    temps = raw.get("temperatures")
    if not isinstance(temps, list) or not all(
        isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) and t > 0
        for t in temps
    ):
        raise ConfigError(f"{where}: {path}: temperatures must be a list of numbers > 0; {fix}")
    if len(temps) != gamma:
        raise ConfigError(
            f"{where}: {path} has {len(temps)} temperatures (fitted for gamma={len(temps)}) "
            f"but this run drafts {gamma} positions; {fix}, or set "
            f"spec.num_speculative_tokens={len(temps)}"
        )
    known = set(ConfidenceCalibration.__dataclass_fields__)
    return ConfidenceCalibration(**{k: v for k, v in raw.items() if k in known})


def calibration_path(setting: str, draft_dir: Path | None) -> Path | None:
    """The file ``spec.adaptive.calibration`` selects: auto = the draft directory's file
    when it exists, off = none, anything else = that path (it must exist)."""
    if setting == "off":
        return None
    if setting == "auto":
        if draft_dir is None:
            return None
        found = draft_dir / CALIBRATION_FILE
        return found if found.is_file() else None
    return Path(setting)
