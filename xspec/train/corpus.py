"""The offline training corpus: the Python standard library's own source files.

Every machine with Python has it, so the tiny checkpoints rebuild anywhere without a
download. Files are listed in sorted order under ``sysconfig``'s ``stdlib`` directory
(tests, IDLE, demos and installed packages left out); a fixed hash of each file's
relative path puts about 1 in 20 files in the held-out split, which gives the
evaluation prompts and the calibration data and is never trained on.

The tokenizer is a byte-level BPE trained on the training split with the ``tokenizers``
library and saved as ``tokenizer.json`` (the same file and loader a real checkpoint
uses). Its first ids are the specials: ``<|bos|>`` 0, ``<|eos|>`` 1 (a file's end),
``<|noise|>`` 2 (the DSpark block filler), ``<|mask|>`` 3 (DFlash's).
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIALS = ("<|bos|>", "<|eos|>", "<|noise|>", "<|mask|>")
BOS, EOS, NOISE, MASK = range(len(SPECIALS))
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__"}
)
HELD_OUT_EVERY = 20  # about 1 file in 20 is held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def held_out(rel: str) -> bool:
    """The fixed split: a stable hash of the file's path relative to the stdlib root."""
    digest = hashlib.sha256(rel.encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELD_OUT_EVERY == 0


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the stdlib root, '/'-separated
    text: str


def source_files(root: Path | None = None, *, split: str) -> list[SourceFile]:
    """The ``train`` or ``heldout`` files, sorted by relative path."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    out: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if EXCLUDED_DIRS & set(rel.split("/")[:-1]) or held_out(rel) != (split == "heldout"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            out.append(SourceFile(rel, text))
    return out


def corpus_digest(files: list[SourceFile]) -> str:
    """sha256 over the files' paths and texts: names the exact corpus in the model card."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.rel.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()[:16]


def train_tokenizer(files: list[SourceFile], vocab_size: int, path: Path) -> None:
    """Byte-level BPE over ``files`` -> ``path`` (tokenizer.json); deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer)
    # a text is encoded with the <|bos|> the model is trained with (xspec.tokenizer)
    bos = SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, BOS)]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


def encode_files(files: list[SourceFile], tokenizer_path: Path) -> torch.Tensor:
    """One token stream: ``<|bos|> file <|eos|>`` for every file, concatenated (int32)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    texts = [f.text for f in files]
    parts = [[BOS, *e.ids, EOS] for e in tok.encode_batch(texts, add_special_tokens=False)]
    return torch.tensor([i for p in parts for i in p], dtype=torch.int32)


def sample_windows(
    stream: torch.Tensor, batch: int, length: int, gen: torch.Generator
) -> torch.Tensor:
    """``batch`` random windows of ``length`` tokens -> ``[batch, length]`` int64."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()


def prompts(files: list[SourceFile], count: int, *, seed: int, max_chars: int = 400) -> list[str]:
    """``count`` evaluation prompts from held-out ``files``: a run of whole lines (at most
    ``max_chars``) starting at a random line of a random file, ending on a line break."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < count:
        lines = rng.choice(files).text.splitlines(keepends=True)
        if len(lines) < 8:
            continue
        start = rng.randrange(0, len(lines) - 4)
        text = ""
        for line in lines[start:]:
            if len(text) + len(line) > max_chars:
                break
            text += line
        if text.strip() and len(text) >= max_chars // 4:
            out.append(text)
    return out
