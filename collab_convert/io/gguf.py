"""GGUF files as input: transformers reads and dequantises them; we keep a float Hugging Face folder.

A GGUF-loaded model refuses `save_pretrained`, so the folder is rebuilt the documented way: the model from its
config, the dequantised state dict loaded into it, then saved. Dequantising takes about a minute for a
135M-parameter model on two cores, so the folder is cached (keyed by the file's path, size and modification
time) and written whole or not at all. Needs the optional `gguf` and `accelerate` packages.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..errors import BadInputError, first_line


SOURCE_NOTE = "gguf_source.json"  # in a dequantised folder: the GGUF it came from (a GGUF export copies its tokenizer)
CACHE_VERSION = "2"  # 2: folders carry SOURCE_NOTE


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def cache_root() -> Path:
    base = os.environ.get("COLLAB_CONVERT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "collab-convert"
    )
    return Path(base) / "gguf"


def _check_magic(path: Path) -> None:
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise BadInputError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")


def cached_folder(path: Path) -> Path:
    """Where gguf_folder keeps a GGUF file's dequantised folder (not there until the file is first converted)."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{CACHE_VERSION}|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{key}"


def gguf_folder(path: Path, convert: bool = True) -> Path:
    """The dequantised Hugging Face folder of a GGUF file, converted once and then reused. `convert`: False to
    only say where it is, or will be (cached_folder)."""
    _check_magic(path)
    folder = cached_folder(path)
    if (folder / "config.json").is_file() or not convert:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.collab-tmp-{os.getpid()}"
    try:
        _convert(path.resolve(), staging)
        try:
            staging.rename(folder)
        except OSError:  # another run converted the same file meanwhile: keep theirs
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert(path: Path, target: Path) -> None:
    try:
        import accelerate  # noqa: F401 - transformers' GGUF loader needs both
        import gguf  # noqa: F401
    except ImportError:
        raise BadInputError(
            f"{path.name} is a GGUF file; reading it needs the optional packages: "
            "pip install 'collab-convert[gguf]' (gguf and accelerate)"
        ) from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except Exception as error:  # noqa: BLE001 - a GGUF transformers cannot read is bad input, whatever the cause
        raise BadInputError(f"transformers could not read {path.name}: {first_line(error)}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)
    target.mkdir()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    note = {"gguf": str(path), "precision": stored_precision(path)}
    (target / SOURCE_NOTE).write_text(json.dumps(note) + "\n", encoding="utf-8")


# GGUF tensor types by the float precision that holds their values: quantised blocks scale by f16 numbers
QUANTISED_AS = "f16"
FLOAT_TYPES = {"F32": "f32", "F64": "f32", "BF16": "bf16", "F16": "f16"}
WIDTH = {"f16": 0, "bf16": 1, "f32": 2}  # which of two precisions holds the other's values (bf16: its range)


def stored_precision(path: Path) -> str:
    """The float precision a GGUF file stores its weight matrices in: the widest among them, a quantised type
    counting as f16 (its block scales are f16). Vectors (norms, biases) are F32 in every GGUF and do not count."""
    from gguf import GGUFReader

    found = {FLOAT_TYPES.get(tensor.tensor_type.name, QUANTISED_AS)
             for tensor in GGUFReader(path).tensors if len(tensor.shape) >= 2}
    return max(found, key=WIDTH.__getitem__) if found else "f32"


def source_precision(folder: Path) -> str | None:
    """For a folder dequantised from a GGUF file (in our cache): the precision that file stored its weights in
    (f16, bf16 or f32). None for any other folder (a checkpoint compressed from one carries the note along, but its
    weights are in the precision it was written in), or where the file can no longer be read."""
    note = Path(folder) / SOURCE_NOTE
    if not note.is_file() or not Path(folder).resolve().is_relative_to(cache_root().resolve()):
        return None
    try:
        recorded = json.loads(note.read_text(encoding="utf-8"))
        return recorded.get("precision") or stored_precision(Path(recorded["gguf"]))
    except Exception:  # noqa: BLE001 - a note of an older cache whose file moved: nothing known
        return None


def source_of(folder: Path) -> str | None:
    """The GGUF file a folder (or a checkpoint compressed from it, which carries the note along) came from."""
    note = Path(folder) / SOURCE_NOTE
    if not note.is_file():
        return None
    try:
        return str(json.loads(note.read_text(encoding="utf-8"))["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
