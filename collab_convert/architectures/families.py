"""Everything collab-convert knows about model families, as data.

A family says which config `model_type`s it covers, where its attention modules sit (regexes over module /
tensor-name prefixes, each with the config key that gives its head count), and the forms it offers: for each,
how its projections are laid out in that form (layouts.py, shared_key.py) and, where its modules score inline
instead of calling the attention interface, a forward of ours (modeling/). Its default form comes first.
Adding a family whose layouts exist is one entry here and a test; lookup.py finds the entry of a config.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedModelError
from ..format import COLLABORATIVE_FORM, MULTI_QUERY_FORM, SHARED_KEY_FORM, HeadCounts
from ..modeling.forwards import bart_forward, gpt2_forward, gpt_bigcode_forward, mpnet_forward, opt_forward, t5_forward
from ..modeling.shared_key import bart_shared_key_forward, t5_shared_key_forward
from .layouts import FusedProjection, Layout, SeparateProjections
from .multi_query import PHI3_AS_LLAMA, MultiQueryProjections
from .shared_key import SharedKeyProjections


@dataclass(frozen=True)
class Site:
    """Where attention modules sit, and which config key holds their number of heads."""

    pattern: str  # matches the module's dotted name, with or without a base-model prefix ("bert.")
    num_heads_key: str = "num_attention_heads"
    cross: bool = False  # queries from one sequence, keys from another (encoder-decoder attention)
    causal: bool = False  # each query sees only the keys up to its own position


@dataclass(frozen=True)
class FormOffer:
    """One form a family takes: its projections' layout in that form, the forward its modules need there (None:
    their own), and config values that only this form cannot reproduce, as (key, allowed values, reason)."""

    form: str
    layout: Layout | SharedKeyProjections
    forward: Callable | None = None
    requires: tuple[tuple[str, tuple, str], ...] = ()
    # the carried code runs the form though `forward` is ours: restated, or the module's own takes pseudo-heads
    forward_carried: bool = False

    @property
    def carries_code(self) -> bool:
        """Whether the modeling code its checkpoints carry (integration/checkpoint_code.py) runs it: the CP form
        of modules that call separate query and key projections in their own forward, which that code takes
        without knowing the family, or in a forward that code restates."""
        return (self.form == COLLABORATIVE_FORM and isinstance(self.layout, SeparateProjections)
                and (not self.forward or self.forward_carried))


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    sites: tuple[Site, ...]
    offers: tuple[FormOffer, ...]  # the forms it takes, its default first
    # Config values no form can reproduce, as (key, allowed values, reason).
    requires: tuple[tuple[str, tuple, str], ...] = ()
    # Grouped-query attention: how many key/value heads a config has (None: one per query head). The heads of
    # a group share their key, so T[i] = W_Q^(i)^T W_K^(g(i)).
    kv_heads: Callable[[dict[str, Any]], int] | None = None
    # The relative position bias a module adds to its scores, read from its bound forward arguments during
    # calibration (None: it adds none). Refinement matches softmax(scaling * q.k + position bias) plus masks.
    position_bias: Callable[[Any, dict[str, Any]], Any] | None = None
    # Why a form is not offered, where the reason is worth saying: (form, reason).
    not_offered: tuple[tuple[str, str], ...] = ()

    @property
    def forms(self) -> tuple[str, ...]:
        return tuple(offer.form for offer in self.offers)

    def offer(self, form: str) -> FormOffer | None:
        return next((offer for offer in self.offers if offer.form == form), None)

    def site_of(self, module_name: str) -> Site | None:
        for site in self.sites:
            if re.search(site.pattern, module_name):
                return site
        return None

    def caches_keys(self, site: Site) -> bool:
        """Whether a site's keys are cached while generating: a decoder's self-attention and its reads of an
        encoder. An encoder's attention runs once over its input and caches nothing, so an encoder-only model
        reports no key cache (a decoder-sized figure for BERT read as if it had one)."""
        return site.causal or site.cross

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


def collaborative(layout: Layout, forward: Callable | None = None, forward_carried: bool = False) -> FormOffer:
    """The CP form: heads share one query and one key, each with a mixing vector."""
    return FormOffer(COLLABORATIVE_FORM, layout, forward, forward_carried=forward_carried)


def shared_key(layout: SharedKeyProjections, forward: Callable | None = None, requires=()) -> FormOffer:
    """The shared-key form: heads keep their queries and share one key (per RoPE frequency, where RoPE rotates)."""
    return FormOffer(SHARED_KEY_FORM, layout, forward, requires)


def multi_query(layout: MultiQueryProjections, requires=()) -> FormOffer:
    """The multi-query form: a stock checkpoint of the family with one key/value head of width W, keys and values
    compressed; loads without collab-convert, runs in serving engines."""
    return FormOffer(MULTI_QUERY_FORM, layout, None, requires)


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

# The shared-key form of models with absolute or relative positions (GPT-2, OPT, GPTBigCode, BART, T5): each head
# keeps its query (bias and all, so no content bias is needed), one shared key of R numbers per token replaces the
# key heads, and nothing rotates (every key dimension is pass-through). At moderate cuts of the cache it keeps more
# of the scores than the CP form; the CP form saves more parameters.
FAMILIES: tuple[Family, ...] = (
    Family(
        name="bert",
        # Models whose self-attention is BertSelfAttention or a verbatim copy of it.
        model_types=("bert", "roberta", "xlm-roberta", "electra", "camembert", "data2vec-text", "ernie"),
        sites=(Site(r"(^|\.)encoder\.layer\.\d+\.attention\.self$"),),
        offers=(collaborative(SeparateProjections(value="value", output="../output.dense")),),
        requires=_ABSOLUTE_ONLY,
    ),
    Family(
        name="distilbert",
        model_types=("distilbert",),
        sites=(Site(r"(^|\.)transformer\.layer\.\d+\.attention$", "n_heads"),),
        offers=(collaborative(SeparateProjections("q_lin", "k_lin", "v_lin", "out_lin")),),
    ),
    Family(
        # One attention module per layer group, shared by every layer of the group: decomposed once.
        name="albert",
        model_types=("albert",),
        sites=(Site(r"(^|\.)encoder\.albert_layer_groups\.\d+\.albert_layers\.\d+\.attention$"),),
        offers=(collaborative(SeparateProjections(value="value", output="dense")),),
        requires=_ABSOLUTE_ONLY,
    ),
    Family(
        # The relative position bias is added to the scores and untouched by the re-parametrization; calibration
        # reads it from the module's inputs, so refinement adds it as the module does.
        name="mpnet",
        model_types=("mpnet",),
        sites=(Site(r"(^|\.)encoder\.layer\.\d+\.attention\.attn$"),),
        offers=(collaborative(SeparateProjections("q", "k", "v", "o"), mpnet_forward, forward_carried=True),),
        position_bias=_handed_position_bias,
    ),
    Family(
        name="vit",
        model_types=("vit", "deit"),
        sites=(Site(r"(^|\.)layers\.\d+\.attention$"),),
        offers=(collaborative(SeparateProjections("q_proj", "k_proj", "v_proj", "o_proj")),),
    ),
    Family(
        name="gpt2",
        model_types=("gpt2",),
        sites=(Site(r"(^|\.)h\.\d+\.attn$", "n_head", causal=True),),
        offers=(
            # our forward, so the cache holds exactly the packed shared key (no head-size chunks)
            collaborative(FusedProjection("c_attn", conv1d=True, output="c_proj"), gpt2_forward),
            shared_key(SharedKeyProjections(fused="c_attn", conv1d=True, output="c_proj",
                                            output_dropout="resid_dropout", dropout="attn_dropout", input_norm="ln_1",
                                            rotates=False)),
        ),
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
        offers=(
            collaborative(FusedProjection("c_attn", output="c_proj"), gpt_bigcode_forward),
            shared_key(SharedKeyProjections(fused="c_attn", output="c_proj", output_dropout="resid_dropout",
                                            dropout="attn_dropout", input_norm="ln_1", rotates=False)),
        ),
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
        offers=(
            # our forward: its views spell out the head count, so the packed shared key needs our own
            collaborative(SeparateProjections("q_proj", "k_proj", "v_proj", "out_proj"), opt_forward),
            shared_key(
                SharedKeyProjections(output="out_proj", dropout="dropout", input_norm="self_attn_layer_norm",
                                     rotates=False),
                # A post-norm OPT (opt-350m) has no norm in front of its attention to tell the input scales
                requires=(("do_layer_norm_before", (None, True), "the shared-key form reads the scale of the norm "
                           "in front of attention, which a post-norm OPT does not have; its default (CP) form "
                           "works"),),
            ),
        ),
    ),
    Family(
        name="bart",
        model_types=("bart", "mbart", "marian", "pegasus"),
        sites=(
            Site(r"(^|\.)encoder\.layers\.\d+\.self_attn$", "encoder_attention_heads"),
            Site(r"(^|\.)decoder\.layers\.\d+\.self_attn$", "decoder_attention_heads", causal=True),
            Site(r"(^|\.)decoder\.layers\.\d+\.encoder_attn$", "decoder_attention_heads", cross=True),
        ),
        offers=(
            # our forward, so the caches hold exactly the packed shared key (no head-size chunks); the carried code
            # runs the module's own, whose views take any number of heads (its caches then hold padded heads)
            collaborative(SeparateProjections("q_proj", "k_proj", "v_proj", "out_proj"), bart_forward, True),
            # Every attention module takes the form; the decoder's caches hold the shared keys. BART normalises
            # after attention, so weight-only fits take isotropic inputs.
            shared_key(SharedKeyProjections(output="out_proj", dropout="dropout", input_norm=None, rotates=False),
                       bart_shared_key_forward),
        ),
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
        offers=(
            collaborative(SeparateProjections("q", "k", "v", "o"), t5_forward),
            shared_key(SharedKeyProjections(query="q", key="k", value="v", output="o", dropout="dropout",
                                            input_norm=None, rotates=False), t5_shared_key_forward),
        ),
        position_bias=_t5_position_bias,
    ),
)

_DECODER_LAYERS = (Site(r"(^|\.)layers\.\d+\.self_attn$", causal=True),)
_ROTARY = ((COLLABORATIVE_FORM, "it is a rotary decoder: it takes the shared-key form only (RoPE does not commute "
                                "with the CP form's shared query); drop --form collaborative"),)


def _kv_heads(config: dict[str, Any]) -> int:
    value = config.get("num_key_value_heads", config.get("num_attention_heads"))
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(f"config.json has no valid 'num_key_value_heads' ({value!r})")
    return value


def _rotary_decoder(name: str, model_types: tuple[str, ...], layout: SharedKeyProjections, *more: FormOffer,
                    **fields) -> Family:
    """A rotary decoder: per-head queries kept, one shared key per frequency (decompose/shared_key.py). RoPE
    itself, masks, sliding windows and soft-capping stay the model's own (modeling/shared_key.py). `more`: the
    other forms it offers."""
    return Family(name=name, model_types=model_types, sites=fields.pop("sites", _DECODER_LAYERS),
                  offers=(shared_key(layout), *more), not_offered=fields.pop("not_offered", _ROTARY), **fields)


# The stock multi-query shape is one head_dim, one RoPE frequency list and plain 1/sqrt(d) attention: families
# with per-head QK-norm, soft-capping or scalings of their own keep the shared-key form.
_STOCK = ("the multi-query form writes stock llama, mistral, qwen2 and phi3 (as llama) checkpoints; other model "
          "types keep the shared-key form (--key-cache)")


ROTARY_FAMILIES: tuple[Family, ...] = (
    _rotary_decoder("llama", ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gemma", "gemma2", "granite"),
                    SharedKeyProjections(),
                    multi_query(MultiQueryProjections(), requires=(("model_type", ("llama", "mistral", "qwen2"),
                                                                    _STOCK),))),
    # The norm acts on each head's query and key before RoPE: it stays, and the normalised keys are shared.
    _rotary_decoder("qk_norm", ("qwen3", "qwen3_moe", "gemma3_text"),
                    SharedKeyProjections(query_norm="q_norm", key_norm="k_norm")),
    _rotary_decoder("olmo2", ("olmo2",), SharedKeyProjections(query_norm="q_norm", key_norm="k_norm",
                                                              norm_over_heads=True, input_norm=None)),
    # in the multi-query form, written as the closest stock family (Llama; Mistral with a sliding window)
    _rotary_decoder("phi3", ("phi3",), SharedKeyProjections(fused="qkv_proj"),
                    multi_query(MultiQueryProjections(fused="qkv_proj", written_as=PHI3_AS_LLAMA)), kv_heads=_kv_heads),
    # Partial rotary; qk_layernorm (optional) normalises each head's query and key.
    _rotary_decoder("phi", ("phi",), SharedKeyProjections(output="dense", query_norm="q_layernorm",
                                                          key_norm="k_layernorm")),
    # Partial rotary, and q/k/v interleaved head by head in one projection.
    _rotary_decoder("gpt_neox", ("gpt_neox",), SharedKeyProjections(fused="query_key_value", interleaved=True,
                                                                    output="dense"),
                    sites=(Site(r"(^|\.)layers\.\d+\.attention$", causal=True),)),
)
FAMILIES = FAMILIES + ROTARY_FAMILIES

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
POSITIONS_AFTER_PADDING = ("roberta", "xlm-roberta", "camembert", "data2vec-text", "mpnet")
