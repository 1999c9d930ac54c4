"""analyze(): the PCA redundancy analysis of every attention layer. Returns a result object; prints nothing."""

from __future__ import annotations

from .architectures.source import SourceModel, open_model
from .decompose.costs import candidate_ranks, collaborative_cost, original_cost
from .decompose.spectra import energy_rank, spectra
from .progress import Progress, no_progress
from .results import AnalysisResult, LayerAnalysis, rounded

ENERGY_SHARES = (0.90, 0.95, 0.99)


def analyze(model: str, ranks: list[int] | None = None, progress: Progress = no_progress) -> AnalysisResult:
    """PCA redundancy analysis of every attention layer's query/key block."""
    source = open_model(model)
    try:
        results = []
        for index, layer in enumerate(source.layers):
            progress("analyzing", index, len(source.layers))
            results.append(_analyze_layer(source, layer, ranks))
        progress("analyzing", len(source.layers), len(source.layers))
    finally:
        source.close()
    return AnalysisResult(model=model, family=source.family.name, layers=results)


def _analyze_layer(source: SourceModel, layer, ranks: list[int] | None) -> LayerAnalysis:
    spec = spectra(source.read_projections(layer).products(layer.shape.num_heads))
    views = {
        "query_projection": spec.query_projection,
        "key_projection": spec.key_projection,
        "query_unfolding": spec.query_unfolding,
        "key_unfolding": spec.key_unfolding,
        "head_unfolding": spec.head_unfolding,
    }
    return LayerAnalysis(
        name=layer.prefix,
        input_dim=layer.shape.input_dim,
        num_heads=layer.shape.num_heads,
        head_dim=layer.shape.head_dim,
        spectra={k: rounded(v) for k, v in views.items()},
        energy_ranks={
            k: {f"{share:.2f}": energy_rank(v, share) for share in ENERGY_SHARES}
            for k, v in views.items()
            if k != "head_unfolding"
        },
        original=original_cost(layer.shape, layer.has_query_bias).as_dict(),
        candidates=[collaborative_cost(layer.shape, r).as_dict() for r in ranks or candidate_ranks(layer.shape)],
    )
