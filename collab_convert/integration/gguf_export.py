"""A stock llama-family checkpoint (a multi-query output, or any llama, mistral or qwen2 model) as a GGUF file that
llama.cpp runs with its `llama` architecture, and the check that the file computes what transformers does.

Names and layout are llama.cpp's (its convert_hf_to_gguf.py writes the same): token_embd, blk.N.attn_norm,
attn_q/k/v (and their biases), attn_output, ffn_gate/up/down, ffn_norm, output_norm, output. llama.cpp's llama
graph rotates adjacent pairs (2i, 2i+1) where transformers' rotate_half pairs i with i + d/2, so the query and key
rows of every head are interleaved. Per-pair RoPE frequencies go in the `rope_freqs` tensor, which divides each
pair's angle: theta_i = position * base^(-2i/d) / rope_freqs[i], the longrope factors of integration/rope.py.

The check (reference_logits) runs the file's own tensors through llama.cpp's graph written in torch (adjacent-pair
RoPE with the file's factors, grouped heads, RMSNorm, SwiGLU): a mistake in any permutation or factor shows as a
difference from transformers' logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInputError
from ..io.reader import TensorReader

STOCK_TYPES = ("llama", "mistral", "qwen2")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
LAYER_NAMES = {  # transformers' name inside layer N -> llama.cpp's
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
MODEL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}


@dataclass(frozen=True)
class GgufShape:
    """What the file says of the model, from its config."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int


def shape_of(config: dict) -> GgufShape:
    if config.get("quantization_config"):  # (whose model_type is then its own: format.MODEL_TYPE_PREFIX)
        raise BadInputError("this checkpoint loads through collab-convert's own modules, which llama.cpp does not "
                            "have: export a stock one (compress with --kv-cache, the multi-query form)")
    if config.get("model_type") not in STOCK_TYPES:
        raise BadInputError(f"GGUF export writes llama.cpp's llama architecture from llama, mistral or qwen2 "
                            f"checkpoints, not model_type {config.get('model_type')!r}")
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    return GgufShape(int(config["num_hidden_layers"]), heads, int(config.get("num_key_value_heads") or heads),
                     head_dim, hidden)


def interleaved(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Query or key rows (heads * d, ...) from rotate_half pairs (i, i + d/2) to adjacent pairs (2i, 2i + 1)."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_name(name: str) -> str | None:
    if name in MODEL_NAMES:
        return MODEL_NAMES[name]
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and ".".join(parts[3:]) in LAYER_NAMES:
        return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}"
    return None


def write_gguf(folder: Path, target: Path, dtype: str, progress) -> dict:
    """Write the checkpoint in `folder` to `target`; what it wrote (head sizes, RoPE factors, the tokenizer's
    source)."""
    import gguf

    from .rope import rope_frequencies, stock_rope_parameters

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    shape = shape_of(config)
    rope = rope_frequencies(folder)
    pairs = torch.arange(shape.head_dim // 2)
    parameters = stock_rope_parameters(rope, pairs)
    if parameters["short_factor"] != parameters["long_factor"]:
        raise BadInputError("its RoPE switches frequencies past a context length (longrope with two factor lists), "
                            "which llama.cpp's llama architecture cannot say")
    writer = gguf.GGUFWriter(str(target), "llama")
    _write_metadata(writer, config, shape, rope, dtype)
    tokenizer = _write_tokenizer(writer, folder, config)
    factors = torch.tensor(parameters["short_factor"], dtype=torch.float32)
    if not torch.allclose(factors, torch.ones_like(factors), rtol=0, atol=1e-6):
        writer.add_tensor("rope_freqs.weight", factors.numpy())
    reader = TensorReader(folder)
    try:
        names = reader.names()
        for index, name in enumerate(names):
            progress("writing GGUF", index, len(names))
            _add_tensor(writer, gguf, name, gguf_name(name), reader.get(name), shape, dtype)
    finally:
        reader.close()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"dtype": dtype, "head_dim": shape.head_dim, "kv_heads": shape.kv_heads, "heads": shape.heads,
            "rope_freqs": bool(not torch.allclose(factors, torch.ones_like(factors), rtol=0, atol=1e-6)),
            "tokenizer": tokenizer}


def _write_metadata(writer, config: dict, shape: GgufShape, rope, dtype: str) -> None:
    import gguf

    writer.add_name(str(config.get("_name_or_path") or "collab-convert export"))
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(rope.theta)
    if abs(rope.attention_factor - 1.0) > 1e-9:
        writer.add_rope_scaling_attn_factors(rope.attention_factor)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16}[dtype])


def _add_tensor(writer, gguf, name: str, target: str | None, tensor: torch.Tensor, shape: GgufShape,
                dtype: str) -> None:
    if target is None:
        if name.endswith("rotary_emb.inv_freq"):
            return
        raise BadInputError(f"GGUF export does not know where tensor {name} goes in llama.cpp's llama architecture")
    tensor = tensor.float()
    if target.endswith(("attn_q.weight", "attn_q.bias")):
        tensor = interleaved(tensor, shape.heads)
    elif target.endswith(("attn_k.weight", "attn_k.bias")):
        tensor = interleaved(tensor, shape.kv_heads)
    if tensor.dim() == 1 or dtype == "f32":  # norms and biases stay float32, as llama.cpp's converter writes them
        writer.add_tensor(target, tensor.numpy())
    elif dtype == "f16":
        writer.add_tensor(target, tensor.half().numpy())
    else:  # numpy has no bfloat16: its raw bytes, typed for the file
        raw = tensor.bfloat16().view(torch.uint16).numpy()
        writer.add_tensor(target, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)


def _write_tokenizer(writer, folder: Path, config: dict) -> str:
    """The tokenizer, as llama.cpp reads it: copied from the GGUF the model came from (recorded by io/gguf.py, or in
    a multi-query output's provenance), else built from a byte-level BPE tokenizer.json."""
    from ..io.gguf import source_of

    source = source_of(folder) or (config.get("collab_convert") or {}).get("source_gguf")
    if source and Path(source).is_file():
        _copy_tokenizer(writer, Path(source))
        return f"copied from {Path(source).name}"
    import gguf
    from gguf.vocab import BpeVocab, SpecialVocab

    try:
        vocab = BpeVocab(folder)
    except (FileNotFoundError, ValueError):
        raise BadInputError("llama.cpp needs the tokenizer inside the GGUF: this model came from no GGUF file and its "
                            "tokenizer is not a byte-level BPE tokenizer.json the exporter can convert") from None
    tokens, types = [], []
    for text, _, kind in [*vocab.bpe_tokens(), *vocab.added_tokens()]:
        tokens.append(text if isinstance(text, str) else text.decode("utf-8"))
        types.append(kind)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # llama.cpp names pre-tokenizers by a hash table of its own converter
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)
    del gguf
    return "converted from tokenizer.json (byte-level BPE, default pre-tokenizer)"


def _copy_tokenizer(writer, source: Path) -> None:
    from gguf import GGUFReader, GGUFValueType

    for name, field in GGUFReader(str(source)).fields.items():
        if not name.startswith("tokenizer."):
            continue
        value, kind = field.contents(), field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, kind)
