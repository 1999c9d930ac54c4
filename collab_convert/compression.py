"""compress(): re-parametrize every attention layer into collaborative form and write a complete checkpoint.

This module only sequences the stages (stages.py); each stage's knowledge lives elsewhere:

    open the source (architectures/)  ->  check the plan  ->  calibrate (integration/capture.py)
    ->  choose ranks (fixed, energy, or a fidelity target: predict.py)  ->  fit each layer (decompose/methods.py)
    ->  stream tensors out (io/writer.py)  ->  config (format.py), reports and card (report/)
    ->  swap the staged output into place (io/folders.py)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from .architectures.source import SourceModel, open_model
from .io.folders import StagedOutput, copy_non_weight_files
from .options import CompressOptions
from .progress import Progress, StageClock, no_progress
from .results import CompressPlan, CompressResult
from .stages import (
    FinishedLayers,
    calibrate,
    calibration_texts,
    check_plan,
    convert_weights,
    distill_checkpoint,
    within_positions,
    energy_ranks,
    write_format_config,
)


def plan(model: str, options: CompressOptions) -> CompressPlan:
    """Check the model, the ranks and the output location; decompose nothing, write nothing."""
    source = open_model(model, options.requested_form)
    try:
        return _check(source, options)
    finally:
        source.close()


def _check(source: SourceModel, options: CompressOptions, ranks: dict[str, int] | None = None) -> CompressPlan:
    if (source.form == "shared-key"):
        from .rotary_stages import layer_width, plan_layers

        return check_plan(source, options, layers=plan_layers(source, layer_width(source, options)))
    return check_plan(source, options, ranks)


def compress(model: str, options: CompressOptions, progress: Progress = no_progress) -> CompressResult:
    """Re-parametrize every attention layer into collaborative form and write a complete checkpoint."""
    from .cpu import math_threads, return_freed_memory
    from .integration import loading  # noqa: F401 - transformers' lazy imports land here, before the clock starts

    return_freed_memory()
    with math_threads(options.threads) as (threads, why):
        return _compress(model, options, progress, {"threads": threads, "why": why})


def _compress(model: str, options: CompressOptions, progress: Progress, threads: dict[str, Any]) -> CompressResult:
    started = time.perf_counter()
    progress = StageClock(progress)  # the report's seconds per stage are the stages the progress showed
    torch.manual_seed(options.seed)
    progress("opening the model", 0, 1)
    source = open_model(model, options.requested_form)
    progress("opening the model", 1, 1)
    try:
        output = Path(_check(source, options).output)  # refuse bad input before the costly calibration
        with StagedOutput(output, options.overwrite, options.resume) as staged:
            result = _stages(source, model, options, progress, staged, threads, started)
    finally:
        source.close()
    return result


def _stages(source: SourceModel, model: str, options: CompressOptions, progress: StageClock, staged: StagedOutput,
            threads: dict[str, Any], started: float) -> CompressResult:
    """Everything after the checks, inside the staging folder (its scratch space holds what a block-at-a-time
    calibration keeps on disk)."""
    metrics, calibration, held_out, fitted = None, None, None, None
    shared = source.form == "shared-key"
    options = within_positions(source, options)
    if options.calibration is not None:
        fitted, held_out = calibration_texts(options)
        if not (source.form == "shared-key"):
            metrics, calibration = calibrate(source, options, fitted, progress, scratch=staged.scratch)
    ranks = None
    if (source.form == "shared-key"):
        convert, write_record, calibration, rank_choice = _rotary(source, options, fitted, progress, staged.scratch)
        estimator = _estimator(source, options, None, held_out)
    else:
        estimator = _estimator(source, options, metrics, held_out)
        ranks, rank_choice = choose_ranks(source, options, metrics, estimator, progress)

        def convert(folder, finished):
            return convert_weights(source, options, folder, progress, ranks, metrics, finished)

        def write_record(reports, folder, method):
            write_format_config(source, reports, folder, method, calibrated=metrics is not None)
    _check(source, options, ranks)
    reports, files = convert(staged.folder, FinishedLayers(staged.finished_work))
    staged.drop_scratch()
    files += copy_non_weight_files(source.folder, staged.folder)
    result = CompressResult(
        model=model, output=str(staged.output), family=source.family.name, form=source.form,
        method=None if shared else options.method,
        layers=reports, files=[], seconds=0.0, calibration=calibration, rank_choice=rank_choice,
        threads=threads,
    )
    write_record(reports, staged.folder, None if shared else result.method + ("+calibrated" if calibration else ""))
    if options.distill_steps:  # checked with the plan: calibration texts and a language model are there
        result.distillation = distill_checkpoint(source, staged.folder, fitted, options, progress)
    if held_out is not None and estimator is not None:  # calibration lends lines to measure the result on
        progress("measuring fidelity", 0, 1)
        result.fidelity = estimator.measured(staged.folder)
        progress("measuring fidelity", 1, 1)
    if options.timing:
        result.runtime = _timed(source, staged.folder, progress)
    progress("writing reports and plots", 0, 1)
    files += ["config.json"] + _write_reports(result, source, staged.folder, started, options.plots, progress)
    progress("writing reports and plots", 1, 1)
    result.files = sorted(files)
    staged.commit()
    return result


def _timed(source: SourceModel, folder: Path, progress: Progress) -> dict:
    """--timing: time per token of the original and the result, side by side (integration/runtime.py)."""
    from .integration.fidelity import is_language_model
    from .integration.runtime import time_per_token, why_not_timed

    reason = why_not_timed(source.config)
    if reason:
        return {"skipped": reason}
    progress("timing inference", 0, 1)
    try:
        timed = time_per_token(source.folder, folder, is_language_model(source.config.get("architectures")))
    except Exception as error:  # noqa: BLE001 - a measurement that cannot run must not cost the user the checkpoint
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        timed = {"skipped": f"timing failed: {first_line}"}
    progress("timing inference", 1, 1)
    return timed


def _rotary(source: SourceModel, options: CompressOptions, texts: list[str] | None, progress: Progress,
            scratch: Path | None = None):
    """The shared rotary key's stages (rotary_stages.py): statistics, one budget over layers and frequencies,
    then how to write the layers and the record."""
    from .rotary_stages import (
        allocate_ranks,
        calibrated_statistics,
        convert_rotary_weights,
        layer_width,
        model_weight_statistics,
        write_rotary_config,
    )

    width = layer_width(source, options)
    calibration, calibrations = None, None
    if texts is not None:
        statistics, calibrations, calibration = calibrated_statistics(source, options, texts, progress, scratch)
    else:
        statistics = model_weight_statistics(source, scratch)
    ranks = allocate_ranks(source, statistics, width)
    choice = {"mode": "key-cache budget", "numbers_per_token_and_layer": width,
              "share_of_key_cache": round(width / max(layer.full_rank for layer in source.layers), 4),
              "spread": f"over layers{'' if (not source.layout.rotates) else ' and rotary frequencies'}, "
                        "where the most score energy stays"}

    def convert(folder: Path, finished):
        return convert_rotary_weights(source, options, folder, progress, ranks, statistics, calibrations, finished)

    def write_record(reports, folder: Path, method: str) -> None:
        write_rotary_config(source, reports, folder, method)

    return convert, write_record, calibration, choice


def _estimator(source: SourceModel, options: CompressOptions, metrics, held_out):
    """The one fidelity estimator a run needs, built only if something will be measured: the rank search of
    `--rank auto`, or the finished checkpoint on held-out calibration lines. None for models that cannot be run
    on text."""
    from .predict import FidelityEstimator, can_measure, default_probe

    searches = options.rank == "auto" and options.energy is None
    if not can_measure(source) or not (searches or held_out is not None):
        return None
    # Estimates skip refinement: the final compression refines, which only lowers the error.
    settings = options.model_copy(update={"refine_steps": 0})
    return FidelityEstimator(source, settings, held_out or default_probe(), metrics)


def choose_ranks(source: SourceModel, options: CompressOptions, metrics, estimator,
                 progress: Progress) -> tuple[dict[str, int], dict[str, Any] | None]:
    """One rank per layer, and how it was chosen (for the report).

    A fixed rank is taken as given. `--rank auto` aims at a fidelity target (`--target-cosine`, default 0.99):
    the smallest rank whose measured embedding cosine on probe texts reaches it. It falls back to an energy
    share of the head products where the model cannot be run on text, or where `--energy` was asked for.
    """
    if options.rank != "auto":
        return {layer.prefix: options.rank for layer in source.layers}, None
    from .predict import DEFAULT_TARGET_COSINE

    if options.energy is not None or estimator is None:
        share = options.energy if options.energy is not None else 0.95
        reason = "asked for" if options.energy is not None else "the model cannot be run on text to measure fidelity"
        return energy_ranks(source, options.model_copy(update={"energy": share}), metrics), {
            "mode": "energy", "energy": share, "why": reason,
        }
    target = options.target_cosine or DEFAULT_TARGET_COSINE
    estimate = estimator.smallest_rank(target, progress)
    choice = {"mode": "fidelity target", "target_cosine": target, "probe": estimator.probe.description,
              "estimated_cosine_mean": estimate.cosine_mean, "estimated_cosine_p01": estimate.cosine_p01}
    return {layer.prefix: min(estimate.rank, layer.shape.key_dim) for layer in source.layers}, choice


def _write_reports(result: CompressResult, source: SourceModel, folder: Path, started: float,
                   plots: bool, clock: StageClock) -> list[str]:
    from .report.card import CardSource, write_model_card
    from .report.reports import write_reports

    files = []
    if plots:
        from .report.plots import write_plots

        files = write_plots(result, folder)
    result.seconds = time.perf_counter() - started
    result.stage_seconds = clock.stop()  # the reports themselves take milliseconds: not counted
    card = CardSource.of(result.model, source.folder, source.config)
    return files + write_reports(result, folder) + write_model_card(result, card, folder)
