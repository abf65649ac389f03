"""``python -m xspec.bench serve|compare``: a serving benchmark for any OpenAI-compatible
server (docs/performance.md, "Serving benchmark").

    python -m xspec.bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --request-rate 4 --max-concurrency 32 --dataset synthetic --input-len 512 \\
        --output-len 128 --goodput ttft:500 tpot:50 --label mtp --result-file mtp.json
    python -m xspec.bench compare none.json mtp.json dspark.json

Exit codes: 0 done, 1 no request succeeded or the result file could not be written
(the report is printed first), 2 a usage error (bad option, dataset, or a --result-file
that cannot be written, found before any request is sent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from xspec import atomic
from xspec.bench import compare, dataset
from xspec.bench.serve import ENDPOINTS, ServeConfig, run_benchmark, synthetic_requests
from xspec.bench.stats import SLO_METRICS, format_report
from xspec.errors import OutputError, UserError


def _rate(text: str) -> float:
    v = float(text)  # "inf" parses
    if not v > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


def _slo(text: str) -> tuple[str, float]:
    name, _, ms = text.partition(":")
    if name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of {SLO_METRICS} as NAME:MS")
    try:
        return name, float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: MS must be a number") from None


def _json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg})") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xspec.bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="load an OpenAI-compatible server and measure it")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    s.add_argument("--model", help="model name sent (default: first id of GET /v1/models)")
    s.add_argument("--dataset", default="synthetic", help="'synthetic' or a JSONL file")
    s.add_argument("--num-prompts", type=_positive_int, help="default: 100, or the file's lines")
    s.add_argument(
        "--input-len",
        type=_positive_int,
        default=256,
        help="synthetic prompt tokens, as the server counts them (BOS included)",
    )
    s.add_argument("--tokenizer", type=Path, help="tokenizer.json (or its directory) to count "
                   "--input-len with; default: the server's /tokenize")  # fmt: skip
    s.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens default")
    s.add_argument("--request-rate", type=_rate, default=float("inf"), help="req/s or inf")
    s.add_argument("--burstiness", type=_rate, default=1.0, help="gamma shape; 1: Poisson")
    s.add_argument("--max-concurrency", type=_positive_int, help="cap on requests in flight")
    s.add_argument("--seed", type=int, default=0, help="arrivals and synthetic prompts")
    s.add_argument("--timeout", type=_rate, default=600.0, help="seconds per request")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, SGLang)")
    s.add_argument("--extra-body", type=_json_object, default={}, help="JSON merged into bodies")
    s.add_argument("--api-key", help="sent as Authorization: Bearer")
    s.add_argument("--goodput", type=_slo, nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")  # fmt: skip
    s.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated")
    s.add_argument("--label", help="the run's name in `compare` (e.g. none, mtp, dspark)")
    s.add_argument("--result-file", type=Path, help="write the result JSON here")
    c = sub.add_parser("compare", help="a markdown table across result JSONs")
    c.add_argument("results", type=Path, nargs="+", help="result files; ratios vs the first")
    return p


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        qs = tuple(float(q) for q in text.split(","))
    except ValueError:
        raise UserError(f"--metric-percentiles {text!r}: comma-separated numbers") from None
    if not all(0 <= q <= 100 for q in qs):
        raise UserError(f"--metric-percentiles {text!r}: each in [0, 100]")
    return qs


def check_result_file(path: Path) -> None:
    """A UserError, before any request is sent, when ``--result-file`` cannot be written:
    a directory or another non-regular file, a path under a file, a directory in which no
    file can be made (a read-only or full file system, no permission: tried with a file
    made and removed at once)."""
    if path.is_dir():
        raise UserError(
            f"--result-file {path} is a directory; name a file, e.g. {path}/result.json"
        )
    if path.exists() and not path.is_file():  # a device or FIFO would be replaced
        raise UserError(f"--result-file {path} is not a regular file; name a file to write")
    where = next((p for p in path.parents if p.exists()), Path("."))  # the nearest that is
    if not where.is_dir():
        raise UserError(
            f"--result-file {path} is under the file {where}; name a file in a directory"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".xspec-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(
            f"--result-file {path}: no file can be written in {where} ({e.strerror or e}); "
            "name a file in a directory you can write"
        ) from None


async def serve(args: argparse.Namespace) -> int:
    if args.result_file is not None:  # before a request is sent: the results must land
        check_result_file(args.result_file)
    cfg = ServeConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        timeout=args.timeout,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        api_key=args.api_key,
        goodput_slos_ms=dict(args.goodput),
        percentiles=_percentiles(args.metric_percentiles),
        label=args.label,
    )
    if args.dataset == "synthetic":
        n = args.num_prompts or 100
        requests = await synthetic_requests(cfg, n, args.input_len, args.output_len, args.tokenizer)
    else:
        requests = dataset.from_jsonl(Path(args.dataset), args.num_prompts, args.output_len)
    result = await run_benchmark(cfg, requests)
    print(format_report(result, cfg.percentiles))
    if args.result_file:  # atomic: a disk that fills now keeps any previous file whole
        atomic.write_text(args.result_file, json.dumps(result, indent=2) + "\n")
        print(f"result: {args.result_file}")
    return 0 if result["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # a bad option: argparse exits with code 2
    try:
        if args.command == "compare":
            print(compare.table(args.results))
            return 0
        return asyncio.run(serve(args))
    except (UserError, OutputError) as e:  # OutputError: the report is printed above
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
