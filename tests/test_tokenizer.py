"""Tokenizer choice (tokenizer.json required for a user checkpoint) and stop ids."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

import xspec
from xspec.errors import CheckpointError, RequestError
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


DSV4_TOKENIZER = Path(xspec.__file__).parent / "assets" / "dsv4_tiny" / "tokenizer.json"


def test_text_that_is_not_unicode_is_a_request_error(tmp_path: Path) -> None:
    """A lone surrogate (a JSON "\\ud800" escape without its pair) was a TypeError from
    the tokenizers library and a UnicodeEncodeError from the byte tokenizer."""
    write_word_tokenizer(tmp_path / "tokenizer.json")
    toks = [ByteTokenizer(VOCAB, 256, [257]), HFTokenizer(DSV4_TOKENIZER, 0, [1]),
            load_tokenizer(tmp_path, VOCAB, None, 3, required=True)]  # fmt: skip
    for tok in toks:
        with pytest.raises(RequestError, match=r"lone surrogate U\+D800 at character 1"):
            tok.encode("a\ud800b")


def test_the_cli_and_the_api_refuse_text_that_is_not_unicode(tmp_path: Path) -> None:
    from tests.clirun import run_cli_in_process

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a\\ud800b"}\n')
    run = run_cli_in_process(
        "model=qwen3_tiny", "spec=none", "platform=cpu", "workload.max_new_tokens=2",
        f"workload.prompts_file={prompts}", "workload.num_requests=1", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run
    assert "lone surrogate U+D800" in run.stderr and "Traceback" not in run.stderr
    llm = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu")
    with pytest.raises(RequestError, match="lone surrogate"):
        llm.generate("a\ud800b", max_new_tokens=2)


def test_text_is_encoded_as_its_tokenizer_json_encodes_it(tmp_path: Path) -> None:
    """One rule for special tokens: the tokenizer.json's post-processor (as Hugging Face
    and vLLM encode), never a BOS of xspec's own: config.json's bos_token_id is not added
    by a tokenizer.json that adds none."""
    from tokenizers import Tokenizer

    text = "def f(x):\n    return x\n"
    theirs = Tokenizer.from_file(str(DSV4_TOKENIZER))
    tok = HFTokenizer(DSV4_TOKENIZER, 0, [1])
    assert tok.encode(text) == theirs.encode(text).ids and tok.encode(text)[0] == 0
    assert tok.encode(text, special=False) == theirs.encode(text, add_special_tokens=False).ids
    write_word_tokenizer(tmp_path / "tokenizer.json")  # no post-processor
    assert HFTokenizer(tmp_path / "tokenizer.json", 4, [3]).encode("hello world") == [1, 2]


def test_max_token_bytes_bounds_the_text_a_token_covers(tmp_path: Path) -> None:
    """The byte bound a server refuses long prompts by never refuses one that fits: every
    text has at least len(bytes) / max_token_bytes ids."""
    assert ByteTokenizer(VOCAB, 256, [257]).max_token_bytes == 1
    tok = HFTokenizer(DSV4_TOKENIZER, 0, [1])
    bound = tok.max_token_bytes
    assert bound is not None and 8 <= bound <= 256
    for text in ["def f(x):\n    return x\n", " " * 5000, "=" * 3000, "é" * 999, "\n\n" * 700]:
        assert len(tok.encode(text)) - 1 >= len(text.encode()) / bound  # - the BOS
    write_word_tokenizer(tmp_path / "tokenizer.json")  # a Whitespace pre-tokenizer drops text
    assert HFTokenizer(tmp_path / "tokenizer.json", None, [3]).max_token_bytes is None


def test_encoding_lets_other_threads_run() -> None:
    """tokenizers' ``encode`` holds the GIL throughout (the server's event loop froze for
    seconds on a long prompt); ``encode_batch`` releases it. Another thread's longest
    pause while 270 KB are encoded stays a small part of the encoding's time."""
    tok = HFTokenizer(DSV4_TOKENIZER, 0, [1])
    stop, pauses = threading.Event(), [0.0]

    def spin() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            pauses[0], last = max(pauses[0], now - last), now

    thread = threading.Thread(target=spin)
    thread.start()
    t0 = time.perf_counter()
    tok.encode("hello world " * 22_500)
    took = time.perf_counter() - t0
    stop.set()
    thread.join()
    assert pauses[0] < took / 3, f"another thread waited {pauses[0]:.3f} s of {took:.3f} s"
