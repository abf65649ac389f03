"""xspec.jsonfile: a user-named JSON file that is a FIFO, huge, deep or broken is one
clear error, never a hang, a RecursionError or a multi-gigabyte read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from xspec.jsonfile import JSONFileError, read_json


def test_a_regular_file_reads(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"a": [1, 2]}')
    assert read_json(tmp_path / "a.json") == {"a": [1, 2]}


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: p.mkdir(), "not a regular file"),
        (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nests JSON too deeply"),
        (lambda p: p.write_text('{"a": 1,'), "not valid JSON (line 1, column 9"),
        (lambda p: p.write_bytes(b'{"a": "\xff"}'), "not UTF-8 text (byte 7)"),
        (lambda p: p.write_text(" " * 300_000), "over the 250000-byte limit"),
    ],
)
def test_each_bad_file_is_one_error(tmp_path: Path, make, needle: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "x.json"
    make(path)
    with pytest.raises(JSONFileError) as e:
        read_json(path, max_bytes=250_000)
    assert needle in str(e.value) and str(path) in str(e.value)
    assert e.value.missing is (needle == "does not exist")
