"""Prompts for the serving benchmark: synthetic random words or a JSONL file.

A synthetic prompt is ``--input-len`` tokens long as the server counts them
(``usage.prompt_tokens``, its BOS included): random words, cut to that many tokens with a
:class:`TokenCounter` (the server's ``/tokenize`` and ``/detokenize``, or a local
``tokenizer.json``). A JSONL prompt's length is counted in whitespace-separated words
until the server's ``usage.prompt_tokens`` gives the real count.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from xspec.errors import UserError

# Common English words, one token each in the usual BPE vocabularies, so a synthetic
# prompt of n words is close to n tokens.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this have had "
    "not are but one all were which when there can more time also been into who would "
    "first new after some other two may what over only most made like than years many "
    "city world state part people then where year between out because under while since "
    "both each through during before three water house school group great small number "
    "music river early later name game team long own high life night light open line"
)
WORDS = _WORDS.split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens (synthetic) or words (a file), until the server reports them
    max_tokens: int


class TokenCounter(Protocol):
    """The served model's tokenizer, as the server applies it to a text prompt."""

    async def encode(self, text: str, special: bool) -> list[int]: ...

    async def decode(self, ids: list[int]) -> str: ...


class LocalTokens:
    """A ``tokenizer.json`` (``--tokenizer``: the file or its checkpoint directory), read
    with Hugging Face ``tokenizers`` as xspec and vLLM servers read it."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises bare Exceptions
            raise UserError(f"--tokenizer {path}: cannot read {file} ({e})") from None

    async def encode(self, text: str, special: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=special).ids)

    async def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


async def synthetic(
    num_prompts: int, input_len: int, output_len: int, seed: int, tok: TokenCounter
) -> list[BenchRequest]:
    """``num_prompts`` prompts of random words, each ``input_len`` tokens as the server
    counts them (special tokens included; one fewer when re-tokenizing the cut text
    merges two tokens); the same for the same seed and tokenizer."""
    rng = random.Random(seed)
    specials = len(await tok.encode("", True))  # the BOS a text gets
    out = []
    for _ in range(num_prompts):
        words = " ".join(rng.choices(WORDS, k=input_len))  # a word is >= 1 token
        ids = (await tok.encode(words, False))[: max(input_len - specials, 1)]
        for _ in range(8):  # the cut text may tokenize longer: shorten until it fits
            text = await tok.decode(ids)
            n = len(await tok.encode(text, True))
            if n <= input_len or len(ids) == 1:
                break
            ids = ids[: len(ids) - (n - input_len)]
        out.append(BenchRequest(text, n, output_len))
    return out


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of the file ``path`` the user named (``what``: how, e.g.
    ``--dataset``); a UserError naming it when it is not a regular file (a FIFO would
    block forever), cannot be read, or is not UTF-8."""
    try:
        if path.exists() and not path.is_file():
            raise UserError(f"{what} {path}: not a regular file")
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"{what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def parse_json(text: str, where: str) -> Any:
    """``text`` as JSON; a UserError naming ``where`` when it is not (or nests too deep)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg})") from None
    except RecursionError:
        raise UserError(f"{where}: not JSON this client reads (nested too deep)") from None


def from_jsonl(path: Path, num_prompts: int | None, output_len: int) -> list[BenchRequest]:
    """One JSON object a line: ``prompt`` (a string), optionally ``max_tokens`` or
    ``output_len`` (a positive int, else ``output_len``). Blank lines are skipped. With
    ``num_prompts`` above the line count the prompts repeat in order."""
    lines = read_text(path, "--dataset").splitlines()
    requests = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        row = parse_json(line, where)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f'{where}: expected an object with a string "prompt"')
        n = row.get("max_tokens", row.get("output_len", output_len))
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise UserError(f"{where}: max_tokens/output_len must be a positive integer")
        requests.append(BenchRequest(row["prompt"], len(row["prompt"].split()), n))
    if not requests:
        raise UserError(f"--dataset {path}: no prompts")
    count = num_prompts or len(requests)
    return [requests[i % len(requests)] for i in range(count)]
