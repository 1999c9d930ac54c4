"""export(): a compressed checkpoint (or any model transformers loads) in a runtime format, checked.

ONNX:  load (integration/loading.py)  ->  trace to ONNX (integration/onnx_export.py)  ->  run it in onnxruntime
       against PyTorch on the built-in sentences  ->  tokenizer and config beside it  ->  swap into place
GGUF:  a stock llama-family checkpoint's tensors to llama.cpp's names and layout (integration/gguf_export.py)  ->
       run llama.cpp's graph over the file's own tensors (integration/gguf_check.py) against PyTorch on the
       built-in sentences  ->  rename into place
"""

from __future__ import annotations

import copy

import json
import re
import time
from pathlib import Path

from .errors import BadInputError, first_line
from .format import CHECKPOINT_CODE, original_config
from .io.folders import StagedOutput, check_output, copy_non_weight_files, read_config, resolve_model
from .options import ExportOptions
from .progress import Progress, no_progress
from .results import ExportResult

# compress's pictures describe the fit, not the runtime model; the modeling code is for PyTorch loads
NOT_FOR_THE_RUNTIME = frozenset({"spectra.svg", "errors.svg", CHECKPOINT_CODE})


def export(model: str, options: ExportOptions, progress: Progress = no_progress) -> ExportResult:
    """Write `model` in options.format to options.output, after checking the runtime reproduces PyTorch on real text;
    refuse (and write nothing) otherwise."""
    if options.format == "gguf":
        from .gguf_exporting import export_gguf

        return export_gguf(model, options, progress)
    return _export_onnx(model, options, progress)


def _export_onnx(model: str, options: ExportOptions, progress: Progress = no_progress) -> ExportResult:
    """Write `model` as ONNX into options.output, after checking onnxruntime reproduces PyTorch on real text
    within options.tolerance; refuse (and write nothing) otherwise."""
    from .integration.onnx_export import (
        EncoderOutputs,
        LanguageModelOutputs,
        check_onnx,
        export_onnx,
        require_onnx,
    )

    started = time.perf_counter()
    require_onnx()
    folder = resolve_model(model)
    output = options.output.expanduser().resolve()
    if output.suffix.lower() == ".onnx":  # a user naming the file would get a folder of that name
        raise BadInputError(f"an ONNX export is a folder (model.onnx, config.json and the tokenizer files): name the "
                            f"folder, e.g. -o {output.with_suffix('').name}-onnx, not '{output.name}'")
    check_output(output, folder, options.overwrite)
    progress("loading", 0, 1)
    wrapper, kind = _wrapped(folder, EncoderOutputs, LanguageModelOutputs)
    example, probe, description = _inputs(folder, wrapper)
    with StagedOutput(output, options.overwrite) as staged:
        progress("exporting to ONNX", 0, 1)
        path = staged.folder / "model.onnx"
        try:
            export_onnx(wrapper, example, path)
        except Exception as error:  # noqa: BLE001 - the exporter fails in many ways on models it cannot trace
            raise BadInputError(f"torch.onnx could not export this model: {export_failure(error)}") from None
        progress("checking in onnxruntime", 0, 1)
        check = check_onnx(path, wrapper, probe, description)
        if not check.max_abs_difference <= options.tolerance:
            raise BadInputError(f"onnxruntime differs from PyTorch by {check.max_abs_difference:.2e} (more than "
                                f"--tolerance {options.tolerance:g}); nothing was written")
        files = ["model.onnx"] + copy_non_weight_files(folder, staged.folder, NOT_FOR_THE_RUNTIME)
        if (folder / "config.json").is_file():  # runtimes (optimum, transformers.js) read the model type there:
            # the original's, which a guarded checkpoint keeps in its record (the graph needs no code of ours)
            config = original_config(read_config(folder))
            (staged.folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            files.append("config.json")
        result = ExportResult(
            model=model, output=str(output), format=options.format, kind=kind,
            inputs=list(example), outputs=[wrapper.output_name],
            max_abs_difference=check.max_abs_difference, checked_on=check.inputs, files=sorted(files),
            seconds=time.perf_counter() - started,
        )
        (staged.folder / "export.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
        result.files = sorted(files + ["export.json"])
        staged.commit()
    progress("checking in onnxruntime", 1, 1)
    return result


def export_failure(error: Exception) -> str:
    """The cause of a failed export in one line. torch.onnx's message opens with colour codes and generic
    advice; the cause follows its "## Exception summary"."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines() if line.strip()]
    if "## Exception summary" in lines[:-1]:
        return lines[lines.index("## Exception summary") + 1]
    return lines[0] if lines else type(error).__name__


def _wrapped(folder: Path, encoder, language_model):
    """The model loaded as its config says, in the wrapper that names its output."""
    import torch
    import transformers

    from .integration.fidelity import is_language_model
    from .integration.loading import load_model

    causal = is_language_model(read_config(folder).get("architectures"))
    auto_class = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    try:
        # in float32 whatever the checkpoint stores (compress --dtype f16/bf16): the graph onnxruntime runs on CPUs
        # and the one the check compares against PyTorch's within --tolerance
        model = load_model(str(folder), auto_class=auto_class, dtype=torch.float32).eval()
    except BadInputError:
        raise
    except Exception as error:  # noqa: BLE001 - a checkpoint transformers cannot load
        raise BadInputError(f"could not load {folder}: {first_line(error)}") from None
    if causal:
        return language_model(model), "causal language model: next-token logits, no cache"
    if getattr(model.config, "is_encoder_decoder", False):
        # the whole model would run its decoder on inputs it makes up (BART shifts the input ids; T5 has none
        # and fails): the encoder is what takes the input alone
        return encoder(model.get_encoder()), "encoder of an encoder-decoder: final hidden states (no decoder)"
    return encoder(model), "encoder: final hidden states"


def _inputs(folder: Path, wrapper):
    """(a small traced example, the check's inputs, what the check ran on): the tokenizer's own inputs on the
    built-in sentences, padded; the example is two of them, so batch and length are traced as dynamic."""
    import inspect

    from .architectures.lookup import within_positions
    from .integration.loading import load_tokenizer
    from .predict import default_probe

    tokenizer = copy.deepcopy(load_tokenizer(folder, "export (to check its result)"))  # shared: a pad token for us
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    texts = default_probe().texts
    accepted = set(inspect.signature(wrapper.model.forward).parameters)
    names = [name for name in wrapper.input_names if name in accepted]

    length = within_positions(wrapper.model.config.to_dict(), 128)

    def encode(chosen: list[str]):
        batch = tokenizer(chosen, padding=True, truncation=True, max_length=length, return_tensors="pt")
        return {name: batch[name] for name in names if name in batch}

    return encode(texts[:2]), encode(texts), f"{len(texts)} built-in sentences, padded to one batch"
