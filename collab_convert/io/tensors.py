"""Tensors on disk: reading them lazily, writing them as streamed safetensors shards. Knows nothing of the math.

Reading never unpickles: safetensors are memory-mapped one shard at a time, and a legacy pytorch_model.bin
is opened only with torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInputError

class TensorReader:
    """Name -> tensor, loaded on demand. Safetensors shards are opened lazily and memory-mapped.

    `rename` maps the file's keys to the names callers use (the loaded model's naming, see naming.py).
    Thread-safe: layers are fitted ahead of the writer in worker threads (stages.stream_weights).
    """

    def __init__(self, folder: Path, rename=None):
        self.folder = folder
        self._lock = threading.RLock()
        self._location: dict[str, Path] = {}
        self._key: dict[str, str] = {}  # name -> key in the file
        self._open: dict[Path, Any] = {}
        self._bin_cache: dict[Path, dict[str, torch.Tensor]] = {}
        self._layout: dict[Path, tuple[int, dict]] = {}  # safetensors: where the data starts, and each entry
        files = self._weight_files(folder)
        for file in files:
            for key in self._names_in(file):
                name = rename(key) if rename else key
                if name in self._location:
                    raise BadInputError(f"tensor {name} appears twice in the checkpoint")
                self._location[name] = file
                self._key[name] = key

    @staticmethod
    def _weight_files(folder: Path) -> list[Path]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = folder / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                except (OSError, ValueError, KeyError, TypeError) as error:
                    raise BadInputError(f"{index} is not a valid weight index: {error}") from None
                if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                    raise BadInputError(f"{index} is not a valid weight index: its weight_map is not names -> files")
                files = sorted({_inside(folder, f, index) for f in weight_map.values()})
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise BadInputError(f"{index} names shards that are missing: {', '.join(missing[:3])}")
                return files
        single = folder / "model.safetensors"
        if single.is_file():
            return [_inside(folder, single.name, single)]
        legacy = folder / "pytorch_model.bin"
        if legacy.is_file():
            return [legacy]
        raise BadInputError(f"{folder} has no model.safetensors or pytorch_model.bin")

    def _names_in(self, file: Path) -> list[str]:
        if file.suffix == ".safetensors":
            return list(self._handle(file).keys())
        return list(self._load_bin(file).keys())

    def _handle(self, file: Path):
        with self._lock:
            return self._handle_unlocked(file)

    def _handle_unlocked(self, file: Path):
        if file not in self._open:
            from safetensors import safe_open

            self._layout[file] = check_safetensors_header(file)

            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except Exception as error:  # noqa: BLE001 - safetensors raises several types for bad files
                raise BadInputError(f"{file.name} is not a readable safetensors file: {error}") from None
        return self._open[file]

    def _load_bin(self, file: Path) -> dict[str, torch.Tensor]:
        with self._lock:
            return self._load_bin_unlocked(file)

    def _load_bin_unlocked(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._bin_cache:
            try:
                # weights_only: a pickle can run code; this refuses anything but tensors and plain containers.
                try:
                    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as error:
                    if "mmap" not in str(error):
                        raise
                    # pre-zipfile checkpoints (torch < 1.6) cannot be memory-mapped; still weights_only
                    state = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as error:  # noqa: BLE001
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise BadInputError(f"{file.name} could not be loaded safely as weights: {first}") from None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise BadInputError(f"{file.name} does not hold a flat dictionary of tensors")
            self._bin_cache[file] = state
        return self._bin_cache[file]

    def names(self) -> list[str]:
        return list(self._location)

    def __contains__(self, name: str) -> bool:
        return name in self._location

    def get(self, name: str) -> torch.Tensor:
        file, key = self._location[name], self._key[name]
        try:
            if file.suffix == ".safetensors":
                return self._handle(file).get_tensor(key)
            return self._load_bin(file)[key]
        except BadInputError:
            raise
        except Exception as error:  # noqa: BLE001 - truncated files fail here, not at open
            raise BadInputError(f"tensor {name} in {file.name} could not be read: {error}") from None

    def byte_range(self, name: str) -> tuple[Path, int, int] | None:
        """(file, start, end) of a tensor's bytes in a safetensors file, for copying it through unchanged
        without loading it; None for pickled checkpoints."""
        file, key = self._location[name], self._key[name]
        if file.suffix != ".safetensors":
            return None
        self._handle(file)
        data_start, entries = self._layout[file]
        start, end = entries[key]["data_offsets"]
        return file, data_start + start, data_start + end

    def spec(self, name: str) -> TensorSpec:
        """dtype and shape, read from the safetensors header without loading the tensor."""
        file, key = self._location[name], self._key[name]
        if file.suffix == ".safetensors":
            view = self._handle(file).get_slice(key)
            dtype = {v: k for k, v in SAFETENSORS_DTYPES.items()}[view.get_dtype()]
            return TensorSpec(name, dtype, tuple(view.get_shape()))
        tensor = self._load_bin(file)[key]
        return TensorSpec(name, tensor.dtype, tuple(tensor.shape))

    def release_all_but(self, name: str) -> None:
        """Unmap every safetensors shard except the one holding `name`: reading shard by shard, the pages
        of finished shards leave the process instead of piling up in its resident memory."""
        keep = self._location.get(name)
        with self._lock:
            for file in [f for f in self._open if f != keep]:
                del self._open[file]

    def close(self) -> None:
        with self._lock:
            self._open.clear()
            self._bin_cache.clear()


def _inside(folder: Path, name: str, named_by: Path) -> Path:
    """A weight file named by an index (or the single shard), refused if it lies outside the model folder:
    an absolute path, `../`, or a symlink that escapes."""
    path = folder / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise BadInputError(f"{named_by.name} names a weight file outside the model folder: {name}")
    # The Hugging Face cache keeps files as links from snapshots/<revision>/ into the repository's blobs/.
    allowed = [folder.resolve()]
    if folder.parent.name == "snapshots":
        allowed.append(folder.parent.parent.resolve() / "blobs")
    if path.exists() and not any(root in path.resolve().parents for root in allowed):
        raise BadInputError(f"{path.name} is a link that leads outside the model folder ({path.resolve()})")
    return path


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


def parse_size(text: str | int) -> int:
    """'500MB', '2GB', '1GiB' or a byte count."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise BadInputError(f"cannot read '{text}' as a size; write it like 500MB or 2GB")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.upper()]
    return int(float(number) * base**power)


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


def _copy_in_kernel(source: int, target: int, start: int, count: int) -> int:
    """Copy `count` bytes from `source` at `start` to `target` at its position with copy_file_range (Linux): the
    bytes never pass through this process, and file systems that can share extents do not copy them at all.
    Returns the bytes copied; the caller copies the rest itself (0 where the kernel cannot do it)."""
    if not hasattr(os, "copy_file_range"):
        return 0
    copied = 0
    try:
        while copied < count:
            done = os.copy_file_range(source, target, count - copied, start + copied)
            if done == 0:  # the source ended early: the caller's own loop reports it
                break
            copied += done
    except OSError:  # another file system (EXDEV on old kernels), or none that supports it
        return copied
    return copied


class ShardWriter:
    """Writes safetensors shards as tensors arrive, holding one tensor in memory at a time.

    A safetensors file starts with a header naming every tensor's dtype, shape and offset, so the writer is
    given the specs of all tensors, in the order they will come, before the first byte is written. Shards
    are cut before a tensor that would take one over `max_shard_bytes`. One shard is `model.safetensors`;
    several get an index, as transformers writes them.
    """

    def __init__(self, folder: Path, specs: list[TensorSpec], max_shard_bytes: int = 5 * 10**9):
        self.folder = folder
        self.specs = specs
        self.shards: list[list[TensorSpec]] = []
        size = 0
        if not specs:
            raise ValueError("a checkpoint needs at least one tensor")
        for spec in specs:
            if not self.shards or (size + spec.nbytes > max_shard_bytes and self.shards[-1]):
                self.shards.append([])
                size = 0
            self.shards[-1].append(spec)
            size += spec.nbytes
        count = len(self.shards)
        self.files = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        )
        self._position = 0  # index into specs of the next tensor expected
        self._shard = -1
        self._handle = None

    def _open_next_shard(self) -> None:
        if self._handle is not None:
            self._handle.close()
        self._shard += 1
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in self.shards[self._shard]:
            header[spec.name] = {
                "dtype": SAFETENSORS_DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data buffer starts 8-byte aligned
        # unbuffered: copy_bytes hands the file descriptor to the kernel between our own writes
        self._handle = open(self.folder / self.files[self._shard], "wb", buffering=0)
        self._handle.write(len(encoded).to_bytes(8, "little"))
        self._handle.write(encoded)
        self._remaining = len(self.shards[self._shard])

    def add(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs[self._position]
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(
                f"writer expected {spec.name} {spec.dtype} {spec.shape}, got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        if self._handle is None or self._remaining == 0:
            self._open_next_shard()
        data = tensor.detach().contiguous().reshape(-1)
        if data.numel():
            self._handle.write(data.view(torch.uint8).numpy())  # the buffer itself: no copy
        self._advance()

    def copy_bytes(self, spec: TensorSpec, source: tuple[Path, int, int], chunk: int = 16 * 2**20) -> None:
        """Copy a tensor's bytes from another safetensors file unchanged, a chunk at a time: a tensor that
        passes through is never in memory whole (and the output bytes are those add() would write)."""
        expected = self.specs[self._position]
        file, start, end = source
        if spec != expected or end - start != expected.nbytes:
            raise RuntimeError(f"writer expected {expected.name} ({expected.nbytes} bytes), got {spec.name} "
                               f"({end - start} bytes)")
        if self._handle is None or self._remaining == 0:
            self._open_next_shard()
        with open(file, "rb") as handle:
            copied = _copy_in_kernel(handle.fileno(), self._handle.fileno(), start, end - start)
            handle.seek(start + copied)
            remaining = end - start - copied
            while remaining:
                block = handle.read(min(chunk, remaining))
                if not block:
                    raise BadInputError(f"{file.name} ends before tensor {spec.name} does")
                self._handle.write(block)
                remaining -= len(block)
        self._advance()

    def _advance(self) -> None:
        self._remaining -= 1
        self._position += 1

    def finish(self) -> list[str]:
        if self._position != len(self.specs):
            raise RuntimeError(f"writer got {self._position} of {len(self.specs)} tensors")
        if self._handle is not None:
            self._handle.close()
        if len(self.files) == 1:
            return list(self.files)
        weight_map = {spec.name: self.files[i] for i, shard in enumerate(self.shards) for spec in shard}
        total = sum(spec.nbytes for spec in self.specs)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return self.files + ["model.safetensors.index.json"]


def overwrite_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write new values of tensors already in the folder's safetensors shards, in place: same names, dtypes
    and shapes, so every offset stays and no other byte changes. Values are cast to the dtype on disk. Every
    name and shape is checked before the first byte is written."""
    by_dtype = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    plan: dict[Path, list[tuple[int, torch.Tensor]]] = {}
    left = dict(tensors)
    for file in sorted(folder.glob("*.safetensors")):
        data_start, entries = check_safetensors_header(file)
        for name in [name for name in left if name in entries]:
            entry, value = entries[name], left.pop(name)
            if list(value.shape) != list(entry["shape"]):
                raise RuntimeError(f"{name}: shape {list(value.shape)} is not the {entry['shape']} on disk")
            value = value.detach().to("cpu", by_dtype[entry["dtype"]]).contiguous()
            plan.setdefault(file, []).append((data_start + entry["data_offsets"][0], value))
    if left:
        raise RuntimeError(f"tensors not in {folder}: {sorted(left)[:3]}")
    for file, writes in plan.items():
        with open(file, "r+b") as handle:
            for offset, value in writes:
                handle.seek(offset)
                if value.numel():
                    handle.write(value.reshape(-1).view(torch.uint8).numpy())
