"""Register with transformers when transformers is imported, so `import collab_convert` itself stays instant.

`import collab_convert` must make `AutoModel.from_pretrained(OUT)` work, which needs our quantization config
registered with transformers. Importing transformers costs seconds, and the CLI's --help, --version and usage
errors must not pay for it. So: if transformers is already imported, register now; otherwise register the
moment it is (a one-shot import hook that runs after transformers' own __init__). Nothing here imports torch
or transformers.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings


def _register() -> None:
    loading = sys.modules.get(f"{__package__}.loading")
    if loading is not None and not hasattr(loading, "register"):
        return  # transformers is being imported by loading.py itself, which registers once it is defined
    try:
        from .loading import register

        register()
    except Exception as error:  # noqa: BLE001 - never break the user's own import of transformers
        warnings.warn(f"collab-convert could not register its loader with transformers: {error}", stacklevel=2)


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def register_with_transformers() -> None:
    """Idempotent: register now if transformers is loaded, else when it is."""
    if "transformers" in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterTransformersImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformersImport())
