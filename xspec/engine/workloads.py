"""The CLI's workloads: which requests a run sends (``workload=<option>``).

* ``kind: prompts`` (``workload=default``): the text prompts of ``workload.prompts``, or
  the lines of the JSONL ``workload.prompts_file``, cycled over ``workload.num_requests``
  requests. A file line is ``{"prompt": "text"}`` or ``{"prompt_token_ids": [ids]}`` and
  may carry its own ``"max_new_tokens"``; a bad line is an error naming the file and the
  line number (nothing is skipped).
* ``kind: synthetic`` (``workload=synthetic``): ``num_requests`` prompts of
  ``input_len`` random token ids (``random.Random(workload.seed)``, ids the tokenizer
  decodes as ordinary text), each generating exactly ``output_len`` tokens.

:func:`workload_problems` needs no model (it runs for every job before any job starts);
:func:`load_workload` turns the workload into :class:`Request` objects.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xspec.config import WorkloadConfig, WorkloadKind
from xspec.engine.engine import Request, seeded
from xspec.errors import ConfigError
from xspec.sampling import SamplingParams
from xspec.tokenizer import Tokenizer, plain_token_ids

_LINE_KEYS = {"prompt", "prompt_token_ids", "max_new_tokens"}


@dataclass(frozen=True)
class FilePrompt:
    """One line of a prompts file: text or token ids, and an optional token budget."""

    text: str | None
    token_ids: list[int] | None
    max_new_tokens: int | None


@dataclass(frozen=True)
class Workload:
    requests: list[Request]
    texts: list[str]  # what to show for each request (token-id prompts: a short summary)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _line_problem(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    if unknown := sorted(set(obj) - _LINE_KEYS):
        return f"unknown key(s) {unknown}; allowed: {sorted(_LINE_KEYS)}"
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        return 'give exactly one of "prompt" (text) or "prompt_token_ids" (a list of ids)'
    if "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"]):
        return '"prompt" must be a non-empty string'
    ids = obj.get("prompt_token_ids", [0])
    if not (isinstance(ids, list) and ids and all(_is_int(t) and t >= 0 for t in ids)):
        return '"prompt_token_ids" must be a non-empty list of non-negative integers'
    n = obj.get("max_new_tokens", 1)
    if not (_is_int(n) and n >= 1):
        return f'"max_new_tokens" must be an integer >= 1 (got {n!r})'
    return None


def read_prompts_file(path: str) -> list[FilePrompt]:
    """Every line of a JSONL prompts file; one ConfigError lists every bad line."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"workload.prompts_file: {file} does not exist (or is not a file)")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"workload.prompts_file: cannot read {file}: {e}") from None
    out, problems = [], []
    for number, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{file}:{number}: not valid JSON ({e.msg}, column {e.colno})")
            continue
        if (problem := _line_problem(obj)) is not None:
            problems.append(f"{file}:{number}: {problem}")
            continue
        out.append(
            FilePrompt(obj.get("prompt"), obj.get("prompt_token_ids"), obj.get("max_new_tokens"))
        )
    if problems:
        raise ConfigError("workload.prompts_file has bad lines:", problems=problems)
    if not out:
        raise ConfigError(
            f"workload.prompts_file: {file} has no prompts (one JSON object per line)"
        )
    return out


def workload_problems(w: WorkloadConfig) -> list[str]:
    """What the CLI's main job cannot run with (checked before any job starts)."""
    if w.kind is WorkloadKind.synthetic:
        return []  # lengths are checked by validate(), the context by the engine
    if w.prompts_file is not None:
        try:
            read_prompts_file(w.prompts_file)
        except ConfigError as e:
            return e.problems or [str(e)]
        return []
    if not w.prompts:
        return [
            "workload.prompts is empty; give at least one prompt, e.g. 'workload.prompts=[Hello]', "
            "or workload.prompts_file=prompts.jsonl"
        ]
    return []


def load_workload(
    w: WorkloadConfig, tokenizer: Tokenizer, vocab_size: int, params: SamplingParams
) -> Workload:
    """The requests of ``w``; request ``i`` samples with seed ``params.seed + i``."""
    if problems := workload_problems(w):
        raise ConfigError("cannot run the workload:", problems=problems)
    if w.kind is WorkloadKind.synthetic:
        return _synthetic(w, tokenizer, vocab_size, params)
    if w.prompts_file is not None:
        lines = read_prompts_file(w.prompts_file)
    else:
        lines = [FilePrompt(text, None, None) for text in w.prompts]
    requests, texts = [], []
    for i in range(w.num_requests):
        line = lines[i % len(lines)]
        if line.token_ids is not None:
            ids, text = list(line.token_ids), f"<{len(line.token_ids)} token ids>"
        else:
            assert line.text is not None
            ids, text = tokenizer.encode(line.text), line.text
        budget = line.max_new_tokens or w.max_new_tokens
        requests.append(Request(ids, budget, seeded(params, i), w.ignore_eos, list(w.stop)))
        texts.append(text)
    return Workload(requests, texts)


def _synthetic(
    w: WorkloadConfig, tokenizer: Tokenizer, vocab_size: int, params: SamplingParams
) -> Workload:
    ids = plain_token_ids(tokenizer, vocab_size)
    rng = random.Random(w.seed)
    requests = [
        Request(rng.choices(ids, k=w.input_len), w.output_len, seeded(params, i), ignore_eos=True)
        for i in range(w.num_requests)
    ]
    texts = [f"<{w.input_len} random token ids>"] * w.num_requests
    return Workload(requests, texts)
