"""The shared-key form (Tucker): every head keeps its query projection, and one shared key of W numbers per token
replaces the key heads; head i reads it through a core of its own. Where RoPE rotates the keys (rotary decoders)
the shared key is shared per frequency, so RoPE stays exact; with absolute or relative positions (GPT-2, OPT,
GPTBigCode, BART, T5) nothing rotates. Sized by the key cache (`--key-cache`, or `--rank` as numbers per token),
spread over layers and frequencies where the most score energy stays.

    statistics.py    query energies and key moments, from the weights or calibration text
    fitting.py       the plan, the budget, fitting, refining and writing each layer; the config.json record
    analysis.py      analyze in this form
    presentation.py  how its results read
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...architectures.source import SourceModel
from ...errors import BadInputError
from ...format import SHARED_KEY_FORM
from ...options import DEFAULT_METHOD, AnalyzeOptions, CompressOptions
from ...progress import Progress
from ...resume import FinishedLayers
from ...results import AnalysisResult, SharedKeyLayerReport
from ..base import Form, FormPlan, Statistics
from . import analysis, presentation
from .fitting import allocate_ranks, convert_weights, layer_width, plan_layers, write_shared_key_config
from .statistics import calibrated_statistics, model_weight_statistics


class SharedKeyForm(Form):
    name = SHARED_KEY_FORM
    format_version = 2
    report_type = SharedKeyLayerReport
    refine_steps = 200  # of 4 sequences each (statistics.STEP_SEQUENCES): 160 of 8 took 12-20% longer
    presentation = presentation

    def plan(self, source: SourceModel, options: CompressOptions) -> FormPlan:
        if options.rank_spread != "auto":
            raise BadInputError("--rank-spread spreads the collaborative (CP) form's --rank; the shared-key form "
                                "already spreads its budget over the layers where it keeps the most energy")
        if options.method != DEFAULT_METHOD:
            raise BadInputError(f"--method chooses the collaborative (CP) form's decomposition; the shared-key form "
                                f"fits its key by weighted PCA: drop --method {options.method}")
        width = layer_width(source, options)
        kept = f"{width} numbers per token and layer on average"
        kept = f"{options.key_cache:.0%} of the key cache ({kept})" if options.key_cache is not None else \
            f"a shared key of {kept}"
        return FormPlan(plan_layers(source, width), kept, None, width)

    def statistics(self, source: SourceModel, options: CompressOptions, texts: list[str] | None, progress: Progress,
                   scratch: Path | None = None) -> Statistics:
        if texts is None:
            return Statistics(model_weight_statistics(source, scratch))
        statistics, records, calibration = calibrated_statistics(source, options, texts, progress, scratch)
        return Statistics(statistics, calibration, records)

    def sizes(self, source: SourceModel, options: CompressOptions, plan: FormPlan, statistics: Statistics,
              estimator, progress: Progress) -> tuple[dict[str, Any], dict[str, Any] | None]:
        width = plan.size
        choice = {"mode": "key-cache budget", "numbers_per_token_and_layer": width,
                  "share_of_key_cache": round(width / max(layer.full_rank for layer in source.layers), 4),
                  "spread": f"over layers{' and rotary frequencies' if source.layout.rotates else ''}, "
                            "where the most score energy stays"}
        return allocate_ranks(source, statistics.per_layer, width), choice

    def convert(self, source: SourceModel, options: CompressOptions, sizes: dict[str, Any], statistics: Statistics,
                folder: Path, progress: Progress, finished: FinishedLayers):
        return convert_weights(source, options, folder, progress, sizes, statistics.per_layer, statistics.records,
                               finished)

    def write_record(self, source: SourceModel, reports: list, folder: Path, options: CompressOptions,
                     statistics: Statistics) -> None:
        write_shared_key_config(source, reports, folder, self.format_version)

    def analyze(self, source: SourceModel, options: AnalyzeOptions, settings: CompressOptions,
                progress: Progress) -> AnalysisResult:
        return analysis.analyze(source, options, settings, progress, self.name)


FORM = SharedKeyForm()
