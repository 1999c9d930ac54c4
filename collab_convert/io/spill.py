"""Objects kept on disk instead of in memory: one file per key, loaded on access, written atomically; and tensors
kept in memory up to a budget, the rest so.

A layer-by-layer calibration keeps each layer's statistics, samples and fit here until the layer is written,
so memory holds one layer's worth at a time, whatever the number of layers. The files are our own, written and
read by the same run inside its staging folder; nothing from a user is ever unpickled here.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import torch


class SpillFolder(MutableMapping):
    """str -> object, each in its own file under `folder`; keys keep their insertion order. A plain tensor is
    written as its raw bytes and read back into one new tensor; anything else is pickled (torch.save)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Path] = {}  # insertion-ordered; a new file gets a number never used before
        self._raw: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # shape and dtype of the keys written raw
        self._written = 0

    def __setitem__(self, key: str, value: Any) -> None:
        raw = isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided
        suffix = ".raw" if raw else ".pt"
        path = self._files.get(key)
        if path is None or path.suffix != suffix:
            if path is not None:
                path.unlink(missing_ok=True)
            path = self.folder / f"{self._written}{suffix}"
            self._written += 1
        partial = path.with_suffix(".partial")
        if raw:
            _write_raw(value, partial)
            self._raw[key] = (tuple(value.shape), value.dtype)
        else:
            torch.save(value, partial)
            self._raw.pop(key, None)
        partial.replace(path)
        self._files[key] = path

    def __getitem__(self, key: str) -> Any:
        if key in self._raw:
            return _read_raw(self._files[key], *self._raw[key])
        return torch.load(self._files[key], weights_only=False)  # our own file, from this run

    def __delitem__(self, key: str) -> None:
        self._raw.pop(key, None)
        self._files.pop(key).unlink(missing_ok=True)

    def __contains__(self, key) -> bool:  # Mapping's own would load the file to find out
        return key in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _bytes_of(tensor: torch.Tensor):
    """A contiguous tensor's memory as a flat uint8 array (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _write_raw(tensor: torch.Tensor, path: Path) -> None:
    # torch.save's archive around a block's activations (a few MB, written and read once per block and batch)
    # cost more than the bytes themselves
    with open(path, "wb") as handle:
        handle.write(memoryview(_bytes_of(tensor.detach().resolve_conj().resolve_neg().contiguous())))


def _read_raw(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype)
    with open(path, "rb") as handle:
        read = handle.readinto(memoryview(_bytes_of(tensor)))
    if read != tensor.nbytes:
        raise RuntimeError(f"{path}: {read} bytes, not the {tensor.nbytes} written")
    return tensor


class HeldOrSpilled:
    """str -> tensors (in tuples, lists and dicts too), in host memory while their bytes fit `budget`, the rest
    in a SpillFolder under `folder`: a block-at-a-time pass's activations."""

    def __init__(self, folder: Path, budget: int):
        self.budget, self.used = budget, 0
        self.held: dict[str, tuple[object, int]] = {}
        self.spilled = SpillFolder(folder)

    def __setitem__(self, key: str, value) -> None:
        if key in self.held:
            kept = self.held[key][0]
            if isinstance(value, torch.Tensor) and isinstance(kept, torch.Tensor) and (
                    kept.shape, kept.dtype, kept.device) == (value.shape, value.dtype, value.device):
                # into the tensor kept since the first (outside a block's heap): each block's new output kept
                # instead came from its reused heap, and the heap, trimmed around the kept ones at every
                # block, was faulted in again (calibrating stages of 45-46 s, against 40-44 s with them on disk)
                kept.copy_(value)
                return
            self.used -= self.held.pop(key)[1]
        size = _bytes(value)
        if self.used + size <= self.budget:
            self.held[key] = (value, size)
            self.used += size
            if key in self.spilled:
                del self.spilled[key]
        else:
            self.spilled[key] = value

    def __getitem__(self, key: str):
        return self.held[key][0] if key in self.held else self.spilled[key]


def _bytes(value) -> int:
    """Bytes of the tensors in `value` (in tuples, lists and dicts too)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(_bytes(item) for item in value.values())
    return 0
