"""compress(): re-parametrize every attention layer into the form asked for and write a complete checkpoint.

This module only sequences the stages; each stage's knowledge lives elsewhere, the form's in its form (forms/):

    open the source (architectures/)  ->  the plan: common checks (stages.py) and the form's  ->  calibration
    texts  ->  the form's statistics  ->  its sizes per layer  ->  each layer fitted by the form as the tensors
    stream out (streaming.py)  ->  the form's config record  ->  distillation, fidelity, timing  ->  reports and
    card (report/)  ->  the staged output swapped into place (io/folders.py)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from .architectures.source import SourceModel, open_model
from .errors import first_line
from .format import CHECKPOINT_CODE
from .forms import Form, FormPlan, form_named
from .io.folders import StagedOutput, copy_non_weight_files, record_dtype, weights_on_disk
from .integration.model_runs import keeping_states
from .options import CompressOptions, gate_failures
from .predict import states_to_keep
from .progress import Progress, StageClock, no_progress
from .results import CompressPlan, CompressResult
from .resume import FinishedLayers
from .streaming import DTYPE_NAMES, written_dtype
from .stages import (calibration_texts, check_plan, decoder_calibration, distill_checkpoint, mixed_calibration,
                     within_positions)


def plan(model: str, options: CompressOptions) -> CompressPlan:
    """Check the model, the sizes and the output location; decompose nothing, write nothing."""
    source = open_model(model, options.requested_form)
    try:
        return _check(source, decoder_calibration(source, options)[0])[0]
    finally:
        source.close()


def _check(source: SourceModel, options: CompressOptions) -> tuple[CompressPlan, Form, FormPlan]:
    form = form_named(source.form)
    form_plan = form.plan(source, options)
    return check_plan(source, options, form_plan), form, form_plan


def compress(model: str, options: CompressOptions, progress: Progress = no_progress) -> CompressResult:
    """Re-parametrize every attention layer into the form asked for and write a complete checkpoint."""
    from .cpu import huge_pages_on, kernel_huge_pages, return_freed_memory
    from .threads import governed, math_threads

    _refuse_early(model, options)
    from .integration import loading  # noqa: F401 - transformers' lazy imports land here, before the clock starts

    return_freed_memory()
    with math_threads(options.threads) as (threads, why):
        record = {"threads": threads, "why": why, "huge_pages": huge_pages_on(),
                  "huge_pages_kernel": kernel_huge_pages()}  # report.json's threads: the governor adds what changed
        return _compress(model, options, governed(progress, record), record)


def _refuse_early(model: str, options: CompressOptions) -> None:
    """The form's refusals of the options alone, from config.json's family, before transformers and the weights
    load: a forgotten size is said in a second or two. Where the form is not known yet, open_model says why."""
    from .architectures.source import form_taken

    form = form_taken(model, options.requested_form)
    if form is not None:
        form_named(form).refuse_options(options)


def _compress(model: str, options: CompressOptions, progress: Progress, threads: dict[str, Any]) -> CompressResult:
    started = time.perf_counter()
    progress = StageClock(progress)  # the report's seconds per stage are the stages the progress showed
    torch.manual_seed(options.seed)
    progress("opening the model", 0, 1)
    source = open_model(model, options.requested_form)
    progress("opening the model", 1, 1)
    try:
        options, warning = decoder_calibration(source, options)
        checked, form, form_plan = _check(source, options)  # refuse bad input before the costly calibration
        if options.refine_steps is None:
            options = options.model_copy(update={"refine_steps": form.refine_steps})
        with StagedOutput(Path(checked.output), options.overwrite, options.resume) as staged:
            result = _stages(source, form, form_plan, options, progress, staged, threads, started, warning)
    finally:
        source.close()
    return result


def _stages(source: SourceModel, form: Form, form_plan: FormPlan, options: CompressOptions, progress: StageClock,
            staged: StagedOutput, threads: dict[str, Any], started: float, warning: str | None) -> CompressResult:
    """Everything after the checks, inside the staging folder (its scratch space holds what a block-at-a-time
    calibration keeps on disk)."""
    options = within_positions(source, options)
    fitted, held_out = calibration_texts(options) if options.calibration is not None else (None, None)
    mix = None
    if fitted is not None:
        fitted, mix = mixed_calibration(source, options, fitted)
    with keeping_states(states_to_keep(source, options, held_out)) as kept:
        statistics = form.statistics(source, options, fitted, progress, staged.scratch)
    if mix is not None and statistics.calibration is not None:
        statistics.calibration["mix"] = mix
        statistics.calibration["repeated_lines_dropped"] = held_out.repeats_dropped
    estimator = form.estimator(source, options, statistics, held_out)
    if estimator is not None:
        estimator.kept = kept
    sizes, size_choice = form.sizes(source, options, form_plan, statistics, estimator, progress)
    finished = FinishedLayers(staged.finished_work, form.report_type)
    reports, files = form.convert(source, options, sizes, statistics, staged.folder, progress, finished)
    if kept is not None:
        kept.fetch()  # where they wait in the scratch folder, which goes now
    staged.drop_scratch()
    files += copy_non_weight_files(source.folder, staged.folder)
    result = CompressResult(
        model=source.source, output=str(staged.output), family=source.family.name, form=form.name,
        method=form_plan.method, layers=reports, files=[], seconds=0.0, calibration=statistics.calibration,
        rank_choice=size_choice, threads=threads, warnings=[warning] if warning else [],
    )
    form.write_record(source, reports, staged.folder, options, statistics)
    files += [CHECKPOINT_CODE] if (staged.folder / CHECKPOINT_CODE).exists() else []
    written = written_dtype(source, options.dtype)
    if written is not None:  # the weights were written in one precision: transformers loads them in it
        record_dtype(staged.folder, written)
    if options.distill_steps:  # checked with the plan: calibration texts and a language model are there
        result.distillation = distill_checkpoint(source, staged.folder, fitted, options, progress,
                                                 form.tuned_tensors(source, reports))
    if held_out is not None and estimator is not None:  # calibration lends lines to measure the result on
        progress("measuring fidelity", 0, 1)
        result.fidelity = estimator.measured(staged.folder, progress)
        result.failures = gate_failures(result.fidelity, options.thresholds)
        if held_out.seen_by_the_fit:
            result.warnings.append(f"fidelity was measured on {held_out.description}: it overstates what unseen "
                                   "text gets; give ten distinct lines or more to hold some out")
        progress("measuring fidelity", 1, 1)
    elif options.gated:  # a gate that nothing measured must not pass
        result.failures = [f"fidelity was not measured ({source.family.name} models are not run on text here): "
                           "the --min-cosine/--min-top1/--max-kl gates cannot pass"]
    if options.timing:
        result.runtime = _timed(source, staged.folder, progress)
    result.disk = weights_on_disk(source.folder, staged.folder)
    if written is not None:
        result.disk.update(written_dtype=DTYPE_NAMES[written], dtype_asked=options.dtype != "auto")
    progress("writing reports and plots", 0, 1)
    files += ["config.json"] + _write_reports(result, form, source, staged.folder, started, options.plots, progress)
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
        timed = {"skipped": f"timing failed: {first_line(error)}"}
    progress("timing inference", 1, 1)
    return timed


def _write_reports(result: CompressResult, form: Form, source: SourceModel, folder: Path, started: float,
                   plots: bool, clock: StageClock) -> list[str]:
    from .report.card import CardSource, write_model_card
    from .report.reports import write_reports

    files = []
    if plots:
        from .report.plots import write_plots

        files = write_plots(result, form, folder)
    result.seconds = time.perf_counter() - started
    result.stage_seconds = clock.stop()  # the reports themselves take milliseconds: not counted
    card = CardSource.of(result.model, source.folder, source.config)
    return files + write_reports(result, form, folder) + write_model_card(result, form, card, folder)
