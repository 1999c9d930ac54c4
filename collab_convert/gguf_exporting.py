"""export --format gguf: a stock llama-family checkpoint as one GGUF file that llama.cpp runs, written only once
llama.cpp's graph over the file's own tensors reproduces PyTorch on the built-in sentences.

    tensors to llama.cpp's names and layout (integration/gguf_export.py)  ->  the check (integration/gguf_check.py)
    against transformers with its weights rounded as the file rounds them  ->  one rename into place
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch

from .errors import BadInputError, OutputExistsError
from .interrupts import raise_if_interrupted
from .io.folders import resolve_model
from .options import ExportOptions
from .progress import Progress
from .results import ExportResult

CHECK_TEXTS = 8  # built-in sentences the file is checked on
CHECK_TOKENS = 64


def export_gguf(model: str, options: ExportOptions, progress: Progress) -> ExportResult:
    from .integration.gguf_export import write_gguf

    started = time.perf_counter()
    if importlib.util.find_spec("gguf") is None:
        raise BadInputError("GGUF export needs the gguf package: pip install 'collab-convert[gguf]'")
    folder = resolve_model(model)
    target = _target(options, folder)
    staging = target.with_name(f".{target.name}.collab-tmp-{os.getpid()}")
    target.parent.mkdir(parents=True, exist_ok=True)  # as compress's -o: missing folders are made
    try:
        details = write_gguf(folder, staging, options.dtype, progress)
        progress("checking the GGUF", 0, 1)
        difference, agreement, checked_on = _check(folder, staging, options.dtype)
        if not difference <= max(options.tolerance, 1e-3):
            raise BadInputError(f"llama.cpp's graph over the written file differs from PyTorch by {difference:.2e} of "
                                "the largest logit; nothing was written")
        raise_if_interrupted()  # an interrupted run never commits
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    progress("checking the GGUF", 1, 1)
    details["next_token_agreement"] = agreement
    return ExportResult(
        model=model, output=str(target), format="gguf",
        kind=f"causal language model in llama.cpp's llama architecture: {details['heads']} query heads and "
             f"{details['kv_heads']} key/value head(s) of {details['head_dim']}, {options.dtype}",
        inputs=["tokens"], outputs=["logits"], max_abs_difference=difference, checked_on=checked_on,
        files=[target.name], seconds=time.perf_counter() - started, details=details,
    )


def _target(options: ExportOptions, folder: Path) -> Path:
    target = options.output.expanduser().resolve()
    if target.suffix.lower() != ".gguf":
        raise BadInputError(f"a GGUF export is one file: name it with .gguf, not '{target.name}'")
    if folder.resolve() in target.parents:
        raise BadInputError(f"output {target} lies inside the input model folder; choose another location")
    if target.is_dir():
        raise OutputExistsError(f"output {target} is a folder")
    if target.exists() and not options.overwrite:
        raise OutputExistsError(f"output {target} exists; pass --overwrite to replace it")
    if target.parent.exists() and not target.parent.is_dir():
        raise BadInputError(f"{target.parent} is a file, not a folder to write {target.name} into")
    return target


def _check(folder: Path, path: Path, dtype: str) -> tuple[float, float, str]:
    """(largest logit difference as a share of the largest logit, next-token agreement, what it ran on): llama.cpp's
    graph over the file against transformers, whose weight matrices are rounded to `dtype` as the file's are."""
    from transformers import AutoModelForCausalLM

    from .integration.gguf_check import reference_logits
    from .integration.gguf_export import DTYPES
    from .integration.loading import load_tokenizer
    from .predict import default_probe

    tokenizer = load_tokenizer(folder, "GGUF export (to check its result)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(parameter.to(DTYPES[dtype]).float())
    texts = default_probe().texts[:CHECK_TEXTS]
    worst, agree, total = 0.0, 0, 0
    for text in texts:
        ids = torch.tensor(tokenizer(text, truncation=True, max_length=CHECK_TOKENS)["input_ids"])
        with torch.no_grad():
            expected = model(ids[None]).logits[0].float()
        found = reference_logits(path, ids)
        worst = max(worst, float((found - expected).abs().max() / expected.abs().max().clamp_min(1e-30)))
        agree += int((found.argmax(-1) == expected.argmax(-1)).sum())
        total += ids.shape[0]
    return worst, agree / max(total, 1), f"{len(texts)} built-in sentences, up to {CHECK_TOKENS} tokens each"
