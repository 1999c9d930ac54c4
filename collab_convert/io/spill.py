"""Objects kept on disk instead of in memory: one file per key, loaded on access, written atomically.

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
    """str -> object, each in its own file under `folder`; keys keep their insertion order."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._keys: list[str] = []

    def _path(self, key: str) -> Path:
        return self.folder / f"{len(self._keys) if key not in self._keys else self._keys.index(key)}.pt"

    def __setitem__(self, key: str, value: Any) -> None:
        path = self._path(key)
        partial = path.with_suffix(".partial")
        torch.save(value, partial)
        partial.replace(path)
        if key not in self._keys:
            self._keys.append(key)

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return torch.load(self._path(key), weights_only=False)  # our own file, from this run

    def __delitem__(self, key: str) -> None:
        if key not in self._keys:
            raise KeyError(key)
        self._path(key).unlink(missing_ok=True)
        self._keys[self._keys.index(key)] = None  # keeps the other keys' file numbers

    def __iter__(self) -> Iterator[str]:
        return (key for key in self._keys if key is not None)

    def __len__(self) -> int:
        return sum(key is not None for key in self._keys)
