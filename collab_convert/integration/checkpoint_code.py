"""Collaborative attention for transformers, without collab-convert: the modeling code a guarded checkpoint carries.

compress copies this file into every checkpoint that transformers alone must not load as the original model (the
CP form; the shared-key form where it replaces a projection) as `collaborative_modeling.py`, adds a config class
under the checkpoint's own model_type ("collaborative_<original>") and the model classes config.json's `auto_map`
names. Without `trust_remote_code=True` transformers runs none of it: it refuses the unknown model_type and says
to pass that flag, so no flag makes it load random query/key weights. With the flag, the checkpoint loads the way
the ecosystem loads custom architectures (`AutoModel.from_pretrained(folder, trust_remote_code=True)`,
`SentenceTransformer(folder, trust_remote_code=True)`, `pipeline(..., trust_remote_code=True)`) where this code
runs its form, and is refused with a line saying to install collab-convert where it does not. Where collab-convert
is installed, its own loader takes over, and no flag is needed at all.

Self-contained on purpose: it imports only torch and transformers. It knows one form (the CP form: heads share one
query and one key, each head with a mixing vector) in families whose attention module calls
`self.<query>(h)` and `self.<key>(h)`, views them head by head and dispatches to `ALL_ATTENTION_FUNCTIONS`, and
in the modules named in INLINE_FORWARDS, which score inline (MPNet's: its forward is restated here with
collaborative queries and keys); the record in config.json names the two projections (`projections`), so
whichever checkpoint's copy of this code registered first in a process loads the others too. The
shared query and the packed shared key [y W~_K, y r_1 .. y r_N] are handed out zero-padded to whole heads
("pseudo-heads"); the attention function below unpacks them into per-head queries [x W~_Q diag(m_i), 1] and
keys [y W~_K, y r_i] and calls the model's real implementation with the original 1/sqrt(d_k) scaling.
"""

from __future__ import annotations

import importlib
import math
import re
import sys

import torch
import transformers  # noqa: F401 - the classes appended for each checkpoint subclass transformers' own
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

QUANT_METHOD = ATTENTION_NAME = "collaborative"
READABLE_FORMAT = 2  # the newest record this file reads (collab-convert's format.FORMAT_VERSION)


def _needs_the_package(what: str) -> ValueError:
    return ValueError(f"{what}; install collab-convert (pip install collab-convert) to load this checkpoint")


class CollaborativeRecord(QuantizationConfigMixin):
    """config.json's `quantization_config` as collab-convert writes it (format.FormatConfig there)."""

    def __init__(self, family=None, layers=None, format_version=1, **kwargs):
        self.quant_method = QUANT_METHOD
        self.family, self.layers, self.format_version = family, dict(layers or {}), format_version
        for key, value in kwargs.items():
            if key != "quant_method":
                setattr(self, key, value)
        if int(format_version) > READABLE_FORMAT:
            raise _needs_the_package(f"this checkpoint uses collaborative format {format_version}")
        forms = {entry.get("form") or QUANT_METHOD for entry in self.layers.values()}
        if forms != {QUANT_METHOD}:
            raise _needs_the_package(f"this checkpoint holds the {', '.join(sorted(forms - {QUANT_METHOD}))} form")
        projections = getattr(self, "projections", None)
        if not isinstance(projections, dict) or not {"query", "key"} <= set(projections):
            raise _needs_the_package(f"this {family} checkpoint's collaborative attention runs only in "
                                     "collab-convert's own code")

    def to_dict(self):
        return {**self.__dict__, "quant_method": QUANT_METHOD}

    def to_diff_dict(self):
        return self.to_dict()


class ConfigView:
    """An attention module's config: the model's own, except that attention dispatches collaboratively."""

    def __init__(self, base):
        object.__setattr__(self, "_base", base)

    def __getattr__(self, name):
        if name == "_base":
            raise AttributeError(name)
        return getattr(self._base, name)

    def __setattr__(self, name, value):
        setattr(self._base, name, value)

    @property
    def _attn_implementation(self):
        return ATTENTION_NAME


def _padded_rows(weight, chunk):
    rows = chunk * math.ceil(weight.shape[0] / chunk)
    return weight if rows == weight.shape[0] else nn.functional.pad(weight, (0, 0, 0, rows - weight.shape[0]))


class CollaborativeMixin:
    is_collaborative = True

    def collaborative_query(self, hidden_states):
        """x W~_Q, zero-padded to whole heads."""
        return nn.functional.linear(hidden_states, _padded_rows(self.shared_query.weight, self.collaborative_head_dim))

    def collaborative_key(self, hidden_states):
        """[y W~_K, y r_1 .. y r_N], zero-padded to whole heads."""
        packed = torch.cat([self.shared_key.weight, self.content_bias])
        return nn.functional.linear(hidden_states, _padded_rows(packed, self.collaborative_head_dim))


_CLASSES = {}


def _collaborative_class(original, query, key):
    """The original module class, whose `query` and `key` projections hand out the collaborative ones (and whose
    forward is restated where it scores inline: INLINE_FORWARDS)."""
    if (original, query, key) not in _CLASSES:
        members = {query: property(lambda self: self.collaborative_query),
                   key: property(lambda self: self.collaborative_key), "collaborative_origin": original}
        if original.__name__ in INLINE_FORWARDS:
            members["forward"] = INLINE_FORWARDS[original.__name__]
        _CLASSES[original, query, key] = type(f"Collaborative{original.__name__}", (CollaborativeMixin, original),
                                              members)
    return _CLASSES[original, query, key]


def make_collaborative(module, entry, projections):
    """Turn one attention module into its CP form in place, with empty tensors the checkpoint fills by name;
    `projections` names its query and key projections."""
    heads, rank = int(entry["num_heads"]), int(entry["rank"])
    query, key = getattr(module, projections["query"]), getattr(module, projections["key"])
    factory = {"device": query.weight.device, "dtype": query.weight.dtype}
    head_dim, key_input = query.out_features // heads, key.in_features
    delattr(module, projections["query"])
    delattr(module, projections["key"])
    module.shared_query = nn.Linear(query.in_features, rank, bias=False, **factory)
    module.shared_key = nn.Linear(key_input, rank, bias=False, **factory)
    module.mixing = nn.Parameter(torch.zeros(heads, rank, **factory))
    if entry.get("content_bias", True):
        module.content_bias = nn.Parameter(torch.zeros(heads, key_input, **factory))
    else:  # stored nowhere: an empty buffer, so the packed key is the shared key alone
        module.register_buffer("content_bias", torch.zeros(0, key_input, **factory), persistent=False)
    module.collaborative_head_dim = head_dim
    module._is_hf_initialized = True  # the weights come from the checkpoint; nothing to initialise
    if hasattr(module, "config"):
        module.config = ConfigView(module.config)
    module.__class__ = _collaborative_class(type(module), projections["query"], projections["key"])


def _eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[..., : key.shape[-2]]
    weights = nn.functional.dropout(nn.functional.softmax(weights, dim=-1), p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _real_attention(module):
    config = module.config._base if isinstance(module.config, ConfigView) else module.config
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation == "eager":  # the family's own eager function, where its modeling file has one
        return getattr(sys.modules.get(module.collaborative_origin.__module__), "eager_attention_forward", _eager)
    if "flash" in implementation:
        raise RuntimeError(f"collaborative attention cannot run with {implementation}: its query/key heads differ "
                           "in size from the value heads; load with attn_implementation='sdpa' or 'eager'")
    return ALL_ATTENTION_FUNCTIONS[implementation]


def collaborative_attention(module, query, key, value, attention_mask, **kwargs):
    """Pseudo-heads (B, P, n, d) back into per-head queries [x W~_Q diag(m_i), 1] and keys [y W~_K, y r_i],
    then the model's real attention function; plain modules pass straight through."""
    if not getattr(module, "is_collaborative", False):
        return _real_attention(module)(module, query, key, value, attention_mask, **kwargs)
    batch, heads = query.shape[0], module.mixing.shape[0]
    queries, keys = _per_head(module, query.transpose(1, 2).reshape(batch, query.shape[2], -1),
                              key.transpose(1, 2).reshape(batch, key.shape[2], -1))
    if value.shape[1] != heads:
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    return _real_attention(module)(module, queries, keys, value, attention_mask, **kwargs)


def _per_head(module, shared_query, packed_key):
    """Per-head queries [x W~_Q diag(m_i), 1] and keys [y W~_K, y r_i], (B, N_h, n, R + 1), from the shared query
    (B, n, >= R) and the packed key (B, m, >= R + N_h) (padding past them ignored)."""
    heads, rank = module.mixing.shape
    batch = shared_query.shape[0]
    shared_key, bias = packed_key[..., :rank], packed_key[..., rank : rank + module.content_bias.shape[0]]
    queries = shared_query[..., :rank].unsqueeze(1) * module.mixing[None, :, None, :].to(shared_query.dtype)
    keys = shared_key.unsqueeze(1).expand(batch, heads, *shared_key.shape[1:])
    if bias.shape[-1]:  # the content bias: a column of ones against each head's y . r_i
        queries = torch.cat([queries, queries.new_ones(*queries.shape[:-1], 1)], dim=-1)
        keys = torch.cat([keys, bias.transpose(1, 2).unsqueeze(-1)], dim=-1)
    return queries, keys


def _mpnet_forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
    """MPNetSelfAttention.forward (transformers 5), which scores inline: the same with per-head collaborative
    queries and keys, scaled by the original 1/sqrt(d_k). The package's own is modeling/forwards.mpnet_forward, kept
    apart because this file must stand alone: change both alike."""
    input_shape = hidden_states.shape[:-1]
    queries, keys = _per_head(self, self.collaborative_query(hidden_states), self.collaborative_key(hidden_states))
    values = self.v(hidden_states).view(*input_shape, -1, self.attention_head_size).transpose(1, 2)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask
    probabilities = self.dropout(nn.functional.softmax(scores, dim=-1))
    context = torch.matmul(probabilities, values).permute(0, 2, 1, 3).contiguous()
    output = self.o(context.view(*context.shape[:-2], self.all_head_size))
    return (output, probabilities) if output_attentions else (output,)


# Modules that score inline rather than through ALL_ATTENTION_FUNCTIONS, by class name: their forward restated
INLINE_FORWARDS = {"MPNetSelfAttention": _mpnet_forward}


def _strip(name, prefix):
    return name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name


class CollaborativeQuantizer(HfQuantizer):
    """Swaps the recorded attention modules for their CP form before the weights load by name."""

    requires_calibration = False

    def _process_model_before_weight_loading(self, model, **kwargs):
        base = getattr(model, "base_model_prefix", None)
        wanted = {_strip(name, base): entry for name, entry in self.quantization_config.layers.items()}
        self._converted = []
        for name, module in list(model.named_modules()):
            entry = wanted.get(_strip(name, base))
            if entry is not None and not getattr(module, "is_collaborative", False):
                make_collaborative(module, entry, self.quantization_config.projections)
                self._converted.append(name)
        if len(self._converted) != len(wanted):
            raise ValueError("attention modules recorded in the collaborative checkpoint were not found in the model")
        self._check_complete(model, kwargs.get("checkpoint_files") or [], base)
        # each converted module's load guard (an empty tensor under a replaced projection's name) is no parameter
        patterns = {rf"(^|\.){re.escape(_strip(name, base))}\.\w+\.weight$" for name in self._converted}
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | patterns
        return model

    def _check_complete(self, model, checkpoint_files, base):
        """A missing collaborative tensor would be initialised at random: refuse before loading anything."""
        from safetensors import safe_open

        stored = set()
        for file in checkpoint_files:
            if not str(file).endswith(".safetensors"):
                return
            with safe_open(str(file), framework="pt") as handle:
                stored.update(_strip(key, base) for key in handle.keys())
        modules = dict(model.named_modules())
        for name in self._converted:
            for parameter_name, _ in modules[name].named_parameters():
                wanted = _strip(f"{name}.{parameter_name}", base)
                if stored and wanted not in stored:
                    raise ValueError(f"the collaborative checkpoint has no {wanted}: it is incomplete or was altered")

    def _process_model_after_weight_loading(self, model, **kwargs):
        modules = dict(model.named_modules())
        for name in self._converted:
            for parameter_name, parameter in modules[name].named_parameters():
                if parameter.is_floating_point() and not parameter.is_meta and not torch.isfinite(parameter).all():
                    raise ValueError(f"{name}.{parameter_name} holds NaN or Inf values: the checkpoint is corrupt")
        return model

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self):
        return True


def register():
    """Where collab-convert is installed, its loader (every form) registers itself on import; else this one."""
    try:  # by name: this file must not depend on the package it stands in for
        importlib.import_module("collab_convert")
    except ImportError:
        pass
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(CollaborativeRecord)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(CollaborativeQuantizer)
    if ATTENTION_NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ATTENTION_NAME, collaborative_attention)


register()
