"""collab-convert: analyze attention redundancy and re-parametrize heads into collaborative attention."""

from .version import __version__
from .integration.loading import load_model, register  # noqa: E402

register()

from .analyze import analyze  # noqa: E402
from .compress import compress  # noqa: E402
from .modeling.torch_mha import collaborate_multihead_attention  # noqa: E402
from .options import AnalyzeOptions, CompressOptions  # noqa: E402
from .results import AnalysisResult, CompressResult  # noqa: E402

__all__ = [
    "AnalysisResult",
    "AnalyzeOptions",
    "CompressOptions",
    "CompressResult",
    "analyze",
    "collaborate_multihead_attention",
    "compress",
    "load_model",
    "__version__",
]
