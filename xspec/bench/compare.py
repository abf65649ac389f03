"""A markdown table across result JSONs of ``xspec.bench serve`` (or ``vllm bench serve
--save-result``): one row per run, ratios against the first (``spec=none`` first, so the
ratios read as the speed-up of each speculative method)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xspec.bench.dataset import parse_json, read_text
from xspec.errors import UserError

# (header, key, format); None prints as "-"
COLUMNS: list[tuple[str, str, str]] = [
    ("req/s", "request_throughput", ".2f"),
    ("out tok/s", "output_throughput", ".1f"),
    ("TTFT p50 ms", "median_ttft_ms", ".1f"),
    ("TTFT p99 ms", "p99_ttft_ms", ".1f"),
    ("TPOT p50 ms", "median_tpot_ms", ".2f"),
    ("TPOT p99 ms", "p99_tpot_ms", ".2f"),
    ("ITL p50 ms", "median_itl_ms", ".2f"),
    ("ITL p99 ms", "p99_itl_ms", ".2f"),
    ("acc. len", "spec_acceptance_length", ".2f"),
]
# ratios against the first run: higher is better for throughput, lower for TPOT
RATIOS: list[tuple[str, str]] = [
    ("out tok/s vs first", "output_throughput"),
    ("TPOT p50 vs first", "median_tpot_ms"),
]


def load(path: Path) -> dict[str, Any]:
    data = parse_json(read_text(path, "result file"), str(path))
    if not isinstance(data, dict) or "output_throughput" not in data:
        raise UserError(f"{path}: not a serving benchmark result (no output_throughput)")
    return data


def _fmt(v: Any, fmt: str) -> str:
    return "-" if not isinstance(v, int | float) else format(v, fmt)


def _ratio(v: Any, base: Any) -> str:
    ok = isinstance(v, int | float) and isinstance(base, int | float) and base
    return f"{v / base:.2f}x" if ok else "-"


def table(paths: list[Path]) -> str:
    """The markdown table; a row's label is the ``label`` stored at run time, else the
    file name without ``.json``."""
    runs = [(load(p), p) for p in paths]
    first = runs[0][0]
    header = ["run", *(h for h, _, _ in COLUMNS), *(h for h, _ in RATIOS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for data, path in runs:
        cells = [str(data.get("label") or path.stem)]
        cells += [_fmt(data.get(k), f) for _, k, f in COLUMNS]
        cells += [_ratio(data.get(k), first.get(k)) for _, k in RATIOS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
