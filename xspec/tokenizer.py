"""Text <-> token ids, and the ids that end a generation.

A checkpoint directory given as ``model.path`` must hold ``tokenizer.json`` (read with
Hugging Face ``tokenizers``), unless the run opts in to raw bytes with
``model.tokenizer=byte``. The built-in tiny presets have no trained vocabulary; they
use :class:`ByteTokenizer`, which maps each UTF-8 byte to one id in a block of 256 ids
that avoids the model's special (bos / stop) ids.

Stop ids: ``eos_token_id`` of ``config.json`` and of ``generation_config.json``, each an
int or a list of ints (Qwen3 instruct checkpoints list several), merged into one set,
:attr:`Tokenizer.stop_ids`. ``eos_id`` is the first of them (config.json's first).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from xspec.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_KINDS = ("auto", "byte")  # model.tokenizer


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None  # the primary stop id (first of stop_ids' sources), or None
    stop_ids: frozenset[int]  # a generated id in this set ends the request

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids ``offset .. offset+255``; special ids stay outside that block."""

    def __init__(self, vocab_size: int, bos_id: int | None, stop_ids: Iterable[int]) -> None:
        ordered = list(dict.fromkeys(stop_ids))
        specials = {i for i in (bos_id, *ordered) if i is not None}
        offset = next(
            (k for k in range(vocab_size - 255) if not specials & set(range(k, k + 256))), None
        )
        if offset is None:
            raise CheckpointError(
                f"vocab_size {vocab_size} is too small for the byte tokenizer (needs 256 ids besides "
                f"bos/eos); add a {TOKENIZER_FILE} to the checkpoint directory"
            )
        self.offset, self.bos_id = offset, bos_id
        self.stop_ids = frozenset(ordered)
        self.eos_id = ordered[0] if ordered else None

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: Path, bos_id: int | None, stop_ids: Iterable[int]) -> None:
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises bare Exceptions on malformed files
            raise CheckpointError(f"cannot read tokenizer {path}: {e}") from e
        ordered = list(dict.fromkeys(stop_ids))
        self.bos_id = bos_id
        self.stop_ids = frozenset(ordered)
        self.eos_id = ordered[0] if ordered else None

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def missing_tokenizer(checkpoint_dir: Path) -> str | None:
    """The problem of a user checkpoint without ``tokenizer.json`` (None if it has one)."""
    if (checkpoint_dir / TOKENIZER_FILE).is_file():
        return None
    return (
        f"{checkpoint_dir / TOKENIZER_FILE} is missing: text prompts need the checkpoint's "
        f"tokenizer; copy {TOKENIZER_FILE} from the model's release into {checkpoint_dir}, or "
        "set model.tokenizer=byte to use raw UTF-8 bytes as token ids (toy models only)"
    )


def stop_ids(checkpoint_dir: Path | None, eos_token_id: Any, vocab_size: int) -> list[int]:
    """config.json's ``eos_token_id`` (passed in) then generation_config.json's, in order,
    without repeats. Each is null, an int or a list of ints in ``[0, vocab_size)``."""
    sources: list[tuple[str, Any]] = [("config.json", eos_token_id)]
    if checkpoint_dir is not None and (checkpoint_dir / GENERATION_CONFIG).is_file():
        file = checkpoint_dir / GENERATION_CONFIG
        try:
            gen = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read {file} ({e}); fix or remove the file") from e
        if isinstance(gen, dict):
            sources.append((GENERATION_CONFIG, gen.get("eos_token_id")))
    out: list[int] = []
    for name, value in sources:
        values = value if isinstance(value, list) else [] if value is None else [value]
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int)]
        bad += [v for v in values if v not in bad and not 0 <= v < vocab_size]
        if bad:
            where = checkpoint_dir / name if checkpoint_dir is not None else name
            raise CheckpointError(
                f"{where}: eos_token_id {value!r} must be an id or a list of ids in "
                f"[0, {vocab_size}); bad: {bad}"
            )
        out += [v for v in values if v not in out]
    return out


def load_tokenizer(
    checkpoint_dir: Path | None,
    vocab_size: int,
    bos_id: int | None,
    eos_token_id: Any,
    *,
    kind: str = "auto",
    required: bool = False,
) -> Tokenizer:
    """The run's tokenizer. ``kind``: ``auto`` (``tokenizer.json`` if the directory has one,
    else bytes, unless ``required``) or ``byte``. ``required``: the checkpoint is the
    user's (``model.path``), so a missing ``tokenizer.json`` is an error."""
    if kind not in TOKENIZER_KINDS:
        raise CheckpointError(f"model.tokenizer={kind!r}; use one of {', '.join(TOKENIZER_KINDS)}")
    stops = stop_ids(checkpoint_dir, eos_token_id, vocab_size)
    if kind == "byte":
        return ByteTokenizer(vocab_size, bos_id, stops)
    if checkpoint_dir is not None and (checkpoint_dir / TOKENIZER_FILE).is_file():
        return HFTokenizer(checkpoint_dir / TOKENIZER_FILE, bos_id, stops)
    if required and checkpoint_dir is not None and (problem := missing_tokenizer(checkpoint_dir)):
        raise CheckpointError(problem)
    return ByteTokenizer(vocab_size, bos_id, stops)


def plain_token_ids(tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Ids that decode to ordinary text: no bos / stop / added (special) tokens, and for
    the byte tokenizer only its 256-id block. Synthetic prompts draw from these."""
    if isinstance(tokenizer, ByteTokenizer):
        return list(range(tokenizer.offset, tokenizer.offset + 256))
    special = {i for i in (tokenizer.bos_id, *tokenizer.stop_ids) if i is not None}
    limit = vocab_size
    if isinstance(tokenizer, HFTokenizer):
        special |= set(tokenizer._tok.get_added_tokens_decoder())
        limit = min(limit, tokenizer._tok.get_vocab_size(with_added_tokens=True))
    return [i for i in range(limit) if i not in special]
