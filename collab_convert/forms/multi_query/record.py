"""The multi-query form's plan and its config.json: a stock config of the same family (one key/value head of width
W, RoPE as longrope factors that give the shared key's per-pair frequencies, integration/rope.py), with no
quantization_config, so it loads without collab-convert, and its provenance under a key transformers keeps and
ignores (format.MULTI_QUERY_RECORD)."""

from __future__ import annotations

import json
from pathlib import Path

from ...architectures.source import SourceModel
from ...decompose.costs import attention_cost
from ...decompose.shared_key import KeyRanks, slot_frequencies
from ...errors import BadInputError
from ...format import MULTI_QUERY_FORM, MULTI_QUERY_RECORD
from ...options import DEFAULT_METHOD, CompressOptions
from ...version import __version__
from ..shared_key.fitting import shape_of
from .serving import serving_width


def plan_width(source: SourceModel, options: CompressOptions) -> int:
    """The head width W: from --kv-cache (a share of keys and values together), or --rank; refuses what the
    stock shape cannot say."""
    if options.key_cache is not None:
        raise BadInputError("the multi-query form sizes keys and values together: give --kv-cache (a share of the "
                            "whole KV cache), not --key-cache")
    if options.method != DEFAULT_METHOD:
        raise BadInputError(f"--method chooses the collaborative (CP) form's decomposition; the multi-query form fits "
                            f"by weighted PCA: drop --method {options.method}")
    partial = [layer for layer in source.layers if layer.rotary_dim != layer.shape.head_dim]
    if partial:
        raise BadInputError(f"{partial[0].prefix} rotates {partial[0].rotary_dim} of {partial[0].shape.head_dim} "
                            "dimensions per head (partial rotary): a stock head cannot mix rotated and unrotated "
                            "dimensions; the shared-key form keeps it (--key-cache)")
    full = max(layer.full_rank for layer in source.layers)
    if options.kv_cache is not None:
        if options.rank is not None:
            raise BadInputError("give --rank or --kv-cache, not both")
        if options.kv_cache * full < 2:  # a head holds at least one RoPE pair: more than asked is not a budget
            raise BadInputError(f"--kv-cache {options.kv_cache:g} leaves less than one rotary pair (2 numbers) per "
                                f"token and layer; the smallest multi-query cache of this model is {2 / full:.4g}")
        return serving_width(options.kv_cache * full, full)
    if not isinstance(options.rank, int):
        raise BadInputError(f"{source.family.name} in the multi-query form: give --kv-cache (a share of the KV "
                            f"cache, e.g. 0.5) or --rank (the key/value head's width, even, at most {full})")
    for layer in source.layers:
        layer.check_rank(options.rank)
    if options.rank % 2:
        raise BadInputError(f"a multi-query head turns dimensions in RoPE pairs: its width must be even, got "
                            f"{options.rank}")
    return options.rank


def plan_layers(source: SourceModel, width: int) -> list[dict]:
    layers = []
    for layer in source.layers:
        shape, bias = shape_of(source, layer), layer.has_query_bias
        layers.append({"name": layer.prefix, "rank": width,
                       "parameters_before": attention_cost(shape, has_bias=bias).parameters,
                       "parameters_after": attention_cost(shape, width, has_bias=bias).parameters})
    return layers


def write_stock_config(source: SourceModel, width: int, profile: KeyRanks, folder: Path) -> None:
    """config.json: the original's, with one key/value head of `width` and RoPE that turns its pairs at the
    shared key's frequencies; the provenance under MULTI_QUERY_RECORD."""
    from ...integration.rope import rope_frequencies, stock_rope_parameters

    written_as = source.layout.written_as
    config = written_as.config(source.config) if written_as else dict(source.config)
    rope = stock_rope_parameters(rope_frequencies(source.folder), slot_frequencies(profile))
    kept = {k: v for k, v in (config.get("rope_parameters") or {}).items() if k == "partial_rotary_factor"}
    config.update(num_key_value_heads=1, head_dim=width, rope_parameters={**rope, **kept})
    config.update(legacy_rope_keys(config["rope_parameters"]))
    layer = source.layers[0]
    config[MULTI_QUERY_RECORD] = {
        "form": MULTI_QUERY_FORM, "tool_version": __version__, "base_model": source.source,
        "kv_cache_share": round(width / layer.full_rank, 6), "key_frequency_ranks": list(profile.frequency_ranks),
        "before": {"num_key_value_heads": layer.kv_heads, "head_dim": layer.shape.head_dim,
                   "model_type": source.config.get("model_type")},
        "source_gguf": _source_gguf(source.folder),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def legacy_rope_keys(rope_parameters: dict) -> dict:
    """The same RoPE under transformers 4's names, which transformers 5 reads as the same frequencies: a reader
    of the older names (SGLang's model code under transformers 4 takes `rope_theta`, 10000 where it is missing,
    and `rope_scaling`; docs/serving.md) would otherwise turn the shared key at the wrong frequencies without a
    word."""
    keys = {"rope_theta": rope_parameters["rope_theta"],
            "rope_scaling": {k: v for k, v in rope_parameters.items()
                             if k not in ("rope_theta", "partial_rotary_factor")}}
    if "partial_rotary_factor" in rope_parameters:
        keys["partial_rotary_factor"] = rope_parameters["partial_rotary_factor"]
    return keys


def _source_gguf(folder: Path) -> str | None:
    """The GGUF file a dequantised input came from (io/gguf.py notes it), whose tokenizer a GGUF export copies."""
    from ...io.gguf import source_of

    return source_of(folder)
