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
     "sampling_temperature": t, "sampling_top_k": k, "sampling_top_p": p,
     "source": "..."}

A file whose number of temperatures differs from the run's gamma is refused (temperatures
are fitted per position: a gamma-3 table says nothing about position 5).

**Several regimes in one file**: ``"regimes": [{...}, ...]`` holds further fits, each
with the keys above but ``format`` (``python -m xspec.train calibrate`` fits greedy and
sampled temperatures in one go and writes them all; the top-level fit is the first).
Each request reads the fit of its own regime (:meth:`ConfidenceCalibration.select`);
when none fits, the nearest (by temperature; greedy counts as 0) is applied and
:class:`RegimeCheck` says so, never silently.

The ``sampling_*`` keys are the regime the fit ran at: acceptance, hence what a
calibrated confidence should predict, depends on it (greedy accepts a draft on an argmax
match, sampling by the ratio of the processed distributions). :class:`RegimeCheck` logs
a warning, once per regime, for requests that sample otherwise (any greedy request
matches a greedy fit: top-k and top-p do not change an argmax). A file without
``sampling_temperature`` (an older xspec) still loads, with a warning that its regime is
unknown; ``sampling_top_k`` / ``sampling_top_p`` absent: not compared.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xspec import atomic
from xspec.errors import ConfigError
from xspec.jsonfile import JSONFileError, read_json
from xspec.sampling import SamplingParams, regime_of

log = logging.getLogger(__name__)

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
    # the sampling regime of the fit; None: not recorded (sampling_temperature: an older file)
    sampling_temperature: float | None = None
    sampling_top_k: int | None = None
    sampling_top_p: float | None = None
    source: str = ""
    format: str = FORMAT
    # further fits of the same draft at other sampling regimes (their own ``regimes`` empty)
    regimes: list[ConfidenceCalibration] = field(default_factory=list)

    def fits(self) -> list[ConfidenceCalibration]:
        """Every fit in the file: this one, then ``regimes``."""
        return [self, *self.regimes]

    def select(self, params: SamplingParams) -> tuple[ConfidenceCalibration, str | None]:
        """The fit for requests sampling with ``params`` and, when none matches their
        regime, why (the nearest by temperature is returned then: greedy counts as 0;
        fits of an unknown regime come last)."""
        fits = self.fits()
        for fit in fits:
            if fit.mismatch(params) is None:
                return fit, None
        t = 0.0 if params.greedy else params.temperature
        nearest = min(
            fits,
            key=lambda f: (
                math.inf if f.sampling_temperature is None else abs(f.sampling_temperature - t)
            ),
        )
        why = nearest.mismatch(params)
        if len(fits) > 1:
            regimes = ", ".join(f.fitted_regime() for f in fits)
            why = f"none of its {len(fits)} fits ({regimes}) matches; the nearest is used: {why}"
        return nearest, why

    def fitted_regime(self) -> str:
        """The regime of the fit, in words."""
        if self.sampling_temperature is None:
            return "an unknown sampling regime"
        return _regime(self.sampling_temperature, self.sampling_top_k, self.sampling_top_p)

    def mismatch(self, params: SamplingParams) -> str | None:
        """Why this calibration does not hold for requests sampling with ``params``, or None."""
        t = self.sampling_temperature
        if t is None:
            return "it does not record the sampling regime it was fitted at (an older xspec)"
        fitted = SamplingParams(temperature=t)
        if fitted.greedy and params.greedy:
            return None
        k, p = self.sampling_top_k, self.sampling_top_p
        same = (
            fitted.greedy == params.greedy
            and math.isclose(t, params.temperature, rel_tol=1e-6)
            and (k is None or k == params.top_k)
            and (p is None or math.isclose(p, params.top_p, rel_tol=1e-6))
        )
        if same:
            return None
        run = regime_of(params, words=True)
        return f"it was fitted at {self.fitted_regime()}, and requests sample at {run}"


def _regime(temperature: float, top_k: int | None, top_p: float | None) -> str:
    """A fit's regime in words (top-k / top-p None: not recorded)."""
    params = SamplingParams(
        temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p
    )
    return regime_of(params, words=True)


class RegimeCheck:
    """Logs a warning, once per sampling regime, when requests sample otherwise than
    ``cal`` (read from ``path``) was fitted: its confidences, and the verify lengths
    ``spec.adaptive`` picks from them, are then off. Call it with each step's params."""

    def __init__(self, cal: ConfidenceCalibration, path: Path | None = None) -> None:
        self.cal = cal
        self.path = path
        self._seen: set[tuple[float, int, float] | None] = set()

    def __call__(self, params: Iterable[SamplingParams]) -> None:
        for p in params:
            key = None if p.greedy else (p.temperature, p.top_k, p.top_p)  # greedy: one regime
            if key in self._seen:
                continue
            self._seen.add(key)
            if (why := self.cal.select(p)[1]) is not None:
                log.warning(
                    "confidence calibration%s: %s; its confidences may be miscalibrated here. "
                    "Refit it with the sampling.* of these runs (python -m xspec.train "
                    "calibrate ...), or set spec.adaptive.calibration=off",
                    "" if self.path is None else f" {self.path}",
                    why,
                )


def save_calibration(cal: ConfidenceCalibration, path: Path) -> None:
    """Write ``cal`` (and its further ``regimes``) to ``path`` atomically: a failed write
    (a full disk) leaves the previous file as it was and raises OutputError."""
    body = asdict(cal)
    for r in body["regimes"]:
        del r["regimes"], r["format"]
    if not body["regimes"]:
        del body["regimes"]  # a one-regime file reads as before
    atomic.write_json(path, body)


def load_calibration(path: Path, gamma: int | None, where: str) -> ConfidenceCalibration:
    """Read and check ``path`` for a run drafting ``gamma`` positions (None: the count is
    not checked); ``where`` names the setting that chose the file in errors. ConfigError
    says what is wrong and how to fix."""
    fix = (
        "refit it for this draft and gamma (python -m xspec.train calibrate ...), or set "
        "spec.adaptive.calibration=off"
    )
    try:
        raw: Any = read_json(path)
    except JSONFileError as e:
        raise ConfigError(f"{where}: {e}; {fix}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(
            f"{where}: {path} is not an xspec confidence calibration ({FORMAT}); {fix}"
        )
    others = raw.get("regimes", [])
    if not isinstance(others, list) or not all(isinstance(r, dict) for r in others):
        raise ConfigError(f"{where}: {path}: regimes must be a list of fits; {fix}")
    fits = [_fit(raw, path, gamma, where, fix)]
    fits += [_fit(r, path, gamma, f"{where} (regimes[{i}])", fix) for i, r in enumerate(others)]
    fits[0].regimes = fits[1:]
    return fits[0]


def _fit(
    raw: dict[str, Any], path: Path, gamma: int | None, where: str, fix: str
) -> ConfidenceCalibration:
    """One fit of a calibration file (the top level or an entry of ``regimes``), checked."""
    temps = raw.get("temperatures")
    if not isinstance(temps, list) or not all(
        isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) and t > 0
        for t in temps
    ):
        raise ConfigError(f"{where}: {path}: temperatures must be a list of numbers > 0; {fix}")
    if problem := _regime_problem(raw):
        raise ConfigError(f"{where}: {path}: {problem}; {fix}")
    if gamma is not None and len(temps) != gamma:
        raise ConfigError(
            f"{where}: {path} has {len(temps)} temperatures (fitted for gamma={len(temps)}) "
            f"but this run drafts {gamma} positions; {fix}, or set "
            f"spec.num_speculative_tokens={len(temps)}"
        )
    known = set(ConfidenceCalibration.__dataclass_fields__) - {"regimes"}
    return ConfidenceCalibration(**{k: v for k, v in raw.items() if k in known})


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _regime_problem(raw: dict[str, Any]) -> str | None:
    """What is wrong with the file's ``sampling_*`` keys (each may be absent or null)."""
    t, k, p = (raw.get(f"sampling_{x}") for x in ("temperature", "top_k", "top_p"))
    if t is not None and not (_number(t) and t >= 0):
        return f"sampling_temperature must be a number >= 0 or null, got {t!r}"
    if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
        return f"sampling_top_k must be an integer >= 0 or null, got {k!r}"
    if p is not None and not (_number(p) and 0 < p <= 1):
        return f"sampling_top_p must be a number in (0, 1] or null, got {p!r}"
    return None


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
