"""Generic checkpoint loading: layout, validation, streaming, atomic writes, presets."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from xspec.cache import cache_root
from xspec.errors import CheckpointError
from xspec.models.loading import (
    Checkpoint,
    has_non_finite,
    load_params,
    preset_dir,
    require_config_keys,
    write_checkpoint,
)


class Tiny(nn.Module):
    """Two linears, a norm and an int buffer: float params + a persistent int buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False)
        self.b = nn.Linear(3, 5, bias=True)
        self.norm = nn.LayerNorm(5)
        self.register_buffer("ids", torch.zeros(6, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)  # not loaded


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(3, 4, generator=g),
        "b.weight": torch.randn(5, 3, generator=g),
        "b.bias": torch.randn(5, generator=g),
        "norm.weight": torch.randn(5, generator=g),
        "norm.bias": torch.randn(5, generator=g),
        "ids": torch.arange(6, dtype=torch.int64) * 7,
    }


def _write(path: Path, tensors: dict[str, torch.Tensor], **kw) -> Path:
    write_checkpoint(path, tensors, {"model_type": "tiny"}, **kw)
    return path


def _identity(name: str) -> str:
    return name


def test_single_file_roundtrip(tmp_path: Path) -> None:
    src = _tensors()
    ckpt = Checkpoint(_write(tmp_path / "c", src))
    assert ckpt.config == {"model_type": "tiny"}
    assert sorted(ckpt.names()) == sorted(src)
    assert ckpt.meta("a.weight") == ([3, 4], "F32")
    assert ckpt.meta("ids") == ([6], "I64")
    m = Tiny()
    load_params(m, ckpt, _identity)
    sd = m.state_dict()
    for k, v in src.items():
        assert torch.equal(sd[k], v), k


def test_sharded_index_is_honoured(tmp_path: Path) -> None:
    src = _tensors()
    path = _write(tmp_path / "c", src, max_shard_bytes=64)  # 48 B + 60 B ... -> several shards
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    # A stray safetensors file that the index does not name must be ignored.
    (path / "stray.safetensors").write_bytes(b"garbage")
    ckpt = Checkpoint(path)
    assert ckpt.file_of("b.weight").name == index["weight_map"]["b.weight"]
    m = Tiny()
    load_params(m, ckpt, _identity)
    for k, v in src.items():
        assert torch.equal(m.state_dict()[k], v), k
    assert torch.equal(ckpt.get("b.bias"), src["b.bias"])


def test_index_naming_missing_shard(tmp_path: Path) -> None:
    path = _write(tmp_path / "c", _tensors(), max_shard_bytes=64)
    victim = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]["ids"]
    (path / victim).unlink()
    with pytest.raises(CheckpointError, match=rf"shard {victim} .*'ids'.* is missing"):
        Checkpoint(path)


def _repoint(path: Path, tensor: str, shard: str) -> Path:
    """Edit the index of ``path`` so that ``tensor``'s shard entry reads ``shard``."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"][tensor] = shard
    index_file.write_text(json.dumps(index))
    return path


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_shards_outside_the_directory_are_refused(tmp_path: Path, how: str) -> None:
    """A crafted index must not make the loader read a (valid!) safetensors file elsewhere:
    the error names the index file and the offending index line (tensor and shard entry)."""
    outside = _write(tmp_path / "elsewhere", _tensors(1)) / "model.safetensors"
    path = _write(tmp_path / "ckpt", _tensors(), max_shard_bytes=64)
    shard = {"dotdot": "../../../" + str(outside).lstrip("/"), "absolute": str(outside)}.get(
        how, "linked.safetensors"
    )
    if how == "symlink":
        (path / shard).symlink_to(outside)
    _repoint(path, "b.bias", shard)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(path)
    msg = str(e.value)
    assert "model.safetensors.index.json names shards outside the checkpoint directory" in msg
    assert f'"b.bias": {json.dumps(shard)}' in msg, msg  # the index line
    assert len(e.value.problems) == 1, msg


def test_index_symlinks_that_stay_inside_are_loaded(tmp_path: Path) -> None:
    """Symlinks are fine where they resolve inside the directory, and in a Hugging Face
    cache snapshot, whose files all link to ``../../blobs/<hash>``."""
    src = _tensors()
    path = _write(tmp_path / "ckpt", src, max_shard_bytes=64)
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]["ids"]
    (path / "alias.safetensors").symlink_to(path / shard)
    ckpt = Checkpoint(_repoint(path, "ids", "alias.safetensors"))
    assert torch.equal(ckpt.get("ids"), src["ids"])

    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in _write(tmp_path / "download", src, max_shard_bytes=64).iterdir():
        (repo / "blobs" / file.name).write_bytes(file.read_bytes())  # blobs are named by hash
        (snapshot / file.name).symlink_to(Path("../../blobs") / file.name)
    ckpt = Checkpoint(snapshot)
    assert ckpt.file_of("ids").is_symlink()
    assert all(torch.equal(ckpt.get(n), t) for n, t in src.items())


def test_missing_dir_config_and_invalid_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"has no config.json"):
        Checkpoint(empty)
    (empty / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON \(line 1"):
        Checkpoint(empty)
    (empty / "config.json").write_text("{}")
    (empty / "pytorch_model.bin").write_bytes(b"\x80pickle")
    with pytest.raises(
        CheckpointError, match=r"no \*.safetensors.*pytorch_model.bin.*never loaded"
    ):
        Checkpoint(empty)


def test_read_json(tmp_path: Path) -> None:
    path = _write(tmp_path / "c", _tensors(), extra_json={"quant.json": {"x": 1}})
    ckpt = Checkpoint(path)
    assert ckpt.read_json("quant.json") == {"x": 1}
    assert ckpt.read_json("absent.json") is None
    (path / "bad.json").write_text("[1,")
    with pytest.raises(CheckpointError, match=r"bad.json is not valid JSON"):
        ckpt.read_json("bad.json")


def test_all_problems_in_one_error_before_any_copy(tmp_path: Path) -> None:
    src = _tensors()
    del src["norm.bias"]  # missing
    src["b.weight"] = torch.zeros(5, 4)  # misshapen
    path = _write(tmp_path / "c", src, max_shard_bytes=64)
    ckpt = Checkpoint(path)
    m = Tiny()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_params(m, ckpt, _identity)
    msg = str(info.value)
    shard = ckpt.file_of("b.weight").name
    assert f"tensor 'b.weight' in {shard} has shape [5, 4], expected [5, 3]" in msg
    assert "no tensor provides 'norm.bias' (shape [5])" in msg
    assert len(info.value.problems) == 2
    for k, v in m.state_dict().items():  # raised before any data was copied
        assert torch.equal(v, before[k]), k


def test_unexpected_tensor_and_skip(tmp_path: Path) -> None:
    src = _tensors()
    src["mtp.0.extra"] = torch.ones(2)
    ckpt = Checkpoint(_write(tmp_path / "c", src))
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'mtp.0.extra' in model.safetensors"
    ):
        load_params(Tiny(), ckpt, _identity)
    m = Tiny()
    load_params(m, ckpt, lambda n: None if n.startswith("mtp.") else n)
    assert torch.equal(m.a.weight, src["a.weight"])


def test_rename_and_duplicates(tmp_path: Path) -> None:
    src = {("model." + k): v for k, v in _tensors().items()}
    ckpt = Checkpoint(_write(tmp_path / "c", src))
    m = Tiny()
    load_params(m, ckpt, lambda n: n.removeprefix("model."))
    assert torch.equal(m.ids, src["model.ids"])
    with pytest.raises(CheckpointError, match="both provide"):
        load_params(Tiny(), ckpt, lambda n: "a.weight" if n.endswith("weight") else n)


def test_int_into_float_needs_convert(tmp_path: Path) -> None:
    src = _tensors()
    src["a.weight"] = torch.ones(3, 4, dtype=torch.int8)
    ckpt = Checkpoint(_write(tmp_path / "c", src))
    with pytest.raises(
        CheckpointError, match=r"'a.weight' in model.safetensors is I8.*dequantising"
    ):
        load_params(Tiny(), ckpt, _identity)
    m = Tiny()
    load_params(
        m, ckpt, _identity, convert=lambda n, t: t.float() * 0.5 if t.dtype == torch.int8 else t
    )
    assert torch.equal(m.a.weight, torch.full((3, 4), 0.5))
    with pytest.raises(CheckpointError, match=r"converts to torch.int8"):
        load_params(Tiny(), ckpt, _identity, convert=lambda n, t: t)


def test_dtype_conversion_by_copy(tmp_path: Path) -> None:
    src = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in _tensors().items()}
    ckpt = Checkpoint(_write(tmp_path / "c", src))
    assert ckpt.meta("a.weight")[1] == "BF16"
    m = Tiny()
    load_params(m, ckpt, _identity)
    assert m.a.weight.dtype == torch.float32
    assert torch.equal(m.a.weight, src["a.weight"].float())


def test_load_params_streams_one_tensor_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """Track every tensor iter_tensors hands out with a weakref: when the next one is
    read, the previous one must already be gone (no state dict is materialised)."""
    ckpt = Checkpoint(_write(tmp_path / "c", _tensors(), max_shard_bytes=64))
    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    peak = 0
    yielded = 0
    original = Checkpoint.iter_tensors

    def tracking(self, names=None):
        nonlocal peak, yielded
        for name, t in original(self, names):
            alive.add(t)
            yielded += 1
            peak = max(peak, len(alive))
            yield name, t
            del t

    monkeypatch.setattr(Checkpoint, "iter_tensors", tracking)
    load_params(Tiny(), ckpt, _identity)
    assert yielded == 6
    assert peak == 1, f"{peak} checkpoint tensors alive at once"


def test_require_config_keys(tmp_path: Path) -> None:
    require_config_keys({"a": 1}, ["a"], tmp_path)
    with pytest.raises(CheckpointError) as info:
        require_config_keys({"a": 1}, ["a", "b", "c"], tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    assert info.value.problems == ["missing key 'b'", "missing key 'c'"]


def test_write_checkpoint_is_atomic(tmp_path: Path, monkeypatch) -> None:
    tensors = {"x": torch.ones(2), "y": torch.ones(4)[::2]}  # non-contiguous: made contiguous
    write_checkpoint(tmp_path / "ok", tensors, {})
    assert torch.equal(Checkpoint(tmp_path / "ok").get("y"), torch.ones(2))

    import safetensors.torch

    real_save = safetensors.torch.save_file
    saved: list[str] = []

    def fail_on_second_shard(part, filename, metadata=None):
        if saved:
            raise OSError("disk full")
        saved.append(filename)
        real_save(part, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", fail_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path / "bad", tensors, {}, max_shard_bytes=4)
    assert len(saved) == 1  # the first shard was written, then the writer failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]  # no half-written dir
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        write_checkpoint(tmp_path / "ok", tensors, {})


def test_writes_are_deterministic(tmp_path: Path) -> None:
    _write(tmp_path / "a", _tensors(), max_shard_bytes=64)
    _write(tmp_path / "b", _tensors(), max_shard_bytes=64)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_preset_dir_generates_once_and_reuses(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []

    def gen(dst: Path) -> None:
        calls.append(dst)
        _write(dst, _tensors())

    d1 = preset_dir("toy", "v1", gen)
    d2 = preset_dir("toy", "v1", gen)
    assert d1 == d2 == tmp_path / "cache" / "presets" / "toy-v1"
    assert len(calls) == 1 and calls[0] != d1  # generated elsewhere, then renamed
    assert torch.equal(Checkpoint(d1).get("ids"), _tensors()["ids"])
    assert sorted(p.name for p in d1.parent.iterdir()) == ["toy-v1"]


def test_preset_dir_failing_generate_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))

    def half(dst: Path) -> None:
        dst.mkdir()
        (dst / "config.json").write_text("{}")
        raise RuntimeError("generator crashed")

    with pytest.raises(RuntimeError, match="generator crashed"):
        preset_dir("toy", "v1", half)
    assert list((tmp_path / "cache" / "presets").iterdir()) == []


def test_preset_dir_lost_race_reuses_winner(tmp_path: Path, monkeypatch) -> None:
    """Another process installs the preset while this one generates: ours is discarded."""
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    final = cache_root() / "presets" / "toy-v1"

    def racing(dst: Path) -> None:
        _write(final, _tensors(seed=1))  # the "other process" wins
        _write(dst, _tensors(seed=2))

    assert preset_dir("toy", "v1", racing) == final
    assert torch.equal(Checkpoint(final).get("a.weight"), _tensors(seed=1)["a.weight"])
    assert sorted(p.name for p in final.parent.iterdir()) == ["toy-v1"]


def _truncate(file: Path, nbytes: int) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:-nbytes])


def test_truncated_shard_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "c", _tensors())
    _truncate(path / "model.safetensors", 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated.*re-download"):
        Checkpoint(path)


def test_unreadable_tensor_data_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A shard damaged after its header was read (e.g. replaced mid-run) names the tensor."""
    path = _write(tmp_path / "c", _tensors())
    ckpt = Checkpoint(path)
    _truncate(path / "model.safetensors", 16)
    with pytest.raises(CheckpointError, match=r"cannot read tensor .* from .*model\.safetensors"):
        load_params(Tiny(), ckpt, _identity)


def test_truncated_preset_says_how_to_clear_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    d = preset_dir("toy", "v1", lambda dst: _write(dst, _tensors()))
    _truncate(d / "model.safetensors", 16)
    with pytest.raises(CheckpointError, match=f"delete {d}"):
        Checkpoint(d)


def test_cache_dir_that_is_a_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(CheckpointError, match="XSPEC_CACHE_DIR to a writable directory"):
        preset_dir("toy", "v1", lambda dst: _write(dst, _tensors()))


def test_cache_dir_not_writable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))

    def denied(dst: Path) -> None:
        raise PermissionError(13, "Permission denied", str(dst))

    with pytest.raises(CheckpointError, match=r"Permission denied.*XSPEC_CACHE_DIR"):
        preset_dir("toy", "v1", denied)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(tmp_path: Path, bad: float) -> None:
    src = _tensors()
    src["b.weight"][2, 1] = bad
    ckpt = Checkpoint(_write(tmp_path / "c", src))
    with pytest.raises(
        CheckpointError, match=r"'b\.weight' in .*model\.safetensors holds NaN or Inf"
    ):
        load_params(Tiny(), ckpt, _identity)


def test_overflow_into_model_dtype_is_refused(tmp_path: Path) -> None:
    src = _tensors()
    src["a.weight"][0, 0] = 1e6  # finite in float32, inf in float16
    ckpt = Checkpoint(_write(tmp_path / "c", src))
    with pytest.raises(CheckpointError, match=r"overflow torch\.float16"):
        load_params(Tiny().half(), ckpt, _identity)


# -- headers that lie ----------------------------------------------------------------------


def _raw(path: Path, header: bytes | dict, data: bytes = b"") -> Path:
    """A checkpoint whose ``model.safetensors`` is exactly ``header`` (JSON text, or a dict
    to dump) then ``data``: the 8-byte length, the header, the data section."""
    path.mkdir()
    (path / "config.json").write_text("{}")
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + data)
    return path


_LIES = [
    "bf16-as-f32",
    "overlap",
    "negative-offset",
    "gap",
    "trailing",
    "negative-dim",
    "unknown-dtype",
    "number",
    "null",
    "string",
    "entry-not-object",
    "deep-nesting",
]


def _f32(shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    ("header", "data", "why"),
    [
        (  # a bf16 tensor labelled F32: its 8 bytes would be read as half of 4 floats
            {"w": _f32([4], 0, 8), "b": _f32([2], 8, 16)},
            bytes(16),
            r"tensor 'w': F32\[4\] holds 16 bytes but its data_offsets \[0, 8\] span 8",
        ),
        (
            {"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)},
            bytes(12),
            r"tensor 'b' \(bytes \[4, 12\)\) overlaps 'a', which ends at 8",
        ),
        (
            {"a": _f32([2], -8, 0), "b": _f32([2], 0, 8)},
            bytes(8),
            r"tensor 'a': data_offsets \[-8, 0\] is not a byte range",
        ),
        (
            {"a": _f32([2], 0, 8), "b": _f32([2], 12, 20)},
            bytes(20),
            r"bytes \[8, 12\) after 'a' belong to no tensor",
        ),
        ({"a": _f32([2], 0, 8)}, bytes(12), r"the last 4 bytes of the data belong to no tensor"),
        ({"a": _f32([-2], 0, 8)}, bytes(8), r"tensor 'a': shape \[-2\] is not a list of non-"),
        (
            {"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}},
            bytes(8),
            r"tensor 'a': dtype 'F33' is not a safetensors dtype",
        ),
        (b"5", b"", r"the header is the number 5, not an object of tensors"),
        (b"null", b"", r"the header is null, not an object"),
        (b'"abc"', b"", r"the header is a string, not an object"),
        ({"a": 5}, b"", r"tensor 'a': its entry is the number 5, not an object"),
        (b"[" * 100_000 + b"]" * 100_000, b"", r"its header nests JSON too deeply"),
    ],
    ids=_LIES,
)
def test_a_header_that_lies_is_refused_naming_file_and_tensor(
    tmp_path: Path, header: bytes | dict, data: bytes, why: str
) -> None:
    """Every tensor's byte range must hold exactly its dtype x shape, inside the data
    section, and the ranges must tile it (no overlap, gap or trailing bytes, as the
    safetensors library requires); a header must be a JSON object of tensor entries."""
    path = _raw(tmp_path / "c", header, data)
    with pytest.raises(CheckpointError, match=why) as info:
        Checkpoint(path)
    assert str(path / "model.safetensors") in str(info.value)


def test_header_problems_are_listed_together_and_capped(tmp_path: Path) -> None:
    header = {f"t{i:02d}": _f32([2], 0, 4) for i in range(30)}  # each 8 bytes, spans 4
    with pytest.raises(CheckpointError) as info:
        Checkpoint(_raw(tmp_path / "c", header, bytes(4)))
    assert "30 problems in its header" in str(info.value)
    assert len(info.value.problems) == 21 and info.value.problems[-1] == "... and 10 more"


def test_a_valid_raw_header_with_metadata_and_empty_tensors_loads(tmp_path: Path) -> None:
    """The checks refuse nothing the format allows: ``__metadata__``, zero-size tensors
    (an empty byte range), tensors listed out of data order."""
    header = {
        "__metadata__": {"format": "pt"},
        "b": _f32([1], 8, 12),
        "empty": {"dtype": "I64", "shape": [0, 3], "data_offsets": [8, 8]},
        "a": _f32([2], 0, 8),
    }
    data = torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes()
    ckpt = Checkpoint(_raw(tmp_path / "c", header, data))
    assert torch.equal(ckpt.get("a"), torch.tensor([1.0, 2.0]))
    assert torch.equal(ckpt.get("b"), torch.tensor([3.0]))
    assert ckpt.get("empty").shape == (0, 3)


@contextlib.contextmanager
def _unblocked(fifo: Path) -> Iterator[None]:
    """While the block runs, a thread opens ``fifo`` for writing (without blocking) as soon
    as a reader has opened it, and closes it: a reader that opened the FIFO then reads
    end-of-file and fails, instead of waiting forever for a writer."""
    done = threading.Event()

    def unblock() -> None:
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: no reader has it open
                done.wait(0.01)

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_a_fifo_in_place_of_a_file_is_refused(tmp_path: Path, name: str) -> None:
    """A FIFO named like the weights (or the index) is refused before it is opened:
    opening it would block until some writer appeared."""
    path = tmp_path / "c"
    path.mkdir()
    (path / "config.json").write_text("{}")
    os.mkfifo(path / name)
    with _unblocked(path / name), pytest.raises(CheckpointError) as info:
        Checkpoint(path)
    assert f"{path / name} is not a regular file" in str(info.value)


def test_a_single_file_shard_linking_outside_is_refused(tmp_path: Path) -> None:
    """Without an index the ``*.safetensors`` files are the shards, and the index's rule
    holds for them: a symlink resolving outside the directory is refused before it is
    read; one staying inside loads."""
    outside = _write(tmp_path / "elsewhere", _tensors(1)) / "model.safetensors"
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(path)
    msg = str(info.value)
    assert f"{path} holds shards outside the checkpoint directory" in msg
    assert f"model.safetensors: the shard is a symlink resolving to {outside}" in msg

    inside = _write(tmp_path / "inside", _tensors(2))
    (inside / "model.safetensors").rename(inside / "real.data")
    (inside / "model.safetensors").symlink_to(inside / "real.data")
    assert torch.equal(Checkpoint(inside).get("ids"), _tensors(2)["ids"])


def test_json_files_that_nest_too_deeply_or_are_not_utf8_or_not_objects(tmp_path: Path) -> None:
    path = _write(tmp_path / "c", _tensors())
    (path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"config\.json nests JSON too deeply"):
        Checkpoint(path)
    (path / "config.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(CheckpointError, match=r"cannot read .*config\.json"):
        Checkpoint(path)
    for text, kind in (("5", "the number 5"), ("null", "null"), ('"abc"', "a string")):
        (path / "config.json").write_text(text)
        with pytest.raises(
            CheckpointError, match=f"config.json must hold a JSON object, found {kind}"
        ):
            Checkpoint(path)


# -- values a header cannot show: NaN / Inf codes of 8-bit floats -------------------------


class Fp8(nn.Module):
    """One stored 8-bit tensor per format, as resident quantized weights hold them."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("e4m3", "e5m2", "e8m0"):
            self.register_buffer(name, torch.zeros(4, dtype=torch.uint8).view(_FP8[name]))


_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e8m0": torch.float8_e8m0fnu}


@pytest.mark.parametrize("dtype", list(_FP8.values()))
def test_has_non_finite_agrees_with_torch_on_every_8bit_code(dtype: torch.dtype) -> None:
    """Each of the 256 codes is non-finite exactly when torch's conversion to fp32 says
    so (torch's own isfinite has no e4m3 kernel and calls every e8m0 code finite)."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    want = [not bool(torch.isfinite(c.float())) for c in codes]
    assert [has_non_finite(codes[i : i + 1]) for i in range(256)] == want
    assert any(want) and has_non_finite(codes) and not has_non_finite(codes[~torch.tensor(want)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_has_non_finite_finds_one_nan_or_inf_anywhere(dtype: torch.dtype) -> None:
    t = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert not has_non_finite(t) and not has_non_finite(t[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in ((0, 0), (1, 517), (2, 999)):
            poisoned = t.clone()
            poisoned[at] = bad
            assert has_non_finite(poisoned) and has_non_finite(poisoned[:, 1::2]) == (
                at[1] % 2 == 1
            )
    assert not has_non_finite(torch.arange(4))  # integers hold neither


@pytest.mark.parametrize(
    ("buffer", "code"),
    [("e4m3", 0x7F), ("e4m3", 0xFF), ("e5m2", 0x7C), ("e5m2", 0xFE), ("e8m0", 0xFF)],
)
def test_nan_or_inf_8bit_codes_are_refused(tmp_path: Path, buffer: str, code: int) -> None:
    """Stored 8-bit floats (resident FP8 weights, their ue8m0 scales) are checked by their
    codes as they load, and the error names the tensor and its file."""
    good = {n: torch.full((4,), 0x38, dtype=torch.uint8).view(dt) for n, dt in _FP8.items()}
    bad = good | {buffer: good[buffer].clone()}
    bad[buffer].view(torch.uint8)[2] = code
    load_params(Fp8(), Checkpoint(_write(tmp_path / "good", good)), _identity)
    with pytest.raises(
        CheckpointError, match=rf"'{buffer}' in .*model\.safetensors holds NaN or Inf codes"
    ):
        load_params(Fp8(), Checkpoint(_write(tmp_path / "bad", bad)), _identity)
