"""What a form is: everything the pipeline (compression.py, analysis.py) and the renderers (cli/, report/) ask of
one way of compressing attention layers. A form plans the sizes of its layers from the options, gathers the
statistics it fits from, fits and writes each layer, records itself in config.json, analyzes a model, and says
how its results read. The pipeline never asks which form it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ..architectures.source import SourceModel
from ..options import AnalyzeOptions, CompressOptions
from ..progress import Progress
from ..resume import FinishedLayers
from ..results import AnalysisResult, CompressResult, LayerAnalysis, LayerReport, RankPrediction, Table

ENERGY_SHARES = (0.90, 0.95, 0.99)  # the shares of energy analyze counts dimensions for


@dataclass(frozen=True)
class Terms:
    """What a form's costs are called in the summary, report.md and the terminal, and which cache figure of a
    layer's costs (decompose/costs.py) they count."""

    parameters: str = "query/key parameters"
    parameters_short: str = "Q/K params"
    parameters_line: str = "Q/K parameters"
    cache: str = "key cache per token (decoders)"
    cache_short: str = "key cache / token"
    cache_key: str = "key_cache_per_token"
    compute: str = "query/key multiply-adds per token (projections plus scores against n keys)"
    compute_short: str = "Q/K MACs per token"


@dataclass(frozen=True)
class Card:
    """What a form's model card says of how the checkpoint relates to its base and how it loads."""

    relation: str | None = "quantized"  # the Hub's base_model_relation: it loads through a quantization config
    guarded: bool = True  # transformers alone refuses it (format.load_guard): it needs our loader or carried code
    tags: tuple[str, ...] = ("collaborative-attention",)
    loading: str = ("Load it after `import collab_convert` with the usual Auto classes, or with "
                    "`collab_convert.load_model`.")


@dataclass
class FormPlan:
    """A form's checked plan: each layer's size and query/key parameters before and after, what the form keeps in
    words, the decomposition method it records (None: it has none), and what the form itself carries on (e.g. the
    shared key's average width), computed once."""

    layers: list[dict[str, Any]]
    description: str
    method: str | None = None
    size: Any = None


@dataclass
class Statistics:
    """What a form fits from beyond the weights, by layer (None: the weights alone), and what the report says of
    the calibration that gave it (None: no calibration)."""

    per_layer: Mapping | None = None
    calibration: dict[str, Any] | None = None
    records: Mapping | None = field(default=None)  # calibration records a form refines from, where it keeps them


class Form(ABC):
    """One form. Subclasses implement every abstract method; forms/__init__.py registers an instance by name."""

    name: str
    format_version: int  # the lowest config.json record version that describes this form (format.py)
    report_type: type[LayerReport]  # what convert reports per layer, and --resume reads back
    # --refine-steps when not given: Adam steps per layer, on average (measured per form, docs/benchmarks.md)
    refine_steps: int = 200

    # --- compress -----------------------------------------------------------------------------------------------
    def refuse_options(self, options: CompressOptions) -> None:
        """Refuse what the options alone tell this form cannot honour, before any model is opened: a user who left
        out a size hears it in a second or two, not after transformers has loaded. plan() refuses it again."""

    @abstractmethod
    def plan(self, source: SourceModel, options: CompressOptions) -> FormPlan:
        """Refuse options this form cannot honour (one line each); the plan of every layer."""

    @abstractmethod
    def statistics(self, source: SourceModel, options: CompressOptions, texts: list[str] | None, progress: Progress,
                   scratch: Path | None = None) -> Statistics:
        """What the fits need beyond the weights: from calibration `texts` where given. With a `scratch` folder,
        large statistics may wait on disk (io/spill.py)."""

    def estimator(self, source: SourceModel, options: CompressOptions, statistics: Statistics, held_out):
        """The fidelity estimator a run needs (predict.py), or None: by default one that measures the finished
        checkpoint on held-out calibration lines, where there are some and the model runs on text."""
        from ..predict import FidelityEstimator, can_measure

        if held_out is None or not can_measure(source):
            return None
        return FidelityEstimator(source, options.model_copy(update={"refine_steps": 0}), held_out)

    @abstractmethod
    def sizes(self, source: SourceModel, options: CompressOptions, plan: FormPlan, statistics: Statistics,
              estimator, progress: Progress) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Each layer's size (the form's own kind of value), and how they were chosen, for the report."""

    @abstractmethod
    def convert(self, source: SourceModel, options: CompressOptions, sizes: dict[str, Any], statistics: Statistics,
                folder: Path, progress: Progress, finished: FinishedLayers) -> tuple[list[LayerReport], list[str]]:
        """Every tensor of the input to the output, each attention layer fitted and written in this form; the
        layers' reports and the files written."""

    @abstractmethod
    def write_record(self, source: SourceModel, reports: list[LayerReport], folder: Path, options: CompressOptions,
                     statistics: Statistics) -> None:
        """config.json: the original's, with what was done, so that the checkpoint says how to load it."""

    def tuned_tensors(self, source: SourceModel, reports: list[LayerReport]) -> list[str] | None:
        """The checkpoint tensors --distill-steps tunes; None: the collaborative modules' own parameters."""
        return None

    # --- analyze ------------------------------------------------------------------------------------------------
    @abstractmethod
    def analyze(self, source: SourceModel, options: AnalyzeOptions, settings: CompressOptions,
                progress: Progress) -> AnalysisResult:
        """Spectra and energy ranks of every layer in this form, and what candidate sizes cost and give.
        `settings`: the options compress would fit with, for the fits analyze predicts from."""

    # --- how results read: the form's presentation module (functions of these names) ----------------------------
    presentation: ModuleType
    terms: Terms = Terms()
    card: Card = Card()

    def what_it_does(self) -> tuple[str, str]:
        """For the model card: what every layer became, and how it works, in a clause each."""
        return self.presentation.what_it_does()

    def rank_sentence(self, result: CompressResult) -> str:
        """The summary's first sentence: the sizes kept, against the full size."""
        return self.presentation.rank_sentence(result)

    def error_line(self, result: CompressResult) -> str:
        """The summary's line on the error the fits left, named for what it measures."""
        return self.presentation.error_line(result)

    def compute_line(self, result: CompressResult) -> str:
        """The summary's line on query/key compute per token against the original."""
        return self.presentation.compute_line(result)

    def layer_columns(self, result: CompressResult) -> tuple[list[str], list[list[str]]]:
        """The form's own columns of the per-layer tables (CLI and report.md), and each layer's cells."""
        return self.presentation.layer_columns(result)

    def report_notes(self, result: CompressResult) -> list[str]:
        """report.md's lines after the per-layer table: what its figures mean, and anything the form adds."""
        return self.presentation.report_notes(result)

    def analysis_tables(self, result: AnalysisResult) -> list[Table]:
        """analyze's tables before the candidates, for the terminal."""
        return self.presentation.analysis_tables(result)

    def analysis_advice(self, result: AnalysisResult) -> str:
        """What analyze's figures mean, and what to run next."""
        return self.presentation.analysis_advice(result)

    def next_step(self, result: CompressResult) -> str:
        """What to run with the checkpoint: it loads through our quantizer."""
        return f"python -c \"import collab_convert; m = collab_convert.load_model('{result.output}')\""

    def spectra(self, layers) -> list[tuple[str, list[tuple[str, list[float]]]]]:
        """The spectra plot's panels, (title, [(layer, singular values)]), from layer reports or an analysis's."""
        return self.presentation.spectra(layers)


def predictions(layers: list[LayerAnalysis], sizes: list[int]) -> list[RankPrediction]:
    """What the whole model gets at each candidate size: layers' candidates summed, errors averaged."""
    found = []
    for index, size in enumerate(sizes):
        at = [layer.candidates[index] for layer in layers]
        logit = [c["logit_error"] for c in at]
        found.append(RankPrediction(
            rank=size,
            parameters=sum(c["parameters"] for c in at),
            parameters_before=sum(layer.original["parameters"] for layer in layers),
            key_cache_per_token=sum(c["key_cache_per_token"] for c in at),
            key_cache_before=sum(layer.original["key_cache_per_token"] for layer in layers),
            mean_relative_error=sum(c["relative_error"] for c in at) / len(at),
            mean_logit_error=None if None in logit else sum(logit) / len(logit),
        ))
    return found


def candidate_table(result: AnalysisResult) -> Table:
    """analyze's candidates, all layers together: their query/key parameters, key cache and errors (with
    calibration, the logit error and the measured cosine)."""
    calibrated = any(p.mean_logit_error is not None for p in result.predictions)
    measured = any(p.cosine_mean is not None for p in result.predictions)
    first = result.predictions[0] if result.predictions else None
    cached = bool(first and first.key_cache_before)  # an encoder caches nothing: no column of zeros
    columns = ["rank", "Q/K params"] + (["key cache/token"] if cached else []) + ["error"]
    columns += (["logit error"] if calibrated else []) + (["cosine mean/p1"] if measured else [])
    table = Table(f"Candidate ranks, all {len(result.layers)} layers together", columns)
    if first:
        row = ["original", f"{first.parameters_before:,}"] + ([f"{first.key_cache_before:,}"] if cached else [])
        table.rows.append(row + ["0"] + (["0"] if calibrated else []) + (["1/1"] if measured else []))
    for p in result.predictions:
        row = [str(p.rank), f"{p.parameters:,} ({100 * p.parameters / p.parameters_before:.0f}%)"]
        row += [f"{p.key_cache_per_token:,}"] if cached else []
        row += [f"{p.mean_relative_error:.3f}"]
        row += [f"{p.mean_logit_error:.3f}"] if calibrated else []
        row += [f"{p.cosine_mean:.4f}/{p.cosine_p01:.4f}"] if measured else []
        table.rows.append(row)
    return table
