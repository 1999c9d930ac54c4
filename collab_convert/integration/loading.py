"""Loading collaborative checkpoints through transformers' own from_pretrained.

The checkpoint records the transform under config.json's `quantization_config` (quant_method
"collaborative"), next to untouched `architectures`; a guarded one declares model_type "collaborative_<original>"
and the record keeps the original's (format.original_config). Importing collab_convert registers a quantization
config and quantizer for that method, and each such model_type as one that reads as the original's config; the
quantizer swaps the recorded attention modules for their collaborative form while the model skeleton is still
empty, so the weights load by name. This uses transformers' public registration API and no remote code.
"""

from __future__ import annotations

import re

import torch
from transformers import AutoConfig, AutoModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
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

from ..architectures.families import FAMILIES
from ..architectures.lookup import family_named
from ..errors import BadInputError, first_line
from ..format import QUANT_METHOD, FormatConfig, guarded_model_type, original_config
from ..modeling.swap import collaborate_model


class CollaborativeConfig(FormatConfig, QuantizationConfigMixin):
    """The format's record (format.py), as the quantization config transformers reads and writes."""


class CollaborativeQuantizer(HfQuantizer):
    requires_calibration = False

    def __init__(self, quantization_config: CollaborativeConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)

    def _process_model_before_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        base = getattr(model, "base_model_prefix", None)
        converted = collaborate_model(model, family_named(config.family), config.layers, base)
        self._converted = converted
        _check_complete(model, converted, kwargs.get("checkpoint_files") or [], base)
        _ignore_load_guards(model, converted, base)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        """A tampered checkpoint must not load silently wrong: every collaborative parameter must be finite."""
        modules = dict(model.named_modules())
        for name in getattr(self, "_converted", []):
            for parameter_name, parameter in modules[name].named_parameters():
                if parameter.is_meta:  # offloaded to disk (a fidelity measurement of our own output): read on use
                    continue
                if parameter.is_floating_point() and not bool(torch.isfinite(parameter).all()):
                    raise ValueError(f"{name}.{parameter_name} holds NaN or Inf values: the collaborative checkpoint is "
                                     "corrupt; compress the original model again")
        return model

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def _check_complete(model, converted: list[str], checkpoint_files: list[str], base: str | None) -> None:
    """Every parameter of a converted module must be in the checkpoint: transformers would otherwise initialise a
    missing one at random and load on. Read from the safetensors headers, before any weight is loaded."""
    from safetensors import safe_open

    from ..modeling.collaborative import strip_prefix

    stored = set()
    for file in checkpoint_files:
        if not str(file).endswith(".safetensors"):
            return  # legacy pickles: nothing to read without loading them
        with safe_open(str(file), framework="pt") as handle:
            stored.update(strip_prefix(key, base) for key in handle.keys())
    modules = dict(model.named_modules())
    for name in converted:
        for parameter_name, _ in modules[name].named_parameters():
            wanted = strip_prefix(f"{name}.{parameter_name}", base)
            if stored and wanted not in stored:
                raise ValueError(f"the collaborative checkpoint has no {wanted}: it is incomplete or was altered; "
                                 "compress the original model again")


def _ignore_load_guards(model, converted: list[str], base: str | None) -> None:
    """Each converted module's load guard (format.load_guard: a replaced projection's name, holding nothing) is no
    parameter of the converted model: not a key to warn of."""
    from ..modeling.collaborative import strip_prefix

    patterns = {rf"(^|\.){re.escape(strip_prefix(name, base))}\.\w+\.weight$" for name in converted}
    model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | patterns


def _read_as_original(config_dict, **kwargs):
    original = original_config(config_dict)
    if original is config_dict or original["model_type"] not in CONFIG_MAPPING:
        raise BadInputError(f"config.json's model_type {config_dict.get('model_type')!r} is a collaborative "
                            "checkpoint's, but its record names no original model type transformers knows: the "
                            "checkpoint was altered; compress the original model again")
    return CONFIG_MAPPING[original["model_type"]].from_dict(original, **kwargs)


def _register_guarded_model_types() -> None:
    """A guarded checkpoint declares model_type "collaborative_<original>" (format.MODEL_TYPE_PREFIX), so that
    transformers alone refuses it. Here each such type reads as the original's config, record and all: AutoConfig,
    and so AutoModel, sentence-transformers and pipelines, load it through the quantizer above, with no remote
    code and no flag."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for model_type in sorted({t for family in FAMILIES for t in family.model_types} & set(CONFIG_MAPPING_NAMES)):
        name = guarded_model_type(model_type)
        if name not in CONFIG_MAPPING:
            reads = classmethod(lambda cls, config_dict, **kwargs: _read_as_original(config_dict, **kwargs))
            reader = type(f"Guarded{CONFIG_MAPPING_NAMES[model_type]}", (PreTrainedConfig,),
                          {"model_type": name, "from_dict": reads})
            AutoConfig.register(name, reader)


def register() -> None:
    """Idempotent: importing collab_convert twice, or reloading it, must not fail."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(CollaborativeConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(CollaborativeQuantizer)
    _register_guarded_model_types()


def for_measuring(model):
    """The model in eval mode without a KV cache: a decoder's forward fills one by default, holding every layer's
    keys and values to the end of the pass (measured: +12 MB a block on a GPT-2-medium-shaped model at 12 x 128
    tokens), memory that grows with depth and serves nothing when a pass is only measured."""
    model.config.use_cache = False
    return model.eval()


# Files a tokenizer is read from: a folder with none of them has no tokenizer (transformers may still build an
# empty one from the config, which turns every word into the unknown token).
TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.spm", "*.tiktoken", "added_tokens.json",
                   "special_tokens_map.json")


# Tokenizers read in this process, by folder and the size and time of its tokenizer files. Shared: whoever changes
# one (a pad token) changes a copy.
_TOKENIZERS: dict = {}


def load_tokenizer(folder, needed_for: str):
    """The model's tokenizer, or a one-line error saying what needed it (`needed_for`, e.g. "calibration") and
    what to do."""
    from pathlib import Path

    from transformers import AutoTokenizer

    folder = Path(folder)
    fix = "copy the tokenizer files of the model it came from into the folder"
    if folder.is_dir() and not any(path.is_file() for pattern in TOKENIZER_FILES for path in folder.glob(pattern)):
        raise BadInputError(f"{needed_for} needs the model's tokenizer, but {folder} has none (no tokenizer.json, "
                            f"vocab or tokenizer.model file); {fix}")
    files = tuple(sorted((path.name, path.stat().st_size, path.stat().st_mtime_ns)
                         for pattern in TOKENIZER_FILES for path in folder.glob(pattern) if path.is_file()))
    key = (str(folder.resolve()), files)
    if key in _TOKENIZERS:  # a calibrated run asks for it at several stages: read it once (0.2-1.3 s for SmolLM2)
        return _TOKENIZERS[key]
    try:
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(folder)
        return _TOKENIZERS[key]
    except Exception as error:  # noqa: BLE001 - many ways for a tokenizer to be missing or broken
        raise BadInputError(f"{needed_for} needs the model's tokenizer, which could not be loaded from {folder} "
                            f"({first_line(error).rstrip(':')}); {fix}") from None


def load_model(path, auto_class=None, **kwargs):
    """Load a collaborative checkpoint (or any model) with the Auto class its config names.

    `auto_class` defaults to the task-specific class when config.json names one architecture transformers
    knows (BertForMaskedLM -> that class), else AutoModel.
    """
    register()
    # read as the original model's config (a guarded checkpoint declares a model_type of its own)
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    if auto_class is None:
        import transformers

        architectures = getattr(config, "architectures", None) or []
        auto_class = getattr(transformers, architectures[0], None) if len(architectures) == 1 else None
        auto_class = auto_class or AutoModel
    return auto_class.from_pretrained(path, config=config, **kwargs)


register()  # importing this module first imports transformers; the import hook leaves registering to here
