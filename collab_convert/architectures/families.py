"""Everything collab-convert knows about model families, as data.

A family says which config `model_type`s it covers, where its attention modules sit (regexes over module /
tensor-name prefixes, each with the config key that gives its head count) and how their query/key
projections are laid out (layouts.py). The collaborative module keeps the original forward (modeling/), so
adding a family whose layout exists is one entry in FAMILIES and a test. Rotary decoders (ROTARY_FAMILIES) take
the shared-key form; SHARED_KEY_FAMILIES offer that form to families whose default is the CP form.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..errors import UnsupportedModelError
from ..modeling.forwards import bart_forward, gpt2_forward, gpt_bigcode_forward, mpnet_forward, opt_forward, t5_forward
from ..modeling.shared_key import bart_shared_key_forward, t5_shared_key_forward
from ..format import HeadCounts
from .layouts import FusedProjection, Layout, SeparateProjections
from .shared_key import SharedKeyProjections


@dataclass(frozen=True)
class Site:
    """Where attention modules sit, and which config key holds their number of heads."""

    pattern: str  # matches the module's dotted name, with or without a base-model prefix ("bert.")
    num_heads_key: str = "num_attention_heads"
    cross: bool = False  # queries from one sequence, keys from another (encoder-decoder attention)
    causal: bool = False  # each query sees only the keys up to its own position


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    sites: tuple[Site, ...]
    layout: Layout | SharedKeyProjections = SeparateProjections()
    # Modules that compute scores inline instead of calling the attention interface need our forward.
    forward: Callable | None = None
    # Config values the collaborative form cannot reproduce, as (key, allowed values, reason).
    requires: tuple[tuple[str, tuple, str], ...] = ()
    # Grouped-query attention: how many key/value heads a config has (None: one per query head). The heads of
    # a group share their key, so T[i] = W_Q^(i)^T W_K^(g(i)).
    kv_heads: Callable[[dict[str, Any]], int] | None = None
    # The relative position bias a module adds to its scores, read from its bound forward arguments during
    # calibration (None: it adds none). Refinement matches softmax(scaling * q.k + position bias) plus masks.
    position_bias: Callable[[Any, dict[str, Any]], Any] | None = None
    # The shared-key form of a decoder with absolute positions (GPT-2, OPT): nothing rotates, so every key
    # dimension is a pass-through one and the shared key is one real subspace of all key heads.
    absolute_positions: bool = False

    @property
    def takes_shared_key(self) -> bool:
        """Families in the shared-key (Tucker) form: per-head queries kept, one shared key, not the CP form."""
        return isinstance(self.layout, SharedKeyProjections)

    def site_of(self, module_name: str) -> Site | None:
        for site in self.sites:
            if re.search(site.pattern, module_name):
                return site
        return None

    def caches_keys(self, site: Site) -> bool:
        """Whether a site's keys are cached while generating. In an encoder-decoder only the decoder's
        attention caches (its self-attention and its reads of the encoder); an encoder-only family's sites
        count as cached, the key cache it reports being what a decoder of its shape would hold."""
        generates = any(s.causal or s.cross for s in self.sites)
        return site.causal or site.cross or not generates

    def heads(self, config: dict[str, Any], site: Site) -> HeadCounts:
        num_heads = self.num_heads(config, site)
        kv_heads = self.kv_heads(config) if self.kv_heads else num_heads
        if num_heads % kv_heads:
            raise UnsupportedModelError(f"{num_heads} query heads do not split into groups of {kv_heads} key heads")
        return HeadCounts(num_heads, kv_heads)

    def num_heads(self, config: dict[str, Any], site: Site) -> int:
        value = config.get(site.num_heads_key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UnsupportedModelError(f"config.json has no valid '{site.num_heads_key}'")
        return value


def _handed_position_bias(module, arguments: dict[str, Any]):
    """MPNet: the encoder computes the bias once and hands it to every layer."""
    return arguments.get("position_bias")


def _t5_position_bias(module, arguments: dict[str, Any]):
    """T5: the first layer of a stack computes its bias and hands it on to the others (with the mask kept
    apart); encoder-decoder attention has none."""
    if arguments.get("key_value_states") is not None:
        return None
    handed = arguments.get("position_bias")
    if handed is not None or not getattr(module, "has_relative_attention_bias", False):
        return handed
    length = arguments["hidden_states"].shape[1]
    return module.compute_bias(length, length, device=arguments["hidden_states"].device)


_ABSOLUTE_ONLY = (
    (
        "position_embedding_type",
        (None, "absolute"),
        "its relative-position scores use the per-head query and key vectors",
    ),
)

FAMILIES: tuple[Family, ...] = (
    Family(
        name="bert",
        # Models whose self-attention is BertSelfAttention or a verbatim copy of it.
        model_types=("bert", "roberta", "xlm-roberta", "electra", "camembert", "data2vec-text", "ernie"),
        sites=(Site(r"(^|\.)encoder\.layer\.\d+\.attention\.self$"),),
        requires=_ABSOLUTE_ONLY,
    ),
    Family(
        name="distilbert",
        model_types=("distilbert",),
        sites=(Site(r"(^|\.)transformer\.layer\.\d+\.attention$", "n_heads"),),
        layout=SeparateProjections("q_lin", "k_lin"),
    ),
    Family(
        # One attention module per layer group, shared by every layer of the group: decomposed once.
        name="albert",
        model_types=("albert",),
        sites=(Site(r"(^|\.)encoder\.albert_layer_groups\.\d+\.albert_layers\.\d+\.attention$"),),
        requires=_ABSOLUTE_ONLY,
    ),
    Family(
        # The relative position bias is added to the scores and untouched by the re-parametrization; calibration
        # reads it from the module's inputs, so refinement adds it as the module does.
        name="mpnet",
        model_types=("mpnet",),
        sites=(Site(r"(^|\.)encoder\.layer\.\d+\.attention\.attn$"),),
        layout=SeparateProjections("q", "k"),
        forward=mpnet_forward,
        position_bias=_handed_position_bias,
    ),
    Family(
        name="vit",
        model_types=("vit", "deit"),
        sites=(Site(r"(^|\.)layers\.\d+\.attention$"),),
        layout=SeparateProjections("q_proj", "k_proj"),
    ),
    Family(
        name="gpt2",
        model_types=("gpt2",),
        sites=(Site(r"(^|\.)h\.\d+\.attn$", "n_head", causal=True),),
        layout=FusedProjection("c_attn", conv1d=True),
        forward=gpt2_forward,  # so the cache holds exactly the packed shared key (no head-size chunks)
        requires=(
            ("reorder_and_upcast_attn", (None, False), "its upcast path multiplies the per-head queries and keys"),
            ("add_cross_attention", (None, False), "its cross-attention fuses keys with values differently"),
        ),
        # scale_attn_weights / scale_attn_by_inverse_layer_idx set the module's `scaling`, which calibration
        # reads and refinement uses
    ),
    Family(
        # Multi-query attention: every query head reads one shared key/value head.
        name="gpt_bigcode",
        model_types=("gpt_bigcode",),
        sites=(Site(r"(^|\.)h\.\d+\.attn$", "n_head", causal=True),),
        layout=FusedProjection("c_attn"),
        forward=gpt_bigcode_forward,
        kv_heads=lambda config: 1,
        requires=(
            ("multi_query", (None, True), "its multi-head variant interleaves q/k/v per head in c_attn"),
            ("add_cross_attention", (None, False), "its cross-attention splits keys and values differently"),
        ),
        # scale_attn_weights sets the module's `scaling`, which calibration reads and refinement uses
    ),
    Family(
        name="opt",
        model_types=("opt",),
        sites=(Site(r"(^|\.)decoder\.layers\.\d+\.self_attn$", causal=True),),
        layout=SeparateProjections("q_proj", "k_proj"),
        forward=opt_forward,  # its views spell out the head count, so the packed shared key needs our forward
    ),
    Family(
        name="bart",
        model_types=("bart", "mbart", "marian", "pegasus"),
        sites=(
            Site(r"(^|\.)encoder\.layers\.\d+\.self_attn$", "encoder_attention_heads"),
            Site(r"(^|\.)decoder\.layers\.\d+\.self_attn$", "decoder_attention_heads", causal=True),
            Site(r"(^|\.)decoder\.layers\.\d+\.encoder_attn$", "decoder_attention_heads", cross=True),
        ),
        layout=SeparateProjections("q_proj", "k_proj"),
        forward=bart_forward,  # so the caches hold exactly the packed shared key (no head-size chunks)
    ),
    Family(
        # No 1/sqrt(d_k) scaling (the module's scaling is 1) and a relative position bias: both stay as they are.
        name="t5",
        model_types=("t5", "mt5"),
        sites=(
            Site(r"(^|\.)encoder\.block\.\d+\.layer\.0\.SelfAttention$", "num_heads"),
            Site(r"(^|\.)decoder\.block\.\d+\.layer\.0\.SelfAttention$", "num_heads", causal=True),
            Site(r"(^|\.)decoder\.block\.\d+\.layer\.1\.EncDecAttention$", "num_heads", cross=True),
        ),
        layout=SeparateProjections("q", "k"),
        position_bias=_t5_position_bias,
        forward=t5_forward,  # so the caches hold exactly the packed shared key (no head-size chunks)
    ),
)

_DECODER_LAYERS = (Site(r"(^|\.)layers\.\d+\.self_attn$", causal=True),)


def _kv_heads(config: dict[str, Any]) -> int:
    value = config.get("num_key_value_heads", config.get("num_attention_heads"))
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(f"config.json has no valid 'num_key_value_heads' ({value!r})")
    return value


# Rotary decoders: per-head queries kept, one shared key per frequency (decompose/shared_key.py). RoPE itself,
# masks, sliding windows and soft-capping stay the model's own (modeling/shared_key.py).
ROTARY_FAMILIES: tuple[Family, ...] = (
    Family(
        name="llama",
        model_types=("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gemma", "gemma2", "granite"),
        sites=_DECODER_LAYERS,
        layout=SharedKeyProjections(),
    ),
    Family(
        # The norm acts on each head's query and key before RoPE: it stays, and the normalised keys are shared.
        name="qk_norm",
        model_types=("qwen3", "qwen3_moe", "gemma3_text"),
        sites=_DECODER_LAYERS,
        layout=SharedKeyProjections(query_norm="q_norm", key_norm="k_norm"),
    ),
    Family(
        name="olmo2",
        model_types=("olmo2",),
        sites=_DECODER_LAYERS,
        layout=SharedKeyProjections(query_norm="q_norm", key_norm="k_norm", norm_over_heads=True, input_norm=None),
    ),
    Family(
        name="phi3",
        model_types=("phi3",),
        sites=_DECODER_LAYERS,
        layout=SharedKeyProjections(fused="qkv_proj"),
        kv_heads=_kv_heads,
    ),
    Family(
        # Partial rotary; qk_layernorm (optional) normalises each head's query and key.
        name="phi",
        model_types=("phi",),
        sites=_DECODER_LAYERS,
        layout=SharedKeyProjections(output="dense", query_norm="q_layernorm", key_norm="k_layernorm"),
    ),
    Family(
        # Partial rotary, and q/k/v interleaved head by head in one projection.
        name="gpt_neox",
        model_types=("gpt_neox",),
        sites=(Site(r"(^|\.)layers\.\d+\.attention$", causal=True),),
        layout=SharedKeyProjections(fused="query_key_value", interleaved=True, output="dense"),
    ),
)
FAMILIES = FAMILIES + ROTARY_FAMILIES

SHARED_KEY = "shared-key"


def _shared_key_form(name: str, layout: SharedKeyProjections, **changes) -> Family:
    """The shared-key entry of the CP family `name`: the same model_types, sites, head counts, requirements and
    position bias, a shared-key layout, and nothing rotating."""
    family = next(f for f in FAMILIES if f.name == name)
    return replace(family, **{"name": f"{name}-{SHARED_KEY}", "layout": layout, "forward": None,
                              "absolute_positions": True, **changes})


# Absolute-position decoders (and encoder-decoders) in the shared-key form (--form shared-key): each head keeps
# its query (bias and all, so no content bias is needed), one shared key of R numbers per token replaces the key
# heads. At moderate cuts of the cache it keeps more of the scores than the CP form; the CP form saves more
# parameters. family_for picks an entry here or its CP twin by the form asked for.
SHARED_KEY_FAMILIES: tuple[Family, ...] = (
    _shared_key_form("gpt2", SharedKeyProjections(fused="c_attn", conv1d=True, output="c_proj",
                                               output_dropout="resid_dropout", dropout="attn_dropout",
                                               input_norm="ln_1")),
    _shared_key_form("gpt_bigcode", SharedKeyProjections(fused="c_attn", output="c_proj", output_dropout="resid_dropout",
                                                      dropout="attn_dropout", input_norm="ln_1")),
    _shared_key_form(
        "opt", SharedKeyProjections(output="out_proj", dropout="dropout", input_norm="self_attn_layer_norm"),
        # A post-norm OPT (opt-350m) has no norm in front of its attention to tell the input scales
        requires=(("do_layer_norm_before", (None, True), "the shared-key form reads the scale of the norm in front "
                   "of attention, which a post-norm OPT does not have; its default (CP) form works"),),
    ),
    # Every attention module takes the form (encoder, decoder, encoder-decoder); the decoder's caches hold the
    # shared keys. BART normalises after attention, so weight-only fits take isotropic inputs.
    _shared_key_form("bart", SharedKeyProjections(output="out_proj", dropout="dropout", input_norm=None),
                     forward=bart_shared_key_forward),
    # T5's relative position bias and unscaled scores stay as they are (calibration reads the bias).
    _shared_key_form("t5", SharedKeyProjections(query="q", key="k", value="v", output="o", dropout="dropout",
                                             input_norm=None),
                     forward=t5_shared_key_forward),
)

# Families the collaborative form cannot represent exactly, and why. Checked before FAMILIES.
_OTHER_ROTARY = (
    "its rotary position embeddings are laid out or applied differently from the rotate_half layout the shared "
    "rotary key supports (llama, mistral, qwen2/3, gemma/2/3, olmo2, phi, phi3, gpt_neox are supported)"
)
REFUSED: dict[str, str] = {
    **{
        t: _OTHER_ROTARY
        for t in (
            "gptj", "falcon", "olmo", "stablelm", "starcoder2", "cohere", "roformer", "esm", "modernbert",
            "nomic_bert",
        )
    },
    "gemma3": "it is the multimodal Gemma 3 wrapper; compress a text-only Gemma 3 checkpoint (model_type gemma3_text)",
    "gpt_neo": "its local attention layers have no 1/sqrt(d_k) scaling and a windowed mask of their own",
    "deberta": "its disentangled attention adds content-to-position terms with their own projections",
    "deberta-v2": "its disentangled attention adds content-to-position terms with their own projections",
}


# Learned positions that start after the padding index (RoBERTa's scheme): pad_token_id + 1 of them are never
# used by real tokens.
_POSITIONS_AFTER_PADDING = ("roberta", "xlm-roberta", "camembert", "data2vec-text", "mpnet")


def position_limit(config: dict[str, Any]) -> int | None:
    """The most tokens one input may have before the model's position embeddings run out (None: no limit
    stated). Rotary decoders state a trained length, which is a sensible limit for calibration too."""
    for key in ("max_position_embeddings", "n_positions"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            if config.get("model_type") in _POSITIONS_AFTER_PADDING:
                value -= int(config.get("pad_token_id") or 0) + 1
            return max(value, 2)
    return None


def within_positions(config: dict[str, Any], max_length: int) -> int:
    """`max_length` tokens, or fewer where the model's position embeddings end (a longer input would index
    past them): the one cut every tokenization of text for a model goes through."""
    limit = position_limit(config)
    return min(max_length, limit) if limit is not None else max_length


def family_for(config: dict[str, Any], form: str = "auto") -> Family:
    """The family of a config, in the form asked for: "collaborative" (CP), "shared-key" (per-head queries, one
    shared key; the only form of rotary decoders) or "auto" (each family's own)."""
    family = _family_of(config)
    if form == SHARED_KEY and not family.takes_shared_key:
        shared = next((f for f in SHARED_KEY_FAMILIES if config.get("model_type") in f.model_types), None)
        if shared is None:
            names = sorted({t for f in SHARED_KEY_FAMILIES + ROTARY_FAMILIES for t in f.model_types})
            raise UnsupportedModelError(f"the shared-key form (--form shared-key, --key-cache) is not offered for "
                                        f"model_type '{config.get('model_type')}' (offered for: {', '.join(names)})")
        _check_requirements(shared, config)
        return shared
    if form == "collaborative" and family.takes_shared_key:
        raise UnsupportedModelError(f"{family.name} is a rotary decoder: it takes the shared-key form only (RoPE "
                                    "does not commute with the CP form's shared query); drop --form collaborative")
    return family


def forms_offered(config: dict[str, Any]) -> list[str]:
    """The forms a config's model can take: "collaborative" and/or "shared-key"."""
    forms = []
    for form in ("collaborative", SHARED_KEY):
        try:
            family_for(config, form)
        except UnsupportedModelError:
            continue
        forms.append(form)
    return forms


def _check_requirements(family: Family, config: dict[str, Any]) -> None:
    for key, allowed, reason in family.requires:
        if config.get(key) not in allowed:
            raise UnsupportedModelError(f"{key}={config.get(key)!r} is not supported: {reason}")


def _family_of(config: dict[str, Any]) -> Family:
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise UnsupportedModelError(f"config.json's model_type {model_type!r} is not a name")
    if not model_type:
        raise UnsupportedModelError("config.json has no model_type, so the architecture cannot be recognised")
    if model_type in REFUSED:
        raise UnsupportedModelError(f"model_type '{model_type}' is not supported: {REFUSED[model_type]}")
    for family in FAMILIES:
        if model_type in family.model_types:
            _check_requirements(family, config)
            return family
    raise UnsupportedModelError(
        f"model_type '{model_type}' is not supported (supported: {', '.join(supported_model_types())})"
    )


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def family_named(name: str) -> Family:
    for family in FAMILIES + SHARED_KEY_FAMILIES:
        if family.name == name:
            return family
    known = ", ".join(f.name for f in FAMILIES + SHARED_KEY_FAMILIES)
    raise UnsupportedModelError(f"unknown collaborative family '{name}' (known: {known})")
