"""Reading tensors lazily from a model folder. Knows nothing of the math.

Reading never unpickles: safetensors are memory-mapped one shard at a time, and a legacy pytorch_model.bin
is opened only with torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInputError, first_line
from .headers import DTYPES_BY_NAME, TensorSpec, check_safetensors_header
from .mapped import drop_read_pages, unwritten_file_mapping

COPIED_FROM_BYTES = 1 << 20  # tensors this large are copied off their shard's mapping, whose pages then go


class TensorReader:
    """Name -> tensor, loaded on demand. Safetensors shards are opened lazily and memory-mapped.

    `rename` maps the file's keys to the names callers use (the loaded model's naming, see naming.py).
    Thread-safe: layers are fitted ahead of the writer in worker threads (streaming.stream_weights).
    """

    def __init__(self, folder: Path, rename=None):
        self.folder = folder
        self._lock = threading.RLock()
        self._location: dict[str, Path] = {}
        self._key: dict[str, str] = {}  # name -> key in the file
        self._open: dict[Path, Any] = {}
        self._bin_cache: dict[Path, dict[str, torch.Tensor]] = {}
        self._layout: dict[Path, tuple[int, dict]] = {}  # safetensors: where the data starts, and each entry
        self._unwritten: dict[Path, tuple | None] = {}  # an open shard's mapping, where it qualifies (mapped.py)
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
                raise BadInputError(f"{file.name} could not be loaded safely as weights: {first_line(error)}") \
                    from None
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
                return self._off_the_mapping(file, self._handle(file).get_tensor(key))
            return self._load_bin(file)[key]
        except BadInputError:
            raise
        except Exception as error:  # noqa: BLE001 - truncated files fail here, not at open
            raise BadInputError(f"tensor {name} in {file.name} could not be read: {error}") from None

    def _off_the_mapping(self, file: Path, tensor: torch.Tensor) -> torch.Tensor:
        """A large tensor copied off its shard's mapping, whose pages then leave resident memory (io/mapped.py):
        the weights a loop over the layers has read do not pile up while their shard stays mapped (a 5 GB shard
        holds many layers). The copy lives as long as the caller holds it. Whether the mapping qualifies is asked
        once per opened shard: callers only ever get copies of its large tensors, so none of their pages is
        written afterwards; each tensor must lie inside that mapping."""
        size = tensor.numel() * tensor.element_size()
        if size < COPIED_FROM_BYTES:
            return tensor
        with self._lock:
            if file not in self._unwritten:
                self._unwritten[file] = unwritten_file_mapping(tensor)
            mapping = self._unwritten[file]
        # only a view into that mapping (a tensor safetensors copied elsewhere, to align it, is left as it is)
        if mapping is None or not mapping[0] <= tensor.data_ptr() <= mapping[1] - size:
            return tensor
        copy = tensor.clone()
        drop_read_pages(tensor)
        return copy

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
            dtype = DTYPES_BY_NAME[view.get_dtype()]
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
                self._unwritten.pop(file, None)

    def close(self) -> None:
        with self._lock:
            self._open.clear()
            self._unwritten.clear()
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
