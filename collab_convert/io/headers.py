"""The safetensors format, as far as reading and writing need it: dtype names, tensor specs, and a header check
that refuses a file whose header lies before anything it claims is allocated or mapped."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInputError

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}  # a header's name -> torch dtype



@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()



# Bytes per element of every dtype a safetensors header may name.
ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8, "F8_E8M0": 1}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def check_safetensors_header(file: Path) -> tuple[int, dict]:
    """Refuse a safetensors file whose header lies, before anything it claims is allocated or mapped: a header
    longer than the file, not JSON, duplicate names, unknown dtypes, shapes that disagree with their byte ranges,
    ranges outside the data or overlapping."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _bad(file, "it is shorter than a safetensors header")
            length = int.from_bytes(prefix, "little")
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise _bad(file, f"its header claims {length:,} bytes, more than the file holds ({size:,})")
            raw = handle.read(length)
    except OSError as error:
        raise BadInputError(f"{file.name} could not be read: {error.strerror or error}") from None
    names: list[str] = []

    def pairs(items):
        names.extend(key for key, _ in items)
        return dict(items)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs)
    except (UnicodeDecodeError, ValueError):
        raise _bad(file, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad(file, "its header is not a JSON object")
    top = [name for name in names if name in header]
    if len(top) != len(set(top)):
        raise _bad(file, "its header names a tensor twice")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    _check_ranges(file, entries, size - 8 - length)
    return 8 + length, entries


def _check_ranges(file: Path, entries: dict, data_bytes: int) -> None:
    ranges = []
    for name, entry in entries.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in ITEM_SIZES:
            raise _bad(file, f"tensor {name!r} has no known dtype")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise _bad(file, f"tensor {name!r} has an invalid shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise _bad(file, f"tensor {name!r} lies outside the file's data ({offsets!r}, {data_bytes:,} bytes)")
        count = 1
        for dimension in shape:
            count *= dimension
        if count * ITEM_SIZES[entry["dtype"]] != offsets[1] - offsets[0]:
            raise _bad(file, f"tensor {name!r}: shape {shape} in {entry['dtype']} disagrees with its "
                             f"{offsets[1] - offsets[0]:,} bytes")
        ranges.append((offsets[0], offsets[1], name))
    ranges.sort()
    for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
        if start < end:
            raise _bad(file, f"tensors {first!r} and {second!r} overlap")


def _bad(file: Path, why: str) -> BadInputError:
    return BadInputError(f"{file.name} is not a valid safetensors file: {why}")
