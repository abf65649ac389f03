"""Reading and verifying a safetensors header (torch-free).

A safetensors file is an 8-byte little-endian header length, a JSON object
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` and
the data section the offsets index. :func:`read_header` parses one and verifies what the
safetensors library verifies before xspec reads any tensor with its own plain file reads:
every entry is well formed, each byte range holds exactly its dtype x shape, and the
ranges tile the data section (no overlap, no gap, nothing after the last). A header that
lies would otherwise make a read return another tensor's bytes, or bytes of no tensor.
"""

from __future__ import annotations

import functools
import json
import math
import stat
import struct
from pathlib import Path
from typing import Any, TypeGuard

from xspec.cache import cache_root
from xspec.errors import CheckpointError

# bits per element of every dtype the safetensors format defines (this torch build may
# hold fewer), so that each tensor's byte range is checked against its dtype x shape
_DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
TensorEntry = tuple[list[int], str, int, int]  # shape, dtype code, data start, data end


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words ("an array", "null")."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return kinds.get(type(value), f"the number {value!r}")  # int or float: all that is left


def read_header(file: Path) -> tuple[dict[str, TensorEntry], int]:
    """Parse and verify one safetensors header: ``({name: (shape, dtype code, data start,
    data end)}, where the data section starts)`` (shared, read-only: parsed once per
    version of the file, see :func:`parse_header`)."""
    try:
        st = file.stat()
    except OSError as e:
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({e}); {refetch_hint(file)}"
        ) from e
    if not stat.S_ISREG(st.st_mode):  # opening a FIFO would wait forever for a writer
        raise CheckpointError(
            f"{file} is not a regular file (a FIFO, socket, device or directory); a shard "
            "must be a plain safetensors file: replace it with the real one"
        )
    return parse_header(file, st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=256)
def parse_header(
    file: Path, size: int, mtime_ns: int, inode: int
) -> tuple[dict[str, TensorEntry], int]:
    """:func:`read_header` of one version of ``file`` (size, mtime and inode are the
    cache key): the target, its drafters and the memory plan each open the checkpoint,
    and a real one's headers describe ~10^5 tensors."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:  # real headers are a few MB; a huge n means garbage
                raise ValueError(f"header length {n} is implausible")
            if 8 + n > size:
                raise _truncated(file, 8 + n, size)
            header = json.loads(f.read(n))
    except RecursionError:  # json nests one Python frame per level
        raise CheckpointError(
            f"{file} is not a readable safetensors file (its header nests JSON too deeply); "
            f"{refetch_hint(file)}"
        ) from None
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({e}); {refetch_hint(file)}"
        ) from e
    tensors, problems = _header_entries(header)
    if not problems:
        end = max((e for _, _, _, e in tensors.values()), default=0)
        if 8 + n + end > size:  # a truncated download or an interrupted copy
            raise _truncated(file, 8 + n + end, size)
        problems = _layout_problems(tensors, size - 8 - n)
    if len(problems) == 1:
        raise CheckpointError(
            f"{file} is not a valid safetensors file: {problems[0]}; {refetch_hint(file)}"
        )
    if problems:
        raise CheckpointError(
            f"{file} is not a valid safetensors file ({len(problems)} problems in its "
            f"header); {refetch_hint(file)}",
            problems=_first(problems),
        )
    return tensors, 8 + n


def _truncated(file: Path, described: int, size: int) -> CheckpointError:
    return CheckpointError(
        f"{file} is truncated: its header describes {described} bytes but the file has "
        f"{size}; {refetch_hint(file)}"
    )


def _header_entries(header: Any) -> tuple[dict[str, TensorEntry], list[str]]:
    """The header's tensor entries, and every entry that is not a well-formed one whose
    byte range holds exactly its dtype x shape."""
    if not isinstance(header, dict):
        return {}, [f"the header is {json_kind(header)}, not an object of tensors"]
    problems: list[str] = []
    if not isinstance(header.get("__metadata__", {}), dict):
        problems.append("__metadata__ is not an object")
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _entry(info)
        if isinstance(entry, str):
            problems.append(f"tensor {name!r}: {entry}")
        else:
            tensors[name] = entry
    return tensors, problems


def _entry(info: Any) -> TensorEntry | str:
    """One header entry as ``(shape, dtype code, begin, end)``, or why it is invalid."""
    if type(info) is not dict:
        return f"its entry is {json_kind(info)}, not an object"
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(code) is not str or code not in _DTYPE_BITS:
        return f"dtype {code!r} is not a safetensors dtype ({', '.join(_DTYPE_BITS)})"
    if not _sizes(shape):
        return f"shape {shape!r} is not a list of non-negative integers"
    if not (_sizes(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        return f"data_offsets {offsets!r} is not a byte range [begin, end] with 0 <= begin <= end"
    begin, end = offsets
    nbits = math.prod(shape) * _DTYPE_BITS[code]
    if nbits % 8 or end - begin != nbits // 8:
        return (
            f"{code}{shape} holds {nbits / 8:g} bytes but its data_offsets [{begin}, {end}] "
            f"span {end - begin}"
        )
    return shape, code, begin, end


def _sizes(value: Any) -> TypeGuard[list[int]]:
    """A list of integers >= 0 (booleans are not integers here)."""
    return type(value) is list and all(type(v) is int and v >= 0 for v in value)


def _layout_problems(tensors: dict[str, TensorEntry], data_bytes: int) -> list[str]:
    """The byte ranges must tile the data section as the safetensors library requires:
    no overlap (two tensors reading the same bytes), no gap and no trailing bytes (bytes
    no tensor owns, where another file format could hide)."""
    at = 0
    for begin, end in sorted((b, e) for _, _, b, e in tensors.values()):
        if begin != at:
            break
        at = end
    else:
        if at == data_bytes:
            return []  # the common case, without building names for messages
    problems: list[str] = []
    at, last = 0, None  # the end of the data covered so far, and the tensor that ends there
    for begin, end, name in sorted((b, e, n) for n, (_, _, b, e) in tensors.items()):
        if begin < at:
            problems.append(
                f"tensor {name!r} (bytes [{begin}, {end})) overlaps {last!r}, which ends at {at}"
            )
        elif begin > at:
            where = f"after {last!r}" if last is not None else "at the start of the data"
            problems.append(f"bytes [{at}, {begin}) {where} belong to no tensor")
        if end >= at:
            at, last = end, name
    if at < data_bytes:
        problems.append(f"the last {data_bytes - at} bytes of the data belong to no tensor")
    return problems


def _first(problems: list[str], limit: int = 20) -> list[str]:
    """At most ``limit`` problems, then how many more (a damaged header may list 10^5)."""
    if len(problems) <= limit:
        return problems
    return [*problems[:limit], f"... and {len(problems) - limit} more"]


def refetch_hint(file: Path) -> str:
    """How to replace a damaged file: regenerate a cached preset, re-download a checkpoint."""
    presets = cache_root() / "presets"
    try:
        rel = file.resolve().relative_to(presets.resolve())
    except (OSError, ValueError):
        return "re-download or re-copy the shard"
    preset = presets / rel.parts[0]
    return f"it belongs to a cached preset: delete {preset} and the next run regenerates it"
