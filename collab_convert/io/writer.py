"""Writing tensors: safetensors shards streamed as tensors arrive, and new values written over tensors in place.
Knows nothing of the math."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import BadInputError
from .headers import DTYPES_BY_NAME, SAFETENSORS_DTYPES, TensorSpec, check_safetensors_header


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
    plan: dict[Path, list[tuple[int, torch.Tensor]]] = {}
    left = dict(tensors)
    for file in sorted(folder.glob("*.safetensors")):
        data_start, entries = check_safetensors_header(file)
        for name in [name for name in left if name in entries]:
            entry, value = entries[name], left.pop(name)
            if list(value.shape) != list(entry["shape"]):
                raise RuntimeError(f"{name}: shape {list(value.shape)} is not the {entry['shape']} on disk")
            value = value.detach().to("cpu", DTYPES_BY_NAME[entry["dtype"]]).contiguous()
            plan.setdefault(file, []).append((data_start + entry["data_offsets"][0], value))
    if left:
        raise RuntimeError(f"tensors not in {folder}: {sorted(left)[:3]}")
    for file, writes in plan.items():
        with open(file, "r+b") as handle:
            for offset, value in writes:
                handle.seek(offset)
                if value.numel():
                    handle.write(value.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class Passed:
    """A tensor that passes through, written under `name`: rows [start, stop) of the input's (all of them by
    default). A form that writes another family splits fused tensors this way, without loading them."""

    name: str
    start: int = 0
    stop: int | None = None

    def spec(self, spec: TensorSpec) -> TensorSpec:
        rows = (self.stop if self.stop is not None else spec.shape[0]) - self.start
        return TensorSpec(self.name, spec.dtype, (rows, *spec.shape[1:]) if spec.shape else spec.shape)
