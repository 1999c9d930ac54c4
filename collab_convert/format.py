"""The collaborative checkpoint format, in one place: tensor names, shapes and values, and the record of the
transform in config.json's `quantization_config`.

For each attention module P recorded in the config, the query and key projections are gone and four tensors
take their place:

    P.shared_query.weight  (R, D_in)    x -> x W~_Q, shared by every head (nn.Linear layout)
    P.shared_key.weight    (R, D_in)    y -> y W~_K, shared by every head
    P.mixing               (N_h, R)     head i scores with x W~_Q diag(mixing[i]) W~_K^T y^T
    P.content_bias         (N_h, D_in)  head i adds y . content_bias[i] (what the query bias did); left out,
                                        and recorded as "content_bias": false, where it would be all zeros
                                        (no query bias and no calibration): a cache then holds R numbers

Where a family fuses query, key and value into one projection, the value part stays as
P.value_projection.weight / .bias, in the original layout. The writer (compress), the loader (the quantizer
in integration/) and the docs (docs/format.md) all read these names from here. Plain Python and torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .io.headers import TensorSpec
from .version import __version__

QUANT_METHOD = "collaborative"
# The newest record this tool writes and reads. A record states the lowest version that describes it: CP records
# are unchanged since 1; shared-key records name their form "shared-key" since 2 (an older reader would take
# such a layer for a CP one, so it must refuse it).
FORMAT_VERSION = 2

# The forms, as options, families and records name them.
COLLABORATIVE_FORM = "collaborative"  # the CP form: heads share one query and one key, each with a mixing vector
SHARED_KEY_FORM = "shared-key"  # heads keep their queries and share one key (per RoPE frequency, where it rotates)
# A stock checkpoint of the same family with one key/value head: keys and values both compressed. It records
# nothing in quantization_config (it loads without collab-convert), only its provenance (MULTI_QUERY_RECORD).
MULTI_QUERY_FORM = "multi-query"
FORMS = (COLLABORATIVE_FORM, SHARED_KEY_FORM, MULTI_QUERY_FORM)
MULTI_QUERY_RECORD = "collab_convert"  # config.json key of the multi-query form's provenance; transformers ignores it
_OLD_FORM_NAMES = {"rotary-shared-key": SHARED_KEY_FORM}  # what format 1 records called the shared-key form

# The modeling code a guarded checkpoint carries (integration/checkpoint_code.py), named by config.json's
# auto_map: transformers runs it only with trust_remote_code=True.
CHECKPOINT_CODE = "collaborative_modeling.py"
# A guarded checkpoint declares model_type "collaborative_<original>", which transformers does not know: alone it
# refuses to load it (naming trust_remote_code) rather than build its own class around tensors it cannot place,
# and no flag (ignore_mismatched_sizes) gets past that. The record keeps the original model_type; collab-convert
# registers every such type to read as the original's config (integration/loading.py).
MODEL_TYPE_PREFIX = "collaborative_"

SHARED_QUERY = "shared_query.weight"
SHARED_KEY = "shared_key.weight"
MIXING = "mixing"
CONTENT_BIAS = "content_bias"
COLLABORATIVE_TENSORS = (SHARED_QUERY, SHARED_KEY, MIXING, CONTENT_BIAS)
FUSED_VALUE = "value_projection"  # what is left of a fused query/key/value projection: the values

# The shared-key form (Tucker: per-head queries kept, one shared key; decompose/shared_key.py). For module P:
#   P.shared_key.weight / .bias  (2W + P', D_in)  the shared key, where no key norm sits between (else:)
#   P.key_mixing                 (2W + P', G d)    the shared key from the normalised keys (QK-norm families)
#   P.query_core                 (N_h, 2, W)       head i's complex coefficients per shared rotary slot
#   P.pass_core                  (N_h, p, P')      head i's map onto the shared pass-through dimensions
#   P.query_projection.weight / .bias              the query part of a fused projection
SHARED_KEY_BIAS = "shared_key.bias"
KEY_MIXING = "key_mixing"
QUERY_CORE = "query_core"
PASS_CORE = "pass_core"
FUSED_QUERY = "query_projection"


def load_guard(replaced: list[str], dtype: torch.dtype) -> TensorSpec | None:
    """A tensor under the name of a projection the form replaced, holding no numbers. transformers without
    collab-convert skips our quantization_config and would initialise the lost projection at random and load on,
    silently wrong. The checkpoint's own model_type (MODEL_TYPE_PREFIX) stops the Auto classes; a model class named
    directly reads any model_type, and then this tensor's shape, which cannot be the projection's, makes it refuse
    (a size mismatch). Our loader ignores it. None where the form replaces nothing (the model then loads as the
    original)."""
    weights = [name for name in replaced if name.endswith(".weight")]
    return TensorSpec(weights[0], dtype, (0,)) if weights else None


@dataclass(frozen=True)
class HeadCounts:
    """Heads of one attention module: kv_heads equals num_heads without grouping."""

    num_heads: int
    kv_heads: int


@dataclass(frozen=True)
class LayerFormat:
    """The shapes that one collaborative attention module stores."""

    rank: int
    num_heads: int
    query_input_dim: int
    key_input_dim: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            SHARED_QUERY: (self.rank, self.query_input_dim),
            SHARED_KEY: (self.rank, self.key_input_dim),
            MIXING: (self.num_heads, self.rank),
            CONTENT_BIAS: (self.num_heads, self.key_input_dim),
        }

    def specs(self, prefix: str, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec(f"{prefix}.{suffix}", dtype, shape) for suffix, shape in self.shapes().items()]


def collaborative_tensors(prefix: str, shared_query: torch.Tensor, shared_key: torch.Tensor, mixing: torch.Tensor,
                          content_bias: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Factors in math layout (D_in x R for the shared projections) -> checkpoint tensors in `dtype`."""
    values = {SHARED_QUERY: shared_query.T, SHARED_KEY: shared_key.T, MIXING: mixing, CONTENT_BIAS: content_bias}
    return {f"{prefix}.{suffix}": values[suffix].to(dtype).contiguous() for suffix in COLLABORATIVE_TENSORS}


class FormatConfig:
    """What collab-convert did to the checkpoint, as config.json's `quantization_config` records it: enough to
    rebuild the modules before loading. Writes (to_dict) and reads (the constructor, which refuses formats newer
    than this tool)."""

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

    @staticmethod
    def layer_entry(rank: int, heads: HeadCounts, content_bias: bool = True) -> dict[str, int]:
        """One layer's record; kv_heads only where keys are grouped (fewer key than query heads), content_bias
        only where the layer stores none."""
        grouped = {"kv_heads": heads.kv_heads} if heads.kv_heads != heads.num_heads else {}
        no_bias = {} if content_bias else {"content_bias": False}
        return {"rank": rank, "num_heads": heads.num_heads, **grouped, **no_bias}

    @staticmethod
    def shared_key_entry(heads: HeadCounts, head_dim: int, rotary_dim: int, frequency_ranks, pass_rank: int) -> dict:
        """One shared-key layer's record: the cache width as `rank`, and how it splits over RoPE frequencies."""
        return {
            "form": SHARED_KEY_FORM, "rank": 2 * sum(frequency_ranks) + pass_rank, "num_heads": heads.num_heads,
            "kv_heads": heads.kv_heads, "head_dim": head_dim, "rotary_dim": rotary_dim,
            "frequency_ranks": list(frequency_ranks), "pass_rank": pass_rank,
        }

    def layer_shapes(self) -> dict[str, tuple[int, HeadCounts]]:
        """Module prefix -> (rank, heads), as recorded."""
        shapes = {}
        for prefix, entry in self.layers.items():
            num_heads = int(entry["num_heads"])
            shapes[prefix] = (int(entry["rank"]), HeadCounts(num_heads, int(entry.get("kv_heads") or num_heads)))
        return shapes

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["quant_method"] = QUANT_METHOD
        return data

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()


def layer_form(entry: dict[str, Any]) -> str:
    """The form a layer's record is in (records of the CP form name none)."""
    form = entry.get("form") or COLLABORATIVE_FORM
    return _OLD_FORM_NAMES.get(form, form)


def is_collaborative(config: dict[str, Any]) -> bool:
    return (config.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD


def guarded_model_type(model_type: str) -> str:
    """The model_type a guarded checkpoint of `model_type` declares (MODEL_TYPE_PREFIX)."""
    return MODEL_TYPE_PREFIX + model_type


def original_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json of a guarded checkpoint as the original model's config reads it: its own model_type back (the
    record keeps it) and no auto_map (which names the carried code, for loads without collab-convert). Any other
    config is returned as it is."""
    # not "model_type" in the record: a config class reading a dict of another type takes any nested dict whose
    # model_type is its own for the whole config
    record = config.get("quantization_config") or {}
    original = record.get("original_model_type") if is_collaborative(config) else None
    if not isinstance(original, str) or config.get("model_type") != guarded_model_type(original):
        return config
    return {**{key: value for key, value in config.items() if key != "auto_map"}, "model_type": original}


def write_config(original: dict[str, Any], family: str, method: str | None, layers: dict[str, dict[str, Any]],
                 folder: Path, format_version: int = 1, guarded: bool = False, auto_map: dict[str, str] | None = None,
                 projections: dict[str, str] | None = None) -> None:
    """config.json of the output: the original's, untouched `architectures`, plus the record (the decomposition
    method only where one was used: the CP form's). A `guarded` checkpoint (one transformers alone must not load as
    the original) declares its own model_type (MODEL_TYPE_PREFIX), and the record keeps the original's. Where it
    carries its modeling code (CHECKPOINT_CODE), `auto_map` names its classes; the record names the replaced
    `projections` where that code runs the form."""
    config = dict(original)
    record = FormatConfig(family=family, layers=layers, format_version=format_version, tool_version=__version__,
                          method=method)
    config["quantization_config"] = {
        key: record.to_dict()[key]
        for key in ("quant_method", "format_version", "tool_version", "method", "family", "layers")
        if key != "method" or method is not None
    }
    if guarded and isinstance(original.get("model_type"), str):
        config["model_type"] = guarded_model_type(original["model_type"])
        config["quantization_config"]["original_model_type"] = original["model_type"]
    if auto_map:
        config["auto_map"] = auto_map
    if projections:
        config["quantization_config"]["projections"] = projections
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def recorded_base(folder: Path) -> str | None:
    """The base model a compressed folder came from, as it records it: the multi-query form's provenance in
    config.json, else report.json's `model` (every form writes it). None where neither says."""
    for file, read in (("config.json", lambda data: (data.get(MULTI_QUERY_RECORD) or {}).get("base_model")),
                       ("report.json", lambda data: data.get("model"))):
        try:
            base = read(json.loads((Path(folder) / file).read_text(encoding="utf-8")))
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(base, str) and base:
            return base
    return None
