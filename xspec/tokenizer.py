"""Text <-> token ids.

A checkpoint directory with ``tokenizer.json`` uses it (Hugging Face ``tokenizers``).
The built-in tiny presets have no trained vocabulary; they use :class:`ByteTokenizer`,
which maps each UTF-8 byte to one id in a block of 256 ids that avoids the model's
special (bos/eos) ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from xspec.errors import CheckpointError


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids ``offset .. offset+255``; special ids stay outside that block."""

    def __init__(self, vocab_size: int, bos_id: int | None, eos_id: int | None) -> None:
        specials = {i for i in (bos_id, eos_id) if i is not None}
        offset = next(
            (k for k in range(vocab_size - 255) if not specials & set(range(k, k + 256))), None
        )
        if offset is None:
            raise CheckpointError(
                f"vocab_size {vocab_size} is too small for the byte tokenizer (needs 256 ids besides "
                f"bos/eos); add a tokenizer.json to the checkpoint directory"
            )
        self.offset, self.bos_id, self.eos_id = offset, bos_id, eos_id

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: Path, bos_id: int | None, eos_id: int | None) -> None:
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises bare Exceptions on malformed files
            raise CheckpointError(f"cannot read tokenizer {path}: {e}") from e
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(
    checkpoint_dir: Path | None, vocab_size: int, bos_id: int | None, eos_id: int | None
) -> Tokenizer:
    if checkpoint_dir is not None and (checkpoint_dir / "tokenizer.json").is_file():
        return HFTokenizer(checkpoint_dir / "tokenizer.json", bos_id, eos_id)
    return ByteTokenizer(vocab_size, bos_id, eos_id)
