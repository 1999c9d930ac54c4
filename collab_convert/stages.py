"""The stages every form goes through, over an opened source model: the plan's common checks, calibration and
held-out texts, and distillation of the written checkpoint. compression.py sequences them with the form's own
(forms/)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .architectures.source import SourceModel
from .cpu import HEAP_TRIM_THRESHOLD, reused_heap
from .devices import unavailable
from .errors import BadInputError
from .io.folders import check_output
from .io.writer import parse_size
from .options import CompressOptions
from .progress import Progress
from .results import CompressPlan


def check_plan(source: SourceModel, options: CompressOptions, form_plan) -> CompressPlan:
    """Refuse what cannot work before anything costly runs: the output, the device, distillation, and the form's
    own plan (`form_plan`, made by the form: each layer's size and query/key parameters)."""
    parse_size(options.max_shard_size)
    output = options.output.expanduser().resolve()
    check_output(output, source.folder, options.overwrite)
    check_device(options.device)
    if options.distill_steps:
        _check_distillation(source, options)
    if options.gated and options.calibration is None:
        raise BadInputError("--min-cosine, --min-cosine-p01, --min-top1 and --max-kl gate on fidelity measured on "
                            "held-out --calibration lines: give --calibration, or run `collab-convert verify` on "
                            "your own text")
    layers = form_plan.layers
    return CompressPlan(
        model=source.source,
        output=str(output),
        family=source.family.name,
        form=source.form,
        method=form_plan.method,
        layers=layers,
        parameters_before=sum(layer["parameters_before"] for layer in layers),
        parameters_after=sum(layer["parameters_after"] or 0 for layer in layers),
        size=form_plan.description,
    )


def check_device(device: str) -> None:
    """Refuse a CUDA device torch cannot see, before anything runs."""
    why = unavailable(device)
    if why:
        raise BadInputError(why)


def within_positions(source: SourceModel, options: CompressOptions) -> CompressOptions:
    """Calibration texts cut where the model's position embeddings end: a longer cut would index past them."""
    from .architectures.lookup import within_positions as cut

    length = cut(source.config, options.calibration_max_length)
    if length != options.calibration_max_length:
        return options.model_copy(update={"calibration_max_length": length})
    return options


def _check_distillation(source: SourceModel, options: CompressOptions) -> None:
    if options.calibration is None:
        raise BadInputError("--distill-steps learns from calibration text: drop --weight-only (a language model "
                            "calibrates on built-in text by default) or give --calibration FILE")


PROBE_TEXTS = 32  # texts a fidelity estimate measures on
# A few hundred varied English lines written for the project (news, fiction, science, instructions, letters, chat):
# what a language model calibrates on when given no --calibration.
BUILT_IN_TEXT = Path(__file__).parent / "data" / "calibration_en.txt"
# Measured by benchmarks/default_calibration.py (docs/benchmarks.md): why a decoder is not fitted from weights alone.
WEIGHT_ONLY_COST = ("a decoder fitted from its weights alone keeps little of what it predicts (SmolLM2 at half the "
                    "key cache, on held-out documents: the original's next token 23% of the time, perplexity +978%; "
                    "calibrated on the built-in text: 77%, +13%)")


def decoder_calibration(source: SourceModel, options: CompressOptions) -> tuple[CompressOptions, str | None]:
    """(the options to run, a warning or None). A language model given no --calibration calibrates on the built-in
    text, its last PROBE_TEXTS lines held out to measure the result on; --weight-only, or a model with no tokenizer,
    fits from the weights alone, with a warning that says what that costs."""
    from .integration.fidelity import is_language_model
    from .io.texts import read_texts

    if options.weight_only and options.calibration is not None:
        raise BadInputError("--weight-only and --calibration contradict each other: give one of them")
    if options.calibration is not None or not is_language_model(source.config.get("architectures")):
        return options, None
    if options.weight_only:
        return options, (f"fitted from the weights alone (--weight-only): {WEIGHT_ONLY_COST}; drop --weight-only to "
                         "calibrate on built-in English text, or give --calibration FILE")
    texts = read_texts(BUILT_IN_TEXT, 10**6)
    if not _reads_english(source, texts[0]):
        return options, (f"fitted from the weights alone: the model has no tokenizer to calibrate with, and "
                         f"{WEIGHT_ONLY_COST}")
    lines = len(texts)
    samples = min(options.calibration_samples, lines - PROBE_TEXTS)
    return options.model_copy(update={"calibration": BUILT_IN_TEXT, "calibration_samples": samples}), None


def _reads_english(source: SourceModel, line: str) -> bool:
    """Whether the model's tokenizer turns English into ids its embeddings hold (transformers may build an empty
    tokenizer for a folder that has none)."""
    from .integration.loading import load_tokenizer

    try:
        ids = load_tokenizer(source.folder, "calibration")(line)["input_ids"]
    except (BadInputError, ValueError, TypeError):
        return False
    vocabulary = source.config.get("vocab_size") or source.config.get("n_vocab")
    return len(set(ids)) > 1 and (not vocabulary or max(ids) < vocabulary)


def text_name(path: Path | None) -> str:
    """How reports name a calibration file: the built-in text by what it is, not by where it is installed."""
    return "the built-in English text" if path == BUILT_IN_TEXT else str(path)


@dataclass
class ProbeTexts:
    """Texts a fidelity figure is measured on, and what they are, for reports."""

    texts: list[str]
    description: str
    seen_by_the_fit: bool = False  # no line was left to hold out: the figures overstate what unseen text gets
    repeats_dropped: int = 0  # the file's lines left out as repeats of earlier ones (they would be in fit and probe)


def calibration_texts(options: CompressOptions) -> tuple[list[str], ProbeTexts]:
    """(texts the fit sees, texts a fidelity figure measures on) from --calibration, each line once: a repeated
    line would be in a fit's training sequences and in the checks that hold lines out from them.

    The probe texts are the lines after the first `calibration_samples`. A file with none to spare holds out its
    last lines instead, a tenth at most, so that a gate on the figure (--min-cosine, ...) judges text the fit never
    saw; a file of fewer than ten lines lends its last few, and the description says the figure is then not on
    held-out text."""
    from .io.texts import read_texts

    texts = read_texts(options.calibration, options.calibration_samples + PROBE_TEXTS, distinct=True)
    fitted, name, repeats = texts[: options.calibration_samples], text_name(options.calibration), texts.repeats
    if options.distill_steps and len(texts) < 2:  # refused here, before the costly stages, not after them
        raise BadInputError(f"--distill-steps needs at least two calibration texts; {name} holds one"
                            + (f" distinct line ({repeats} repeats of it read once)" if repeats else ""))
    if texts[options.calibration_samples:]:
        held_out = texts[options.calibration_samples:]
        return fitted, ProbeTexts(held_out, f"{len(held_out)} held-out lines of {name}", repeats_dropped=repeats)
    held = min(PROBE_TEXTS, len(texts) // 10)
    if held:
        return texts[:-held], ProbeTexts(texts[-held:], f"{held} held-out lines of {name} (its last {held}; the fit "
                                                        f"used the {len(texts) - held} before them)",
                                         repeats_dropped=repeats)
    reused = fitted[-PROBE_TEXTS:]
    lines = f"{len(reused)} line{'s' if len(reused) > 1 else ''}"
    return fitted, ProbeTexts(reused, f"{lines} of {name} (also used for the fit: none were left to hold out)",
                              seen_by_the_fit=True, repeats_dropped=repeats)


def mixed_calibration(source: SourceModel, options: CompressOptions, texts: list[str]) -> tuple[list[str], str]:
    """(the texts an encoder is fitted on, what the mix was): --calibration-mix (calibration_mix.py). Language
    models take the texts as given: their calibration is about long contexts, not sentence embeddings."""
    from .io.calibration_mix import mixed
    from .integration.fidelity import is_language_model
    from .io.texts import read_texts

    mix = "as-given" if options.calibration_mix == "auto" else options.calibration_mix
    note = ""
    if is_language_model(source.config.get("architectures")):
        note = " (a language model takes its lines as given)" if mix != "as-given" else ""
        mix = "as-given"
    built_in = read_texts(BUILT_IN_TEXT) if mix == "lengths+built-in" else None
    found = mixed(texts, options.calibration_max_length, mix, built_in)
    return found.texts, f"{options.calibration_mix}: {found.description}{note}"


def distill_checkpoint(source: SourceModel, folder: Path, texts: list[str], options: CompressOptions,
                       progress: Progress, names: list[str] | None = None) -> dict[str, Any]:
    """--distill-steps: tune the written checkpoint's collaborative tensors (or the tensors `names`, where the form
    says which) together against the original (integration/distillation.py: next-token distributions for a
    language model, token states and sentence embeddings for an encoder) and write the best state over them in
    place; what happened, for the report."""
    from .integration.distillation import distill, objective_for
    from .io.reader import TensorReader
    from .io.writer import overwrite_tensors

    progress("distilling", 0, options.distill_steps)
    with reused_heap(top=HEAP_TRIM_THRESHOLD):  # every step allocates the same activations afresh (cpu.reused_heap)
        tuned, report = distill(source.folder, folder, texts, options.calibration_max_length, options.distill_steps,
                                options.seed, progress, options.device, names,
                                objective_for(source.config.get("architectures")))
    reader = TensorReader(folder)
    try:
        on_disk = set(reader.names())
    finally:
        reader.close()
    # The loaded model may name tensors with its head's base-model prefix ("model.") where the checkpoint has none.
    renamed = {}
    for name, tensor in tuned.items():
        stripped = name.split(".", 1)[-1]
        renamed[name if name in on_disk or stripped not in on_disk else stripped] = tensor
    overwrite_tensors(folder, renamed)
    progress("distilling", options.distill_steps, options.distill_steps)
    return report.as_dict()
