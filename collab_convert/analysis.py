"""analyze(): the redundancy analysis of every attention layer in the form asked for (forms/), and what each
candidate size would give. Returns a result object; prints nothing."""

from __future__ import annotations

from pathlib import Path

from .architectures.source import open_model
from .forms import form_named
from .options import DEFAULT_METHOD, AnalyzeOptions, CompressOptions
from .progress import Progress, no_progress
from .results import AnalysisResult
from .stages import check_device, within_positions


def analyze(model: str, options: AnalyzeOptions | None = None, progress: Progress = no_progress, *,
            ranks: list[int] | None = None) -> AnalysisResult:
    """Spectra and energy ranks of every attention layer's query/key block, costs at candidate sizes, and the
    error a fit at each gives. In the CP form, with calibration text, the logit error and the embedding cosine
    measured on held-out lines; with a target cosine, the smallest rank that reaches it. Called as compress is:
    analyze(MODEL, AnalyzeOptions(...)); `ranks` alone is a shorthand for AnalyzeOptions(ranks=ranks)."""
    from .threads import governed, math_threads

    options = options or AnalyzeOptions(ranks=ranks)
    check_device(options.device)
    # as compress: the cores idle when the run starts, not torch's default (on a busy machine two threads that
    # wait on each other made one 384 x 384 SVD take 18 s instead of 0.2 s)
    with math_threads(options.threads) as (threads, why):
        return _analyze(model, options, governed(progress, {"threads": threads, "why": why}))


def _analyze(model: str, options: AnalyzeOptions, progress: Progress) -> AnalysisResult:
    progress("opening the model", 0, 1)
    source = open_model(model, options.form)
    progress("opening the model", 1, 1)
    try:
        settings = within_positions(source, fit_settings(options))
        return form_named(source.form).analyze(source, options, settings, progress)
    finally:
        source.close()


def fit_settings(options: AnalyzeOptions) -> CompressOptions:
    """The settings compress would fit with (its defaults), for predictions; nothing is written anywhere."""
    return CompressOptions(rank="auto", output=Path("unused"), method=DEFAULT_METHOD, refine_steps=0,
                           **options.model_dump(exclude={"ranks", "plot"}))
