"""The CLI's workloads: which requests a run sends (``workload=<option>``).

* ``kind: prompts`` (``workload=default``): the text prompts of ``workload.prompts``, or
  the lines of the JSONL ``workload.prompts_file``, cycled over ``workload.num_requests``
  requests. A file line is ``{"prompt": "text"}`` or ``{"prompt_token_ids": [ids]}`` and
  may carry its own ``"max_new_tokens"``; a bad line is an error naming the file and the
  line number (nothing is skipped).
* ``kind: synthetic`` (``workload=synthetic``): ``num_requests`` prompts of
  ``input_len`` random token ids (``random.Random(workload.seed)``, ids the tokenizer
  decodes as ordinary text), each generating exactly ``output_len`` tokens.

Every request must fit the model context: prompt + its max_new_tokens + gamma draft rows
<= ``max_context`` (the engine refuses the others; it never cuts a generation short).
:func:`workload_problems` needs no weights (it runs for every job before any job starts;
given a :class:`ContextFit` it checks the context too, text prompts through the
tokenizer); :func:`load_workload` turns the workload into :class:`Request` objects and
checks the context again with the loaded model's own limit and tokenizer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
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


@dataclass(frozen=True)
class ContextFit:
    """What a request must fit: ``prompt + max_new_tokens + gamma <= max_context``."""

    max_context: int
    gamma: int  # draft rows the verify step adds past the last committed token
    # text -> ids; None: text prompts cannot be counted yet (checked after the build)
    encode: Callable[[str], list[int]] | None
    # where max_context comes from, for messages: "model.max_context=100", or
    # "the checkpoint's max_position_embeddings"
    source: str = "the model's limit"
    raise_to: int | None = None  # how far model.max_context may be raised (None: no hint)
    # (prompt_len, max_new_tokens) -> why the memory plan can never hold such a request
    # (None: it fits); known once the weights are loaded
    memory: Callable[[int, int], str | None] | None = None


@dataclass(frozen=True)
class Shape:
    """The lengths of one distinct request of a workload (the prompts cycle)."""

    where: str  # "workload.prompts[0]", "prompts.jsonl:3", "workload.input_len=512"
    prompt_len: int | None  # None: a text prompt and no tokenizer to count it
    max_new_tokens: int
    budget_key: str  # the key that sets max_new_tokens, for messages


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
        except RecursionError:  # json's own limit: no prompt line nests this deep
            problems.append(f"{file}:{number}: not a prompt line (JSON nested too deep)")
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


def workload_problems(w: WorkloadConfig, fit: ContextFit | None = None) -> list[str]:
    """What the CLI's main job cannot run with (checked before any job starts); with
    ``fit``, also every request that cannot fit the model context."""
    if w.kind is WorkloadKind.prompts and w.prompts_file is not None:
        try:
            read_prompts_file(w.prompts_file)
        except ConfigError as e:
            return e.problems or [str(e)]
    elif w.kind is WorkloadKind.prompts and not w.prompts:
        return [
            "workload.prompts is empty; give at least one prompt, e.g. 'workload.prompts=[Hello]', "
            "or workload.prompts_file=prompts.jsonl"
        ]
    # (synthetic lengths are checked by validate())
    return context_problems(shapes(w, fit.encode), fit) if fit is not None else []


def shapes(w: WorkloadConfig, encode: Callable[[str], list[int]] | None) -> list[Shape]:
    """The distinct requests ``w`` sends (each prompt once, only those among the first
    ``num_requests``), with their lengths; text is counted with ``encode`` when given."""
    if w.kind is WorkloadKind.synthetic:
        where = f"workload.input_len={w.input_len}"
        return [Shape(where, w.input_len, w.output_len, "workload.output_len")]
    if w.prompts_file is not None:
        lines = read_prompts_file(w.prompts_file)
        wheres = [f"{w.prompts_file}:{n}" for n in range(1, len(lines) + 1)]
    else:
        lines = [FilePrompt(text, None, None) for text in w.prompts]
        wheres = [f"workload.prompts[{i}]" for i in range(len(lines))]
    out = []
    for where, line in list(zip(wheres, lines))[: w.num_requests]:
        if line.token_ids is not None:
            n: int | None = len(line.token_ids)
        else:
            assert line.text is not None
            n = len(encode(line.text)) if encode is not None else None
        if line.max_new_tokens is not None:
            out.append(Shape(where, n, line.max_new_tokens, f"{where} max_new_tokens"))
        else:
            out.append(Shape(where, n, w.max_new_tokens, "workload.max_new_tokens"))
    return out


def context_problems(requests: list[Shape], fit: ContextFit) -> list[str]:
    """One message per prompt too long for the context, one per token budget (a key) too
    large for the prompts it applies to, one per request the memory plan cannot hold;
    each says how to fix it."""
    limit, gamma = fit.max_context, fit.gamma
    rows = f" + {gamma} draft rows" if gamma else ""
    context = f"the model context of {limit} tokens ({fit.source})"
    raise_hint = (
        [f"raise model.max_context (up to {fit.raise_to})"]
        if fit.raise_to is not None and fit.raise_to > limit
        else []
    )
    problems: list[str] = []
    over: dict[str, list[Shape]] = {}  # budget key -> the requests it does not fit
    for r in requests:
        if r.prompt_len is None:
            continue
        if r.prompt_len + r.max_new_tokens + gamma <= limit:
            if fit.memory is not None and (why := fit.memory(r.prompt_len, r.max_new_tokens)):
                problems.append(
                    f"{r.where} ({r.prompt_len} prompt tokens + {r.budget_key}="
                    f"{r.max_new_tokens}): {why}"
                )
            continue
        total = r.prompt_len + r.max_new_tokens + gamma
        if r.budget_key == "workload.output_len":  # synthetic: both lengths are the user's
            fixes = [f"keep workload.input_len + workload.output_len <= {limit - gamma}"]
            problems.append(
                f"{r.where} + workload.output_len={r.max_new_tokens}{rows} = {total} tokens "
                f"exceed {context}; {_either(fixes + raise_hint)}"
            )
        elif r.prompt_len + 1 + gamma > limit:  # not even one new token fits
            fixes = [f"shorten it to at most {limit - 1 - gamma} tokens"]
            problems.append(
                f"{r.where} is {r.prompt_len} tokens long: with 1 new token{rows} it already "
                f"exceeds {context}; {_either(fixes + raise_hint)}"
            )
        else:
            over.setdefault(r.budget_key, []).append(r)
    for key, rs in over.items():
        longest = max(rs, key=lambda r: r.prompt_len or 0)
        n, budget = longest.prompt_len or 0, longest.max_new_tokens
        named = ", ".join(r.where for r in rs[:3]) + (f" and {len(rs) - 3} more" if rs[3:] else "")
        fixes = [f"set {key} <= {limit - n - gamma}", "shorten the prompt"]
        problems.append(
            f"{key}={budget} is too large for {context} with {named} (longest: {n} prompt "
            f"tokens + {budget} new{rows} = {n + budget + gamma}); {_either(fixes + raise_hint)}"
        )
    return problems


def _either(fixes: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join([", ".join(fixes[:-1]), fixes[-1]]) if len(fixes) > 1 else fixes[0]


def load_workload(
    w: WorkloadConfig,
    tokenizer: Tokenizer,
    vocab_size: int,
    params: SamplingParams,
    fit: ContextFit | None = None,
) -> Workload:
    """The requests of ``w``; request ``i`` samples with seed ``params.seed + i``. With
    ``fit`` (the loaded model's context), a request that cannot fit is a ConfigError."""
    if problems := workload_problems(w, fit):
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
