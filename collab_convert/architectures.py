"""Everything collab-convert knows about model families, as data.

A family says which config `model_type`s it covers, how its attention modules are named (a regex over
module / tensor-name prefixes) and what their query/key projections are called. The collaborative module
keeps the original forward (see modeling.py), so adding a family is one entry in FAMILIES and a test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    # Matches the attention module's dotted name, with or without a base-model prefix ("bert.").
    attention_pattern: str
    query: str = "query"
    key: str = "key"
    value: str = "value"
    num_heads_key: str = "num_attention_heads"
    hidden_size_key: str = "hidden_size"

    def is_attention(self, module_name: str) -> bool:
        return re.search(self.attention_pattern, module_name) is not None

    def num_heads(self, config: dict[str, Any]) -> int:
        return int(config[self.num_heads_key])


FAMILIES: tuple[Family, ...] = (
    Family(
        name="bert",
        # Models whose self-attention is BertSelfAttention or a verbatim copy of it.
        model_types=("bert", "roberta", "xlm-roberta", "electra", "camembert", "data2vec-text"),
        attention_pattern=r"(^|\.)encoder\.layer\.\d+\.attention\.self$",
    ),
)

# Families the collaborative form cannot represent exactly, and why. Checked before FAMILIES.
REFUSED: dict[str, str] = {
    **{
        t: "it uses rotary position embeddings, which make W_Q R W_K^T depend on the token offset, "
        "so heads cannot share one query/key projection exactly"
        for t in (
            "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
            "gemma3", "gemma3_text", "phi", "phi3", "gpt_neox", "gptj", "falcon", "olmo", "olmo2", "stablelm",
            "starcoder2", "cohere", "granite", "roformer", "esm", "modernbert", "nomic_bert",
        )
    },
    "deberta": "its disentangled attention adds content-to-position terms with their own projections",
    "deberta-v2": "its disentangled attention adds content-to-position terms with their own projections",
}


def family_for(config: dict[str, Any]) -> Family:
    model_type = config.get("model_type")
    if not model_type:
        raise UnsupportedModelError("config.json has no model_type, so the architecture cannot be recognised")
    if model_type in REFUSED:
        raise UnsupportedModelError(f"model_type '{model_type}' is not supported: {REFUSED[model_type]}")
    for family in FAMILIES:
        if model_type in family.model_types:
            _check_config(family, config)
            return family
    supported = ", ".join(sorted(t for f in FAMILIES for t in f.model_types))
    raise UnsupportedModelError(f"model_type '{model_type}' is not supported (supported: {supported})")


def _check_config(family: Family, config: dict[str, Any]) -> None:
    position = config.get("position_embedding_type", "absolute")
    if position not in (None, "absolute"):
        # relative_key(_query) adds terms built from the query and key projections themselves.
        raise UnsupportedModelError(
            f"position_embedding_type '{position}' is not supported: its relative-position scores use the "
            "per-head query and key vectors"
        )
    for key in (family.num_heads_key, family.hidden_size_key):
        if not isinstance(config.get(key), int) or config[key] <= 0:
            raise UnsupportedModelError(f"config.json has no valid '{key}'")


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)
