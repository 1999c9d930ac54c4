"""Checkpoint tensor names as the loaded model will see them.

transformers 5 renames some checkpoints while loading (ViT's legacy `encoder.layer.N.attention.attention.query`
becomes `layers.N.attention.q_proj`), and writes the legacy names back when saving. collab-convert reads
and writes in the model's own naming, so attention layers are found by module name and the collaborative
tensors land on the modules that own them. The renaming is transformers' own, taken from a skeleton of the
model built on the meta device (no memory, no weights), and only for architectures that have one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def _identity(name: str) -> str:
    return name


def meta_skeleton(model_config, config: dict[str, Any]):
    """The model class config.json names (or AutoModel's), built on the meta device: every module and tensor
    shape, no memory, no weights."""
    import torch
    import transformers
    from transformers import AutoModel

    architectures = config.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if len(architectures) == 1 else None
    with torch.device("meta"):
        return model_class(model_config) if model_class else AutoModel.from_config(model_config)


def model_renamer(folder: Path, config: dict[str, Any]) -> Callable[[str], str]:
    """checkpoint key -> the key the loaded model uses (the identity for most architectures)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        architectures = config.get("architectures") or []
        names = [*architectures, config.get("model_type")]
        if not any(name and get_checkpoint_conversion_mapping(name) for name in names):
            return _identity
        from transformers import AutoConfig
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        model = meta_skeleton(AutoConfig.from_pretrained(folder), config)
        conversions = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - no skeleton means no renaming to learn; names stay as they are
        return _identity
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if not isinstance(c, WeightRenaming)]
    if not renamings and not converters:
        return _identity

    def rename(name: str) -> str:
        return rename_source_key(name, renamings, converters)[0]

    return rename
