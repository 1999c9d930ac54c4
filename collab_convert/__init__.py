"""collab-convert: analyze attention redundancy and re-parametrize heads into collaborative attention.

Importing the package is instant: the API below loads on first use, and the loader registers with
transformers as soon as transformers is imported (integration/hook.py), so after `import collab_convert`
`AutoModel.from_pretrained(OUT)` loads a collaborative checkpoint.
"""

from __future__ import annotations

import importlib

from .integration.hook import register_with_transformers
from .version import __version__

# public name -> module that defines it
_API = {
    "AnalysisResult": "results",
    "AnalyzeOptions": "options",
    "CompressOptions": "options",
    "CompressResult": "results",
    "ExportOptions": "options",
    "ExportResult": "results",
    "analyze": "analysis",
    "collaborate_multihead_attention": "modeling.torch_mha",
    "compress": "compression",
    "export": "exporting",
    "load_model": "integration.loading",
}

__all__ = [*_API, "__version__"]

register_with_transformers()


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'collab_convert' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
