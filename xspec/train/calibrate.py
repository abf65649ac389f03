"""``python -m xspec.train calibrate [--out FILE] key=value ...``: fit a draft's confidence
temperatures by Sequential Temperature Scaling (DSpark paper section 4).

The command builds the run the overrides describe (``spec=dspark``, a model, a workload:
the held-out prompts), runs the workload at fixed gamma with raw confidences
(``spec.adaptive`` off), records per verify row the head's raw logits ``z [gamma]`` (as
the head computed them, not recovered from the proposal's fp32 sigmoid, which rounds to
1 above z ~ 17), the drafts verified and the drafts accepted, and fits one temperature
per position:

    for k = 1 .. gamma (left to right, earlier T frozen):
        T_k = argmin_T ECE( prod_{i<k} sigmoid(z_i / T_i) * sigmoid(z_k / T),
                            1[row accepted >= k drafts] )    over rows that verified k drafts

by a 1-D grid search (:data:`GRID`, T = 1 included), once per sampling regime: greedy and
each sampled temperature of ``--temperatures`` (default :data:`TEMPERATURES`, or only
``sampling.temperature`` when the overrides set it; the workload's ``sampling.top_k`` /
``top_p`` / ``seed`` apply to the sampled ones), all in one file (the first fit at the
top level, the others under ``regimes``). Dividing a logit by T > 0 keeps the
order of the confidences at each position. ECE: 20 equal-width bins, weighted by counts.
The table is written next to the draft weights (``confidence_calibration.json``, read
by ``spec.adaptive.calibration=auto``) or to ``--out``. Acceptance depends on the
sampling settings: calibrate at the temperatures the runs will use. Each fit records its
regime (``sampling_temperature``, ``sampling_top_k``, ``sampling_top_p``); a run reads
the fit of each request's regime, and requests that sample otherwise get a warning
(:class:`xspec.spec.adaptive.calibration.RegimeCheck`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from xspec.metrics import SpecDecodeMetrics
from xspec.spec.adaptive.calibration import (
    CALIBRATION_FILE,
    ConfidenceCalibration,
    save_calibration,
)

TEMPERATURES = [0.0, 0.8, 1.0]  # the regimes fitted by default: greedy and two sampled
GRID = sorted({1.0, *torch.logspace(-1.5, 1.5, 121, dtype=torch.float64).tolist()})
BINS = 20


def ece(pred: Tensor, label: Tensor, bins: int = BINS) -> float:
    """Expected calibration error of ``pred [N]`` in [0, 1] against ``label [N]`` in {0, 1}."""
    if pred.numel() == 0:
        return 0.0
    idx = (pred * bins).long().clamp(0, bins - 1)  # [N] equal-width bin of each prediction
    p_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, pred.double())
    y_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, label.double())
    return float((p_sum - y_sum).abs().sum() / pred.numel())  # sum_b n_b/N |mean p - mean y|


def _prefix_ece(
    logits: Tensor, temps: list[float], drafted: Tensor, accepted: Tensor, k: int
) -> float:
    """ECE at position k (0-based) of the cumulative product under ``temps[: k+1]``."""
    rows = drafted > k  # [N] rows that verified position k
    z = logits[rows, : k + 1] / torch.tensor(temps[: k + 1], dtype=torch.float64)
    return ece(torch.sigmoid(z).prod(dim=1), (accepted[rows] > k).double())


def fit_sts(logits: Tensor, drafted: Tensor, accepted: Tensor) -> ConfidenceCalibration:
    """Sequential Temperature Scaling (module docstring).

    logits:   [N, G] raw confidence logits of N verify rows (float)
    drafted:  [N] drafts each row verified (positions >= drafted[r] carry no label)
    accepted: [N] drafts each row accepted (<= drafted)
    """
    logits = logits.to(torch.float64)
    N, G = logits.shape
    temps: list[float] = []
    before, after = [], []
    for k in range(G):
        before.append(_prefix_ece(logits, [1.0] * G, drafted, accepted, k))
        scores = [_prefix_ece(logits, [*temps, t], drafted, accepted, k) for t in GRID]
        best = min(range(len(GRID)), key=lambda i: (scores[i], abs(GRID[i] - 1.0)))
        temps.append(GRID[best])
        after.append(scores[best])
    counts = [int((drafted > k).sum()) for k in range(G)]
    return ConfidenceCalibration(
        temperatures=temps,
        num_samples=N,
        num_samples_per_position=counts,
        ece_before=before,
        ece_after=after,
        ece_before_mean=_weighted(before, counts),
        ece_after_mean=_weighted(after, counts),
    )


def _weighted(values: list[float], counts: list[int]) -> float:
    total = sum(counts)
    return sum(v * c for v, c in zip(values, counts)) / total if total else 0.0


class LogitTap:
    """Keeps the raw logits ``z [B, n]`` of the confidence head's latest call: the proposal
    carries only ``sigmoid(z)`` (fp32, exactly 1.0 for z above ~17), which cannot give z
    back. Installed on a drafter for the length of a calibration run (:meth:`installed`)."""

    def __init__(self) -> None:
        self.latest: Tensor | None = None  # [B, n] float64 on the host

    def wrap(self, logits: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def tapped(*args: Any, **kwargs: Any) -> Tensor:
            z = logits(*args, **kwargs)  # [B, n] raw logits
            self.latest = z.detach().to("cpu", torch.float64)
            return z

        return tapped

    @contextlib.contextmanager
    def installed(self, head: Any) -> Iterator[LogitTap]:
        """Tap ``head.logits`` (a confidence head) until the block exits."""
        head.logits = self.wrap(head.logits)  # an instance attribute shadows the method
        try:
            yield self
        finally:
            del head.logits

    def take(self, rows: int, columns: int) -> Tensor:
        """The latest logits, first ``columns`` positions (the step verifies a prefix of
        what was proposed); cleared, so a step without a head call is an error."""
        z, self.latest = self.latest, None
        if z is None or z.shape[0] != rows or z.shape[1] < columns:
            got = None if z is None else tuple(z.shape)
            raise RuntimeError(
                f"calibrate: the step's confidences [{rows}, {columns}] do not match the "
                f"confidence head's last logits {got}"
            )
        return z[:, :columns]


class ConfidenceRecorder(SpecDecodeMetrics):
    """The engine's metrics, also keeping each verify row's raw confidence logits (from
    ``tap``) and outcome."""

    def __init__(self, tap: LogitTap) -> None:
        super().__init__()
        self.tap = tap
        self.logits: list[Tensor] = []  # [B, G] per step
        self.drafted: list[Tensor] = []  # [B]
        self.accepted: list[Tensor] = []  # [B]

    def observe_step(
        self,
        output_tokens: Tensor,
        num_draft_tokens: Tensor,
        confidence: Tensor | None = None,
        *,
        depths: list[int] | None = None,
        regimes: list[str] | None = None,
    ) -> None:
        super().observe_step(
            output_tokens, num_draft_tokens, confidence, depths=depths, regimes=regimes
        )
        if confidence is None:
            return
        self.logits.append(self.tap.take(*confidence.shape))  # [B, G] raw z of these rows
        self.drafted.append(num_draft_tokens.detach().cpu().long())
        self.accepted.append((output_tokens.detach().cpu() >= 0).sum(dim=1) - 1)

    def samples(self, gamma: int) -> tuple[Tensor, Tensor, Tensor]:
        """(logits [N, gamma], drafted [N], accepted [N]) of every recorded row; steps near
        the end of a request's budget drafted fewer positions (their columns are padding)."""
        pad = [torch.nn.functional.pad(z, (0, gamma - z.shape[1])) for z in self.logits]
        return torch.cat(pad), torch.cat(self.drafted), torch.cat(self.accepted)


def calibrate(
    overrides: list[str], out: Path | None, temperatures: list[float] | None = None
) -> tuple[ConfidenceCalibration, Path]:
    """Run the workload of ``overrides`` with raw confidences once per sampling
    temperature (default :data:`TEMPERATURES`; 0 = greedy), fit each, write them all to
    one file; returns the calibration (its ``regimes``: the fits after the first) and
    where it went."""
    from xspec.build import build, check
    from xspec.compose import compose_run
    from xspec.errors import ConfigError
    from xspec.run.workloads import load_workload
    from xspec.sampling import SamplingParams

    if temperatures is None:  # sampling.temperature=t alone: that regime only (as before)
        given = [o.split("=", 1)[1] for o in overrides if o.startswith("sampling.temperature=")]
        try:
            temperatures = [float(given[-1])] if given else TEMPERATURES
        except ValueError:
            raise ConfigError(
                f"sampling.temperature must be a number (got {given[-1]!r})"
            ) from None
    temps = list(temperatures)
    if not temps or any(not t >= 0 for t in temps) or len(set(temps)) != len(temps):
        raise ConfigError(f"calibrate: --temperatures must be distinct numbers >= 0 (got {temps})")
    # checked as an adaptive run (a draft with a confidence head), before anything loads;
    # run at fixed gamma with raw confidences
    cfg = compose_run([*overrides, "spec.adaptive.enabled=true", "spec.adaptive.calibration=off"])
    if problems := check(cfg):
        raise ConfigError("calibrate cannot run:", problems=problems)
    cfg.spec.adaptive.enabled = False
    built = build(cfg)
    drafter: Any = built.drafter
    s, w = cfg.sampling, cfg.workload
    fits = []
    for t in temps:
        params = SamplingParams(
            temperature=t, top_k=s.top_k, top_p=s.top_p, seed=0 if s.seed is None else s.seed
        )
        work = load_workload(w, built.tokenizer, built.target.vocab_size, params)
        tap = LogitTap()
        recorder = ConfidenceRecorder(tap)
        built.engine.reset_metrics(recorder)
        with tap.installed(drafter.model.confidence):
            built.engine.run(work.requests, w.concurrency)
        logits, drafted, accepted = recorder.samples(drafter.gamma)
        if int((drafted > 0).sum()) == 0:
            raise ConfigError(
                "calibrate saw no verify row with drafts; raise workload.max_new_tokens or "
                "workload.num_requests"
            )
        cal = fit_sts(logits, drafted, accepted)
        cal.sampling_temperature, cal.sampling_top_k, cal.sampling_top_p = t, s.top_k, s.top_p
        fits.append(cal)
    cal = fits[0]
    cal.regimes = fits[1:]
    flags = " ".join(f"{t:g}" for t in temps)
    cal.source = f"xspec.train calibrate --temperatures {flags} {' '.join(overrides)}"
    path = out if out is not None else Path(drafter.draft_dir) / CALIBRATION_FILE
    save_calibration(cal, path)
    return cal, path


def main(argv: list[str]) -> int:
    from xspec.errors import OutputError, UserError

    parser = argparse.ArgumentParser(
        prog="python -m xspec.train calibrate",
        description="Fit per-position confidence temperatures (STS) on the workload's prompts.",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help=f"default: <draft dir>/{CALIBRATION_FILE}"
    )
    parser.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=None,
        help=f"sampling temperatures to fit, 0 = greedy (default: {TEMPERATURES})",
    )
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, as for xspec")
    args = parser.parse_args(argv)
    try:
        cal, path = calibrate(args.overrides, args.out, args.temperatures)
    except (UserError, OutputError) as e:  # one line, no traceback (a full disk: exit 1)
        print(f"xspec.train calibrate: error: {e}", file=sys.stderr)
        return e.exit_code
    for fit in cal.fits():
        temps = ", ".join(f"{t:.3g}" for t in fit.temperatures)
        print(
            f"{fit.fitted_regime()}: calibrated {len(fit.temperatures)} positions on "
            f"{fit.num_samples} verify rows: T = [{temps}], "
            f"ECE {fit.ece_before_mean:.4f} -> {fit.ece_after_mean:.4f}"
        )
    print(f"written to {path}")
    return 0
