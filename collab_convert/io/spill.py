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
        self._files: dict[str, Path] = {}  # insertion-ordered; a new key gets a file number never used before
        self._written = 0

    def __setitem__(self, key: str, value: Any) -> None:
        path = self._files.get(key) or self.folder / f"{self._written}.pt"
        partial = path.with_suffix(".partial")
        torch.save(value, partial)
        partial.replace(path)
        if key not in self._files:
            self._files[key] = path
            self._written += 1

    def __getitem__(self, key: str) -> Any:
        return torch.load(self._files[key], weights_only=False)  # our own file, from this run

    def __delitem__(self, key: str) -> None:
        self._files.pop(key).unlink(missing_ok=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
