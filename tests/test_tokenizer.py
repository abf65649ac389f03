"""Tokenizer choice (tokenizer.json required for a user checkpoint) and stop ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import xspec
from xspec.errors import CheckpointError
from xspec.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, stop_ids

VOCAB = 512


def write_word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<eos>": 3, "<im_end>": 4}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))


def test_stop_ids_union_of_both_config_files(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 3]}))
    assert stop_ids(tmp_path, 3, VOCAB) == [3, 4]  # config.json first, no repeats
    assert stop_ids(tmp_path, [7, 3], VOCAB) == [7, 3, 4]  # the list form in config.json
    assert stop_ids(None, None, VOCAB) == []


@pytest.mark.parametrize("bad", [[1, "x"], 1.5, [VOCAB], True])
def test_bad_stop_ids_name_the_file(tmp_path: Path, bad: object) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id"):
        stop_ids(tmp_path, 3, VOCAB)


def test_byte_tokenizer_takes_a_list_of_stop_ids() -> None:
    tok = ByteTokenizer(VOCAB, 256, [257, 258])
    assert tok.stop_ids == frozenset({257, 258}) and tok.eos_id == 257
    assert not {256, 257, 258} & set(tok.encode("\xff any byte"))
    assert tok.decode(tok.encode("héllo")) == "héllo"


def test_checkpoint_tokenizer_and_stop_ids(tmp_path: Path) -> None:
    write_word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    tok = load_tokenizer(tmp_path, VOCAB, None, 3, required=True)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [1, 2] and tok.stop_ids == frozenset({3, 4})
    assert isinstance(load_tokenizer(tmp_path, VOCAB, None, 3, kind="byte"), ByteTokenizer)


def test_user_checkpoint_needs_a_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing.*model\.tokenizer=byte"):
        load_tokenizer(tmp_path, VOCAB, None, 3, required=True)
    assert isinstance(load_tokenizer(tmp_path, VOCAB, None, 3), ByteTokenizer)  # presets


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xspec.models.qwen3.tiny import tiny_dir

    path = tmp_path_factory.mktemp("qwen3") / "ckpt"
    shutil.copytree(tiny_dir(False), path)
    return path


def test_llm_refuses_a_checkpoint_without_tokenizer_unless_byte(tiny_copy: Path) -> None:
    with pytest.raises(CheckpointError, match=f"{tiny_copy}/tokenizer.json is missing"):
        xspec.LLM(model="qwen3", spec="none", platform="cpu", overrides=[f"model.path={tiny_copy}"])
    llm = xspec.LLM(
        model="qwen3",
        spec="none",
        platform="cpu",
        overrides=[f"model.path={tiny_copy}", "model.tokenizer=byte", "model.dtype=float32"],
    )
    assert isinstance(llm.tokenizer, ByteTokenizer)
    assert llm.tokenizer.stop_ids == frozenset({257})
