"""Whether transformers can build, over the weights shipped, the model a config describes: checked before any
work, so that an input transformers could not load (or would load with random weights) is refused in one line
instead of being compressed into an output that does not load either.

The model is built as transformers builds it: its own config class reads config.json, a skeleton of the model
class is made on the meta device (no memory, no weights), and its rotary embedding is initialised on the CPU
with the config's own RoPE settings. Tensor headers are all that is read from the weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInputError, first_line
from ..io.reader import TensorReader
from .families import Family
from .naming import meta_skeleton

# Config keys that count layers (their names across families; transformers maps them onto num_hidden_layers).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "encoder_layers",
                    "decoder_layers")


def check_agreement(folder: Path, config: dict[str, Any], reader: TensorReader, family: Family,
                    query_suffix: str) -> None:
    """Refuse (BadInputError, one line) a config transformers cannot read, one whose model's tensors have other
    shapes than the weights (transformers refuses those too), one that describes attention layers the weights
    do not hold (transformers would initialise them at random), and RoPE settings that fail to build or give
    non-finite angles. `query_suffix` names a layer's query weight (".q_proj.weight"), to count layers by."""
    names = reader.names()
    _check_layer_counts(config, len(names))
    model_config = _transformers_config(folder)
    _check_rope_settings(model_config)
    skeleton = _skeleton(model_config, config)
    expected = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    to_model = _prefix_matcher(expected, getattr(skeleton, "base_model_prefix", "") or "")
    shipped = {}
    for name in names:
        key = to_model(name)
        if key is None:
            continue
        shape = tuple(reader.spec(name).shape)
        if shape != expected[key]:
            raise BadInputError(
                f"config.json disagrees with the weights: {name} is {list(shape)} in the weights but "
                f"{list(expected[key])} in the model the config describes (check its head counts, head_dim and "
                f"hidden_size); transformers would refuse to load it")
        shipped[key] = name
    unplaced = [name for name in names if name.endswith(query_suffix) and to_model(name) is None
                and family.site_of(name[: -len(query_suffix)]) is not None]
    _check_attention_layers(expected, shipped, unplaced, family, query_suffix, config)
    _check_rotary(skeleton)


# What the math reads: anything else (float8, packed integers) is a quantised format, to be dequantised first.
READABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_readable(config: dict[str, Any], reader: TensorReader, prefixes: list[str]) -> None:
    """Refuse in one line a quantised checkpoint (a quantization_config, or attention tensors in a dtype that is
    not a float the math reads), naming the fix."""
    fix = "dequantise it first (load it with transformers and save_pretrained in bfloat16), then compress that"
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
        raise BadInputError(f"config.json's quantization_config ({method}) says the weights are quantised; {fix}")
    starts = tuple(f"{prefix}." for prefix in prefixes)
    for name in reader.names():
        if name.startswith(starts):
            dtype = reader.spec(name).dtype
            if dtype not in READABLE_DTYPES:
                raise BadInputError(f"{name} is stored in {str(dtype).removeprefix('torch.')}, a quantised or "
                                    f"non-float format collab-convert does not read; {fix}")


def _check_layer_counts(config: dict[str, Any], tensors: int) -> None:
    """A layer has at least one tensor of its own, or shares another's: a count beyond the number of tensors is
    not a model, and building it would not finish. Checked before anything is built."""
    for key in LAYER_COUNT_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadInputError(f"config.json's {key} is {value!r}, not a number of layers")
        if value > max(tensors, 1):
            raise BadInputError(f"config.json's {key} is {value:,}, but the weights hold only {tensors:,} tensors; "
                                "the config does not describe these weights")


def _transformers_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001 - whatever transformers raises, it cannot read the config
        raise BadInputError(f"transformers cannot read {folder / 'config.json'}: {first_line(error)}") from None


def _rope_parameter_sets(model_config) -> list[dict]:
    parameters = getattr(model_config, "rope_parameters", None)
    if not isinstance(parameters, dict) or not parameters:
        return []
    nested = [value for value in parameters.values() if isinstance(value, dict)]  # per layer type
    return nested if nested and len(nested) == len(parameters) else [parameters]


def _check_rope_settings(model_config) -> None:
    """The RoPE type and base, named before the model is built (which would fail on them less clearly)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for parameters in _rope_parameter_sets(model_config):
        rope_type = parameters.get("rope_type", "default")
        if rope_type != "default" and (not isinstance(rope_type, str) or rope_type not in ROPE_INIT_FUNCTIONS):
            known = ", ".join(["default", *sorted(ROPE_INIT_FUNCTIONS)])
            raise BadInputError(f"config.json's rope_type {rope_type!r} is not one transformers knows ({known})")
        theta = parameters.get("rope_theta")
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                                  or not math.isfinite(theta) or theta <= 0):
            raise BadInputError(f"config.json's rope_theta is {theta!r}; the RoPE base must be a positive number")


def _skeleton(model_config, config: dict[str, Any]) -> torch.nn.Module:
    try:
        return meta_skeleton(model_config, config)
    except Exception as error:  # noqa: BLE001 - a config transformers cannot build a model from
        raise BadInputError(f"transformers cannot build the model config.json describes: {first_line(error)}") \
            from None


def _prefix_matcher(expected: dict[str, tuple], prefix: str):
    """A checkpoint name -> the model's own name for it, with the base-model prefix ("bert.", "model.") added or
    taken off as transformers does when loading; None for a tensor the model has no place for."""

    def to_model(name: str) -> str | None:
        if name in expected:
            return name
        if prefix and name.startswith(f"{prefix}.") and name[len(prefix) + 1:] in expected:
            return name[len(prefix) + 1:]
        if prefix and f"{prefix}.{name}" in expected:
            return f"{prefix}.{name}"
        return None

    return to_model


def _check_attention_layers(expected: dict[str, tuple], shipped: dict[str, str], unplaced: list[str], family: Family,
                            query_suffix: str, config: dict[str, Any]) -> None:
    """The attention layers the config builds against those the weights hold, both ways: transformers drops
    weights it has no layer for, and initialises at random a layer it has no weights for."""
    wanted = sorted(name for name in expected
                    if name.endswith(query_suffix) and family.site_of(name[: -len(query_suffix)]) is not None)
    missing = [name for name in wanted if name not in shipped]
    counts = ", ".join(f"{key}={config[key]}" for key in LAYER_COUNT_KEYS if key in config)
    if unplaced:
        raise BadInputError(
            f"the weights hold {len(wanted) - len(missing) + len(unplaced)} attention layers, but config.json "
            f"describes {len(wanted)} ({counts or 'by its settings'}); transformers would drop {unplaced[0]} and "
            "the layers after it")
    if missing:
        raise BadInputError(
            f"config.json describes {len(wanted)} attention layers ({counts or 'by its settings'}), but the weights "
            f"hold {len(wanted) - len(missing)} (no {missing[0]}); transformers would fill the rest with random "
            "weights")


def _check_rotary(skeleton: torch.nn.Module) -> None:
    """Each rotary embedding of the model rebuilt on the CPU from its config, as transformers initialises it, and
    its angles computed at the first and last trained positions: they must exist and be finite."""
    seen = set()
    for name, module in skeleton.named_modules():
        if not type(module).__name__.endswith("RotaryEmbedding") or type(module) in seen:
            continue
        seen.add(type(module))
        config = getattr(module, "config", None)
        if config is None:
            continue
        try:
            with torch.device("cpu"):
                rotary = type(module)(config=config)
            angles = _angles(rotary, config)
        except Exception as error:  # noqa: BLE001 - what transformers' RoPE set-up raises, it cannot build
            raise BadInputError(f"config.json's RoPE settings cannot be built by transformers "
                                f"({_rope_summary(config)}): {first_line(error)}") from None
        if not all(torch.isfinite(tensor).all() for tensor in angles):
            raise BadInputError(f"config.json's RoPE settings give non-finite rotary angles "
                                f"({_rope_summary(config)}); the model would compute NaN")


def _angles(rotary: torch.nn.Module, config) -> list[torch.Tensor]:
    """The rotary tables, and the angles at a short input and at one as long as the model was trained on: a
    length-dependent RoPE (longrope) computes other factors for each, so both must work."""
    last = int(getattr(config, "max_position_embeddings", 0) or 0) - 1
    probe = torch.zeros(1, dtype=torch.float32)
    layer_types = sorted({t for t in (getattr(config, "layer_types", None) or []) if isinstance(t, str)})
    tensors = [buffer for buffer in rotary.buffers() if buffer.is_floating_point()]
    scalings = [value for key, value in vars(rotary).items() if key.endswith("attention_scaling")]
    tensors += [torch.as_tensor(float(value)) for value in scalings if isinstance(value, (int, float))]
    for positions in (torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, max(last, 2)]])):
        try:
            calls = [rotary(probe, positions)]
        except TypeError:  # one rotary embedding per layer type (sliding and full attention)
            if not layer_types:  # a TypeError of the RoPE set-up itself, not of the call
                raise
            calls = [rotary(probe, positions, layer_type=t) for t in layer_types]
        for call in calls:
            tensors += [t for t in call if isinstance(t, torch.Tensor)]
    return tensors


def _rope_summary(config) -> str:
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and parameters:
        shown = {k: v for k, v in parameters.items() if not isinstance(v, (list, dict))}
        return f"rope_parameters {shown}"
    return f"rope_theta {getattr(config, 'rope_theta', None)!r}"

