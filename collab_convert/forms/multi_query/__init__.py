"""The multi-query form: a rotary decoder rewritten as a stock checkpoint of its own family (llama, mistral, qwen2,
phi3) with one key/value head of width W per layer, keys and values both compressed. It is the shared-key form
with a wider head: the shared rotary key is the key head (RoPE's per-pair frequencies said as longrope factors),
each query head's core folds into its query projection, and a value latent that every head averages rides in the
value head, each head's up-projection folded into the output projection (MLA's absorption, without a norm on the
latent). Exact at full width. It loads with transformers alone and exports to GGUF for llama.cpp.

    statistics.py    key statistics per frequency and value moments, from the weights or calibration text
    fitting.py       one key profile for the model, fitting, refining and writing each layer in stock shapes
    record.py        the plan (the head width from --kv-cache) and the stock config.json
    serving.py       which engines take a head width
    analysis.py      analyze in this form
    presentation.py  how its results read
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...architectures.source import SourceModel
from ...decompose.shared_key import KeyRanks
from ...format import MULTI_QUERY_FORM
from ...errors import BadInputError
from ...options import AnalyzeOptions, CompressOptions
from ...progress import Progress
from ...resume import FinishedLayers
from ...results import AnalysisResult, CompressResult, MultiQueryLayerReport
from ..base import Card, Form, FormPlan, Statistics, Terms
from . import analysis, presentation
from .fitting import convert_weights, key_profile
from .record import plan_layers, plan_width, write_stock_config
from .serving import engines_sentence, engines_taking
from .statistics import statistics


class MultiQueryForm(Form):
    name = MULTI_QUERY_FORM
    format_version = 0  # a stock checkpoint: no record of ours to load it by
    report_type = MultiQueryLayerReport
    # of 8 sequences each (statistics.STEP_SEQUENCES); with the warmed-up rate (shared_key_refinement.WARMUP) 130
    # steps ended below 160 steps without it on SmolLM2's dumped layers (0.54957 against 0.55190)
    refine_steps = 130
    presentation = presentation
    terms = Terms(parameters="attention parameters (query, key, value and output projections)",
                  parameters_short="attention params", parameters_line="Attention parameters",
                  cache="KV cache per token (keys and values)", cache_short="KV cache / token",
                  cache_key="kv_cache_per_token",
                  compute="attention multiply-adds per token (projections, then scores and values against n keys)",
                  compute_short="attention MACs per token")
    card = Card(relation=None, guarded=False, tags=("multi-query-attention", "kv-cache-compression"),
                loading="It is a stock checkpoint of its family: load it with transformers' `AutoModelForCausalLM` "
                        "(no collab-convert needed), or write it for llama.cpp with `collab-convert export OUT "
                        "--format gguf -o OUT.gguf`. Its provenance is under config.json's `collab_convert`.")

    def plan(self, source: SourceModel, options: CompressOptions) -> FormPlan:
        if options.rank_spread != "auto":
            raise BadInputError("--rank-spread spreads the collaborative (CP) form's --rank; the multi-query form "
                                "already spreads its budget over the layers where it keeps the most energy")
        width = plan_width(source, options)
        layer = source.layers[0]
        kept = (f"{width / layer.full_rank:.0%} of the KV cache: one key/value head of {width} per layer (it has "
                f"{layer.kv_heads} of {layer.shape.head_dim}); {engines_sentence(width)}")
        return FormPlan(plan_layers(source, width), kept, None, width)

    def statistics(self, source: SourceModel, options: CompressOptions, texts: list[str] | None, progress: Progress,
                   scratch: Path | None = None) -> Statistics:
        keys, records, calibration = statistics(source, options, texts, progress, scratch)
        return Statistics(keys, calibration, records)

    def sizes(self, source: SourceModel, options: CompressOptions, plan: FormPlan, statistics: Statistics,
              estimator, progress: Progress) -> tuple[dict[str, Any], dict[str, Any] | None]:
        profile = key_profile(source, statistics.per_layer, plan.size)
        choice = {"mode": "kv-cache budget", "head_dim": plan.size,
                  "share_of_kv_cache": round(plan.size / max(layer.full_rank for layer in source.layers), 4),
                  "key_frequency_ranks": list(profile.frequency_ranks),
                  "spread": "one key profile for the whole model (RoPE factors are global), over the frequencies "
                            "where the most score energy of all layers stays; the values take the same width",
                  "engines": engines_taking(plan.size)}
        return {layer.prefix: profile for layer in source.layers}, choice

    def convert(self, source: SourceModel, options: CompressOptions, sizes: dict[str, Any], statistics: Statistics,
                folder: Path, progress: Progress, finished: FinishedLayers):
        profile = next(iter(sizes.values()))
        return convert_weights(source, options, folder, progress, profile.width, profile, statistics.records,
                               finished, refining=statistics.calibration is not None and bool(options.refine_steps))

    def write_record(self, source: SourceModel, reports: list, folder: Path, options: CompressOptions,
                     statistics: Statistics) -> None:
        profile = KeyRanks(tuple(reports[0].frequency_ranks), 0)
        write_stock_config(source, reports[0].rank, profile, folder)

    def tuned_tensors(self, source: SourceModel, reports: list) -> list[str] | None:
        """Distillation tunes the stock projections this form wrote."""
        return [spec.name for layer in source.layers
                for spec in source.layout.stock_specs(source.reader, layer, reports[0].rank)]

    def analyze(self, source: SourceModel, options: AnalyzeOptions, settings: CompressOptions,
                progress: Progress) -> AnalysisResult:
        return analysis.analyze(source, options, settings, progress, self.name)

    def next_step(self, result: CompressResult) -> str:
        return (f"python -c \"from transformers import AutoModelForCausalLM as M; m = M.from_pretrained("
                f"'{result.output}')\" (a stock checkpoint: no collab-convert needed); for llama.cpp: collab-convert "
                f"export {result.output} --format gguf -o {result.output}.gguf")


FORM = MultiQueryForm()
