"""Loading collaborative checkpoints through transformers' own from_pretrained.

The checkpoint records the transform under config.json's `quantization_config` (quant_method
"collaborative"), next to untouched `architectures` and `model_type`. Importing collab_convert registers a
quantization config and quantizer for that method; the quantizer swaps the recorded attention modules for
their collaborative form while the model skeleton is still empty, so the weights load by name. This uses
transformers' public registration API and no remote code.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, AutoModel
from transformers.quantizers import (
    HfQuantizer,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from .architectures import FAMILIES
from .modeling import collaborate_model

QUANT_METHOD = "collaborative"
FORMAT_VERSION = 1


class CollaborativeConfig(QuantizationConfigMixin):
    """What collab-convert did to the checkpoint: enough to rebuild the modules before loading."""

    def __init__(
        self,
        family: str,
        layers: dict[str, dict[str, Any]],
        format_version: int = FORMAT_VERSION,
        tool_version: str | None = None,
        method: str | None = None,
        **kwargs: Any,
    ):
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.family = family
        self.layers = layers
        self.tool_version = tool_version
        self.method = method
        for key, value in kwargs.items():  # keep fields written by newer versions
            if key != "quant_method":
                setattr(self, key, value)
        if int(format_version) > FORMAT_VERSION:
            raise ValueError(
                f"this checkpoint uses collaborative format {format_version}; upgrade collab-convert to load it"
            )

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["quant_method"] = QUANT_METHOD
        return data

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()


class CollaborativeQuantizer(HfQuantizer):
    requires_calibration = False

    def __init__(self, quantization_config: CollaborativeConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)

    def _process_model_before_weight_loading(self, model, **kwargs):
        family = next(f for f in FAMILIES if f.name == self.quantization_config.family)
        collaborate_model(model, family, self.quantization_config.layers, getattr(model, "base_model_prefix", None))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        return model

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    """Idempotent: importing collab_convert twice, or reloading it, must not fail."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(CollaborativeConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(CollaborativeQuantizer)


def load_model(path, auto_class=None, **kwargs):
    """Load a collaborative checkpoint (or any model) with the Auto class its config names.

    `auto_class` defaults to the task-specific class when config.json names one architecture transformers
    knows (BertForMaskedLM -> that class), else AutoModel.
    """
    register()
    if auto_class is None:
        config = AutoConfig.from_pretrained(path)
        import transformers

        architectures = getattr(config, "architectures", None) or []
        auto_class = getattr(transformers, architectures[0], None) if len(architectures) == 1 else None
        auto_class = auto_class or AutoModel
    return auto_class.from_pretrained(path, **kwargs)
