"""Text <-> token ids, and the ids that end a generation.

A checkpoint directory given as ``model.path`` must hold ``tokenizer.json`` (read with
Hugging Face ``tokenizers``), unless the run opts in to raw bytes with
``model.tokenizer=byte``. The built-in tiny presets have no trained vocabulary; they
use :class:`ByteTokenizer`, which maps each UTF-8 byte to one id in a block of 256 ids
that avoids the model's special (bos / stop) ids.

Special tokens: a text is encoded as the checkpoint's ``tokenizer.json`` encodes it with its
special tokens (its post-processor: ``Tokenizer.from_file(path).encode(text).ids``, which
is also what Hugging Face's tokenizer of that file and vLLM give), so a prompt sent as
text and the same prompt sent as those ids are the same prompt. xspec adds no BOS of its
own: a checkpoint whose ``tokenizer.json`` adds none gets none (``config.json``'s
``bos_token_id`` is read, not added). ``encode(text, special=False)`` leaves them off (a
rendered chat prompt holds its own). The byte tokenizer adds none.

Stop ids: ``eos_token_id`` of ``config.json`` and of ``generation_config.json``, each an
int or a list of ints (Qwen3 instruct checkpoints list several), merged into one set,
:attr:`Tokenizer.stop_ids`. ``eos_id`` is the first of them (config.json's first).

Text that is not Unicode (a lone surrogate, which a JSON ``"\\ud800"`` escape without its
pair produces) cannot be encoded: :meth:`Tokenizer.encode` raises
:class:`~xspec.errors.RequestError` naming the character. :attr:`Tokenizer.max_token_bytes`
bounds how much text one token can stand for, so a server can refuse a prompt too long for
the context from its byte length, before tokenizing it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from xspec.errors import CheckpointError, RequestError

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_KINDS = ("auto", "byte")  # model.tokenizer


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None  # the primary stop id (first of stop_ids' sources), or None
    stop_ids: frozenset[int]  # a generated id in this set ends the request

    def encode(self, text: str, special: bool = True) -> list[int]:
        """``text``'s ids, with the special tokens the tokenizer adds to a text (its BOS)
        unless ``special`` is False."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    @property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text one token can stand for (None: no bound, the
        tokenizer may drop text), so ``len(text) / max_token_bytes`` ids at least."""
        ...


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text`` (None: it is Unicode text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _not_unicode(text: str) -> RequestError:
    at = lone_surrogate(text) or 0
    return RequestError(
        f"the text holds a lone surrogate U+{ord(text[at]):04X} at character {at}, which is "
        "not Unicode and cannot be tokenized; send valid UTF-8 (a JSON \\ud800-style "
        "escape needs its pair)"
    )


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
        self.max_token_bytes = 1

    def encode(self, text: str, special: bool = True) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise _not_unicode(text) from None
        return [b + self.offset for b in data]

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
        self.path = path
        ordered = list(dict.fromkeys(stop_ids))
        self.bos_id = bos_id
        self.stop_ids = frozenset(ordered)
        self.eos_id = ordered[0] if ordered else None

    def encode(self, text: str, special: bool = True) -> list[int]:
        try:
            # encode_batch, not encode: it releases the GIL while it works (encode holds
            # it throughout, seconds for a megabyte), so other threads run meanwhile
            return self._tok.encode_batch([text], add_special_tokens=special)[0].ids
        except TypeError:  # the library's answer to a lone surrogate
            if lone_surrogate(text) is not None:
                raise _not_unicode(text) from None
            raise

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The longest token's text in UTF-8 bytes (an upper bound of what it covers: a
        byte-level or metaspace token spells each byte with one character of 1-3 bytes),
        times 4 after a normalizer (NFKC maps a 4-byte character to 1 byte); None for a
        model or step that can drop text or fold any run of it into one token."""
        spec = json.loads(self.path.read_text(encoding="utf-8"))
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or (model.get("unk_token") and model.get("fuse_unk")):
            return None
        steps = _steps(spec.get("normalizer")) + _steps(spec.get("pre_tokenizer"))
        if any(_drops_text(s) for s in steps) or any(
            t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []
        ):
            return None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
        return longest * (4 if spec.get("normalizer") else 1)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


# normalizer / pre-tokenizer steps that remove text (whitespace, accents, replacements)
_DROPS_TEXT = frozenset({"Strip", "StripAccents", "Replace", "BertNormalizer", "Precompiled",
                         "Whitespace", "WhitespaceSplit", "BertPreTokenizer"})  # fmt: skip


def _steps(step: Any) -> list[dict]:
    """A tokenizer.json normalizer or pre-tokenizer as its list of steps (Sequence opened)."""
    if not isinstance(step, dict):
        return []
    inner = step.get("normalizers") or step.get("pretokenizers")
    return [s for x in inner for s in _steps(x)] if isinstance(inner, list) else [step]


def _drops_text(step: dict) -> bool:
    return step.get("type") in _DROPS_TEXT or (
        step.get("type") == "Split" and step.get("behavior") == "Removed"
    )


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
