"""collab-convert: analyze attention redundancy and re-parametrize heads into collaborative attention."""

__version__ = "0.1.0"

from .integration import load_model, register  # noqa: E402

register()

from .pipeline import AnalysisResult, CompressOptions, CompressResult, analyze, compress  # noqa: E402
from .torch_mha import collaborate_multihead_attention  # noqa: E402

__all__ = [
    "AnalysisResult",
    "CompressOptions",
    "CompressResult",
    "analyze",
    "collaborate_multihead_attention",
    "compress",
    "load_model",
    "__version__",
]
