"""The CP form (collaborative multi-head attention): every head scores with one shared query and one shared key
projection of rank R, through a mixing vector of its own, plus a content bias where the query had a bias.
Fitted by a decomposition method (`--method`, decompose/methods.py: the registry belongs to this form) on the
stacked per-head products; refined against the original's attention with calibration.

    fitting.py       fit, refine and write each layer; the config.json record
    statistics.py    input statistics on calibration text; energy ranks
    ranks.py         the plan, and the ranks: fixed, energy shares, or a fidelity target
    analysis.py      analyze in this form
    presentation.py  how its results read
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...architectures.source import SourceModel
from ...format import COLLABORATIVE_FORM
from ...options import AnalyzeOptions, CompressOptions
from ...progress import Progress
from ...resume import FinishedLayers
from ...results import AnalysisResult, CollaborativeLayerReport
from ..base import Form, FormPlan, Statistics
from . import analysis, presentation
from .fitting import convert_weights, write_format_config
from .ranks import choose_ranks, estimator, plan_layers, refuse_options
from .statistics import calibrate


class CollaborativeForm(Form):
    name = COLLABORATIVE_FORM
    format_version = 1
    report_type = CollaborativeLayerReport
    presentation = presentation

    def refuse_options(self, options: CompressOptions) -> None:
        refuse_options(options)

    def plan(self, source: SourceModel, options: CompressOptions) -> FormPlan:
        size = f"rank {options.rank}"
        if options.rank != "auto" and options.spread == "energy":  # each layer's rank is known after calibrating
            size += " on average, spread over the layers by energy"
        return FormPlan(plan_layers(source, options), size, options.method, options.rank)

    def statistics(self, source: SourceModel, options: CompressOptions, texts: list[str] | None, progress: Progress,
                   scratch: Path | None = None) -> Statistics:
        if texts is None:
            return Statistics()
        metrics, calibration = calibrate(source, options, texts, progress, scratch=scratch)
        return Statistics(metrics, calibration)

    def estimator(self, source: SourceModel, options: CompressOptions, statistics: Statistics, held_out):
        return estimator(source, options, statistics.per_layer, held_out)

    def sizes(self, source: SourceModel, options: CompressOptions, plan: FormPlan, statistics: Statistics,
              estimator, progress: Progress) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return choose_ranks(source, options, statistics.per_layer, estimator, progress)

    def convert(self, source: SourceModel, options: CompressOptions, sizes: dict[str, Any], statistics: Statistics,
                folder: Path, progress: Progress, finished: FinishedLayers):
        return convert_weights(source, options, folder, progress, sizes, statistics.per_layer, finished)

    def write_record(self, source: SourceModel, reports: list, folder: Path, options: CompressOptions,
                     statistics: Statistics) -> None:
        calibrated = statistics.per_layer is not None
        write_format_config(source, reports, folder, options.method + ("+calibrated" if calibrated else ""),
                            calibrated=calibrated)

    def analyze(self, source: SourceModel, options: AnalyzeOptions, settings: CompressOptions,
                progress: Progress) -> AnalysisResult:
        return analysis.analyze(source, options, settings, progress, self.name)


FORM = CollaborativeForm()
