"""Checkpoint loading shared by every model: safetensors only, never pickle.

A checkpoint is a local directory holding ``config.json`` plus either one or more
``*.safetensors`` files or a sharded set described by ``*.safetensors.index.json``
(the index's ``weight_map`` is then the only source of truth; every shard it names must
be a file inside the directory: ``..``, absolute paths and symlinks resolving elsewhere
are refused, except a Hugging Face cache snapshot's links into its own ``blobs``; without an
index, the same holds for each ``*.safetensors`` file). Tensor names, shapes
and dtypes come from the safetensors *headers* (an 8-byte length + a JSON blob at
the start of each file), so a whole checkpoint can be validated before a single
tensor is read or a single parameter is allocated. Each header is verified as it is
parsed: every tensor's byte range holds exactly its dtype x shape, and the ranges tile
the data section (no overlap, gap or trailing bytes), as the safetensors library requires.

``load_params`` is the generic two-phase loader:

1. *plan* from headers: every parameter / persistent buffer of the module must be
   produced by exactly one checkpoint tensor (through ``rename``); every problem
   (missing, unexpected, duplicate, misshapen, int-into-float) is collected and
   raised as one :class:`~xspec.errors.CheckpointError`;
2. *stream*: tensors are read one at a time (shard by shard) and copied in place
   into the existing parameters, so peak host memory stays near the resident model
   plus one tensor, never a second full copy; each is refused if it holds NaN / Inf
   (8-bit floats by their codes) or fails the caller's value check (an index table).

``write_checkpoint`` and ``preset_dir`` write directories atomically (temp dir next
to the target, then ``os.rename``) so an interrupted or failing writer never leaves a
half-written checkpoint that a later run would trust.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from xspec.cache import cache_root
from xspec.errors import CheckpointError
from xspec.models.safetensors_header import TensorEntry, json_kind, read_header, refetch_hint
from xspec.paths import escapes

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"  # the name write_checkpoint uses

# safetensors header dtype codes -> torch dtype names (only those this torch build has are
# kept: float8_e8m0fnu, the ue8m0 block-scale type, needs torch >= 2.7).
_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name) for code, name in _DTYPE_NAMES.items() if hasattr(torch, name)
}
_FLOAT_CODES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}


def _read_json(file: Path) -> dict:
    if not file.is_file():  # reading a FIFO would wait forever for a writer
        raise CheckpointError(
            f"{file} is not a regular file (a FIFO, socket, device or directory); replace it "
            "with the real JSON file"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {file}: {e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{file} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
            "re-download or fix the file"
        ) from e
    except RecursionError:  # json nests one Python frame per level
        raise CheckpointError(
            f"{file} nests JSON too deeply; re-download or fix the file"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, found {json_kind(data)}")
    return data


def _outside(root: Path, shard: str) -> str | None:
    """Why ``shard`` (a path relative to the checkpoint directory ``root``) is not a file
    inside it, or None: an absolute path, ``..``, or a symlink resolving outside the
    directory (:func:`xspec.paths.escapes`: a hub snapshot's blobs are inside)."""
    rel = Path(shard)
    if rel.is_absolute():
        return "the shard path is absolute"
    if ".." in rel.parts or not rel.parts:
        return "the shard path is not a file inside the directory"
    if (target := escapes(root, rel)) is not None:
        return f"the shard is a symlink resolving to {target}"
    return None


def _refuse_outside(source: str, root: Path, problems: list[str]) -> None:
    """One error for every shard :func:`_outside` refused (``source``: "<index> names")."""
    if problems:
        raise CheckpointError(
            f"{source} shards outside the checkpoint directory {root}; every shard must be a "
            "file inside it (refused before reading any shard)",
            problems=problems,
        )


class Checkpoint:
    """A local directory with config.json and safetensors (single file or sharded with
    ``*.safetensors.index.json``). Never pickle."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            what = "is not a directory" if self.path.exists() else "does not exist"
            raise CheckpointError(
                f"checkpoint directory {self.path} {what}; pass the directory holding "
                "config.json and *.safetensors"
            )
        if not os.access(self.path, os.R_OK | os.X_OK):
            raise CheckpointError(f"checkpoint directory {self.path} is not readable")
        config_file = self.path / CONFIG_NAME
        if not config_file.is_file():
            raise CheckpointError(
                f"{self.path} has no {CONFIG_NAME}; a checkpoint directory needs the model's "
                "config.json next to its *.safetensors files"
            )
        self.config: dict = _read_json(config_file)
        self._file_of: dict[str, Path] = {}
        self._headers: dict[Path, dict[str, TensorEntry]] = {}
        self._data_start: dict[Path, int] = {}  # byte where each shard's tensor data begins
        self._index_files()

    def _index_files(self) -> None:
        """Fill ``name -> shard`` and read every shard header (no tensor data)."""
        indexes = sorted(self.path.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise CheckpointError(
                f"{self.path} has several safetensors indexes "
                f"({', '.join(p.name for p in indexes)}); keep exactly one"
            )
        if indexes:
            self._from_index(indexes[0])
            return
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickles = sorted(
                p.name for p in self.path.iterdir() if p.suffix in {".bin", ".pt", ".pth"}
            )
            hint = (
                f" (found {', '.join(pickles)}: pickle files are never loaded; convert them to safetensors)"
                if pickles
                else ""
            )
            raise CheckpointError(f"{self.path} has no *.safetensors files{hint}")
        root = self.path.resolve()
        problems = [f"{f.name}: {why}" for f in files if (why := _outside(root, f.name))]
        _refuse_outside(f"{self.path} holds", root, problems)
        for file in files:
            header = self._header(file)
            for name in header:
                if name in self._file_of:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {self._file_of[name].name} and "
                        f"{file.name} in {self.path}; remove the stale file"
                    )
                self._file_of[name] = file

    def _from_index(self, index_file: Path) -> None:
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_file} has no 'weight_map' object naming the shards")
        self._check_shard_paths(index_file, weight_map)  # before any file outside is touched
        problems = []
        # one Path and one header per shard: a real index names ~10^5 tensors in ~50 shards
        files = {shard: self.path / shard for shard in sorted(set(weight_map.values()))}
        headers: dict[str, dict] = {}
        for shard, file in files.items():
            if not file.is_file():
                names = [n for n, s in weight_map.items() if s == shard]
                problems.append(f"shard {shard} (holding e.g. {names[0]!r}) is missing")
                continue
            headers[shard] = self._header(file)
        for name, shard in weight_map.items():
            if shard in headers and name not in headers[shard]:
                problems.append(
                    f"{index_file.name} puts {name!r} in {shard}, but that shard lacks it"
                )
            self._file_of[name] = files[shard]
        if problems:
            raise CheckpointError(
                f"checkpoint {self.path} does not match its index {index_file.name}; "
                "re-download the missing shards",
                problems=problems,
            )

    def _check_shard_paths(self, index_file: Path, weight_map: dict) -> None:
        """Every shard entry must name a file inside the directory (:func:`_outside`: a
        crafted index must not make xspec read, or probe, files the checkpoint does not
        hold). One error lists every bad entry."""
        root = self.path.resolve()
        problems: list[str] = []
        seen: set[str] = set()
        for name, shard in weight_map.items():
            if isinstance(shard, str) and shard in seen:
                continue  # one line per shard: the first tensor that names it
            entry = f"{json.dumps(name)}: {json.dumps(shard)}"  # the index line
            if not isinstance(shard, str):
                problems.append(f"{entry}: a shard entry must be a file name")
                continue
            seen.add(shard)
            if why := _outside(root, shard):
                problems.append(f"{entry}: {why}")
        _refuse_outside(f"{index_file} names", root, problems)

    def _header(self, file: Path) -> dict[str, TensorEntry]:
        """Read and verify ``file``'s header (:func:`_read_header`); remember it."""
        self._headers[file], self._data_start[file] = read_header(file)
        return self._headers[file]

    def read_json(self, name: str) -> dict | None:
        """Another JSON file of the directory (e.g. quant_model_description.json)."""
        file = self.path / name
        return _read_json(file) if file.exists() else None

    def names(self) -> list[str]:
        """All tensor names, from the headers only."""
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> Path:
        """The shard holding ``name``."""
        try:
            return self._file_of[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in checkpoint {self.path}") from None

    def meta(self, name: str) -> tuple[list[int], str]:
        """(shape, safetensors dtype code such as "F32", "BF16", "I8") without reading data."""
        shape, code, _, _ = self._headers[self.file_of(name)][name]
        return list(shape), code

    def nbytes(self, name: str) -> int:
        """Bytes ``name`` occupies in its shard (the header's data offsets; no data read)."""
        _, _, start, end = self._headers[self.file_of(name)][name]
        return end - start

    def iter_tensors(
        self, names: Iterable[str] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` one at a time, shard by shard, in on-disk order."""
        wanted = self.names() if names is None else list(names)
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.file_of(name), []).append(name)
        for file in sorted(by_file):
            header = self._headers[file]
            ordered = sorted(by_file[file], key=lambda n: header[n][2])  # sequential reads
            for name in ordered:
                yield name, self._read(file, name)

    def get(self, name: str) -> torch.Tensor:
        """One tensor (e.g. a ``*.weight_scale`` sibling needed by a convert hook)."""
        return self._read(self.file_of(name), name)

    def _read(self, file: Path, name: str) -> torch.Tensor:
        """One tensor, read with plain file reads into fresh memory: the one copy that
        becomes (or is converted into) the parameter. No memory map: a mapped shard's
        touched pages would count as this process's resident memory until it is closed,
        so loading a large shard would hold a second copy of it."""
        shape, code, offset, _ = self._headers[file][name]
        dtype = SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            raise CheckpointError(
                f"tensor {name!r} in {file} has dtype {code}, which this torch build cannot "
                f"hold; supported: {sorted(SAFETENSORS_DTYPES)}"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        raw = torch.empty(nbytes, dtype=torch.uint8)
        try:
            with open(file, "rb") as f:
                f.seek(self._data_start[file] + offset)
                got = f.readinto(raw.numpy().data) if nbytes else 0
        except OSError as e:
            raise CheckpointError(
                f"cannot read tensor {name!r} from {file} ({e}); {refetch_hint(file)}"
            ) from e
        if got != nbytes:
            raise CheckpointError(
                f"cannot read tensor {name!r} from {file}: {got} of its {nbytes} bytes are "
                f"there; {refetch_hint(file)}"
            )
        return raw.view(dtype).reshape(shape)


# safetensors dtype codes -> the format names the memory plan reports
FORMAT_NAMES = {
    "F64": "fp64",
    "F32": "fp32",
    "F16": "fp16",
    "BF16": "bf16",
    "F8_E4M3": "fp8",
    "F8_E5M2": "fp8",
    "F8_E8M0": "ue8m0",
    "I64": "int",
    "I32": "int",
    "I16": "int",
    "I8": "int",
    "U8": "int",
    "BOOL": "int",
}
_FLOAT_WIDTHS = {2: "bf16", 4: "fp32", 8: "fp64"}


def held_bytes(ckpt: Checkpoint, name: str, itemsize: int) -> tuple[str, int]:
    """(format, bytes) an unquantised tensor holds once loaded, from its header: a float
    tensor is cast to the model dtype (``itemsize`` bytes per element), so it holds at
    least that many per element (a wider stored tensor is counted at its own width: the
    fp32 parameters a model keeps); an integer tensor (an index table) as stored."""
    shape, code = ckpt.meta(name)
    stored = ckpt.nbytes(name)
    if _kind(code) != "float" or code.startswith("F8"):
        return FORMAT_NAMES.get(code, code.lower()), stored
    numel = math.prod(shape)
    width = max(itemsize, stored // max(numel, 1))
    if width * numel == stored:
        return FORMAT_NAMES[code], stored
    return _FLOAT_WIDTHS.get(width, f"{8 * width}-bit float"), width * numel


def require_config_keys(config: dict, keys: Iterable[str], where: Path) -> None:
    """Raise one CheckpointError listing every key of ``keys`` absent from ``config``."""
    missing = [k for k in keys if k not in config]
    if missing:
        file = where / CONFIG_NAME if where.is_dir() else where
        raise CheckpointError(
            f"{file} lacks required keys {missing}; add them (see the model's reference config)",
            problems=[f"missing key {k!r}" for k in missing],
        )


def require_tensors_for(ckpt: Checkpoint, counts: dict[str, int]) -> None:
    """Refuse config.json counts (``{key: value}``: layers, experts) above the number of
    tensors the checkpoint holds: each layer and each expert stores tensors of its own,
    so such a count is wrong, and planning its tensors would loop that many times."""
    total = len(ckpt.names())
    bad = [k for k, n in counts.items() if n > total]
    if bad:
        raise CheckpointError(
            f"{ckpt.path / CONFIG_NAME}: {', '.join(f'{k} = {counts[k]}' for k in bad)}, but "
            f"the checkpoint holds {total} tensors in all, and each of those needs tensors "
            f"of its own; fix {' and '.join(bad)}"
        )


def _kind(dtype_code_or_dtype: str | torch.dtype) -> str:
    """'float', 'int' or 'bool': copy_ across kinds would silently reinterpret data."""
    if isinstance(dtype_code_or_dtype, str):
        code = dtype_code_or_dtype
        return "float" if code in _FLOAT_CODES else ("bool" if code == "BOOL" else "int")
    dt = dtype_code_or_dtype
    return "float" if dt.is_floating_point else ("bool" if dt == torch.bool else "int")


def _plan(
    targets: dict[str, torch.Tensor],
    ckpt: Checkpoint,
    rename: Callable[[str], str | None],
    check_kind: bool,
    logical_shape: Callable[[str, list[int]], list[int]] | None = None,
) -> dict[str, str]:
    """Checkpoint name -> state_dict key for every tensor to load; all problems in one error.
    ``logical_shape(name, stored shape)``: the shape a packed tensor converts to."""
    plan: dict[str, str] = {}
    source_of: dict[str, str] = {}
    problems: list[str] = []
    for name in ckpt.names():
        key = rename(name)
        if key is None:
            continue
        shape, code = ckpt.meta(name)
        where = f"tensor {name!r} in {ckpt.file_of(name).name}"
        if key not in targets:
            problems.append(f"unexpected {where}: maps to {key!r}, which the model does not have")
            continue
        if key in source_of:
            problems.append(f"{where} and {source_of[key]!r} both provide {key!r}")
            continue
        source_of[key] = name
        want = list(targets[key].shape)
        if logical_shape is not None:
            shape = logical_shape(name, shape)
        if shape != want:
            problems.append(f"{where} has shape {shape}, expected {want} for {key!r}")
        elif check_kind and _kind(code) != _kind(targets[key].dtype):
            problems.append(
                f"{where} is {code} but {key!r} is {targets[key].dtype}; a quantised checkpoint "
                "needs its dequantising loader"
            )
        plan[name] = key
    for key, t in targets.items():
        if key not in source_of:
            problems.append(f"missing: no tensor provides {key!r} (shape {list(t.shape)})")
    if problems:
        raise CheckpointError(
            f"checkpoint {ckpt.path} does not match the model ({len(problems)} problem(s))",
            problems=problems,
        )
    return plan


def check_params(
    module: torch.nn.Module, ckpt: Checkpoint, rename: Callable[[str], str | None]
) -> None:
    """The plan phase of :func:`load_params` alone (headers only; ``module`` may live on
    the meta device): one CheckpointError listing every missing, unexpected, duplicate,
    misshapen or int-into-float tensor."""
    _plan(module.state_dict(keep_vars=True), ckpt, rename, check_kind=True)


def load_params(
    module: torch.nn.Module,
    ckpt: Checkpoint,
    rename: Callable[[str], str | None],
    *,
    convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    logical_shape: Callable[[str, list[int]], list[int]] | None = None,
    check: Callable[[str, torch.Tensor], str | None] | None = None,
) -> None:
    """Fill every parameter / persistent buffer of ``module`` in place from ``ckpt``.

    ``rename(ckpt_name)`` gives the state_dict key, or None to skip the tensor.
    ``convert(ckpt_name, tensor)`` may transform a tensor before the copy (e.g.
    dequantise with a sibling ``*.weight_scale`` read through ``ckpt.get``); it must
    return the parameter's shape; ``logical_shape(ckpt_name, stored shape)`` gives that
    shape from the header when ``convert`` unpacks (e.g. MXFP4 ``[N, K/2]`` -> ``[N, K]``).
    ``check(ckpt_name, tensor)`` sees each tensor as stored, before ``convert``, and says
    what is wrong with its values (an index out of range), or None.
    Dtype conversion happens in ``copy_``. Every float tensor is refused if it holds NaN
    or Inf once loaded (8-bit floats by their stored codes).
    """
    targets = module.state_dict(keep_vars=True)  # references to the live tensors, no copies
    plan = _plan(targets, ckpt, rename, check_kind=convert is None, logical_shape=logical_shape)
    with torch.no_grad():
        for name, tensor in ckpt.iter_tensors(plan):
            key = plan[name]
            if check is not None and (problem := check(name, tensor)):
                raise CheckpointError(f"tensor {name!r} in {ckpt.file_of(name)} {problem}")
            if convert is not None:
                tensor = convert(name, tensor)
            target = targets[key]
            if list(tensor.shape) != list(target.shape) or _kind(tensor.dtype) != _kind(
                target.dtype
            ):
                raise CheckpointError(
                    f"tensor {name!r} in {ckpt.file_of(name)} converts to "
                    f"{tensor.dtype}{list(tensor.shape)}, but {key!r} is "
                    f"{target.dtype}{list(target.shape)}"
                )
            target.copy_(tensor)
            del tensor  # drop it before the next read: at most one tensor alive
            if has_non_finite(target):
                raise CheckpointError(f"tensor {name!r} in {ckpt.file_of(name)} {_why(target)}")


# The NaN / Inf codes of each 8-bit float: those whose bits under the mask equal the mask
# (e4m3fn: NaN is S.1111.111; e5m2: Inf and NaN fill the exponent; e8m0fnu: NaN is 0xFF),
# i.e. where ``code & mask`` reaches its largest value, the mask.
_NON_FINITE_MASKS = {
    getattr(torch, name): mask
    for name, mask in (("float8_e4m3fn", 0x7F), ("float8_e5m2", 0x7C), ("float8_e8m0fnu", 0xFF))
    if hasattr(torch, name)
}


def has_non_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds a NaN or Inf (False for integer tensors). 8-bit floats are read
    by their codes: torch has no ``isfinite`` for e4m3 and calls every e8m0 code finite."""
    if not t.is_floating_point() or t.numel() == 0:
        return False
    mask = _NON_FINITE_MASKS.get(t.dtype)
    if mask is None:  # min and max propagate NaN, and hold any Inf: one reduction, no copy
        return not all(math.isfinite(v) for v in torch.aminmax(t))
    codes = t.view(torch.uint8)
    return int((codes if mask == 0xFF else codes & mask).max()) == mask


def _why(target: torch.Tensor) -> str:
    """Why a loaded tensor holds NaN / Inf: a stored 8-bit code is corruption; a wider
    value may also have overflowed the model dtype."""
    if target.dtype in _NON_FINITE_MASKS:
        return (
            f"holds NaN or Inf codes ({target.dtype} as stored); the file is corrupt: "
            "re-download or re-convert it"
        )
    return (
        f"holds NaN or Inf values once loaded as {target.dtype}; the file is corrupt, or its "
        f"values overflow {target.dtype} (try model.dtype=float32)"
    )


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a fresh temp dir next to ``path``; on success rename it to ``path``.

    ``path`` must not exist or be an empty directory. On any exception the temp dir
    is removed and ``path`` is left untouched.
    """
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(
            f"{path} already exists and is not empty; remove it or pick another path"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if path.is_dir():
            path.rmdir()  # an empty placeholder (e.g. a test's tmp dir)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    """Greedy split in insertion order; a tensor larger than max_bytes gets its own shard."""
    if max_bytes is None:
        return [list(tensors)]
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(
    path: Path,
    tensors: dict[str, torch.Tensor],
    config: dict,
    *,
    max_shard_bytes: int | None = None,
    extra_json: dict[str, dict] | None = None,
) -> None:
    """Write config.json + safetensors (sharded with an index when max_shard_bytes is set).

    ``extra_json`` maps file names (e.g. "quant_model_description.json") to contents.
    Atomic: nothing appears at ``path`` unless everything was written.
    """
    from safetensors.torch import save_file

    with atomic_dir(Path(path)) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name, content in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        groups = _shards(tensors, max_shard_bytes)
        if max_shard_bytes is None:
            files = ["model.safetensors"]
        else:
            files = [
                f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))
            ]
        weight_map: dict[str, str] = {}
        for file, names in zip(files, groups):
            part = {n: tensors[n].detach().to("cpu").contiguous() for n in names}
            save_file(part, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
        if max_shard_bytes is not None:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def preset_dir(name: str, version: str, generate: Callable[[Path], None]) -> Path:
    """Directory of a built-in preset checkpoint, generated on first use.

    ``generate(dst)`` must create the checkpoint directory ``dst`` (e.g. with
    write_checkpoint). It runs against a private temp path that is renamed into
    place, so concurrent first uses are safe: the loser discards its copy and reuses
    the winner's; a failing generate leaves nothing behind.
    """
    final = cache_root() / "presets" / f"{name}-{version}"
    if (final / CONFIG_NAME).is_file():
        return final
    tmp = final.parent / f".{final.name}.gen-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            generate(tmp)
        except OSError as e:  # a file in the way, no permission, disk full
            raise CheckpointError(
                f"cannot write preset {name!r} under the cache directory {cache_root()} ({e}); "
                "set XSPEC_CACHE_DIR to a writable directory (default ~/.cache/xspec)"
            ) from e
        if not (tmp / CONFIG_NAME).is_file():
            raise CheckpointError(
                f"preset generator for {name!r} wrote no {CONFIG_NAME} into {tmp}"
            )
        try:
            os.rename(tmp, final)
        except OSError as e:
            if not (final / CONFIG_NAME).is_file():  # not a lost race: a real failure
                raise CheckpointError(
                    f"cannot install preset {name!r} at {final} ({e}); if that directory is "
                    "left over from an interrupted run, delete it"
                ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return final
