"""llama.cpp's `llama` graph written in torch, over a GGUF file's own tensors: the check that a GGUF export computes
what transformers does, on machines without llama.cpp. It follows llama.cpp (src/models/llama.cpp): RMSNorm, the
query/key/value projections (with their biases where the file has them), RoPE on adjacent pairs (2i, 2i + 1) at
theta_i = position * base^(-2i/n_rot) / rope_freqs[i], cos and sin scaled by the attention factor, grouped heads,
1/sqrt(head size) scores with the causal mask, the output projection, and a SwiGLU feed-forward."""

from __future__ import annotations

from pathlib import Path

import torch


def _tensors(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    tensors = {}
    for tensor in reader.tensors:
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = tensor.data
        else:
            data = dequantize(tensor.data, tensor.tensor_type)
        tensors[tensor.name] = torch.from_numpy(data.astype("float32").copy())
    return metadata, tensors


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(n, heads, d) with adjacent pairs (2i, 2i + 1) turned by (n, d/2) angles."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def reference_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits (n, vocab) of one sequence of token ids (n,) under llama.cpp's llama graph, from the file alone."""
    metadata, t = _tensors(path)
    heads, kv = int(metadata["llama.attention.head_count"]), int(metadata["llama.attention.head_count_kv"])
    d, eps = int(metadata["llama.attention.key_length"]), float(metadata["llama.attention.layer_norm_rms_epsilon"])
    base, scale = float(metadata["llama.rope.freq_base"]), float(metadata.get("llama.rope.scaling.attn_factor", 1.0))
    n = input_ids.shape[0]
    factors = t.get("rope_freqs.weight", torch.ones(d // 2))
    angles = torch.arange(n).float()[:, None] * base ** (-torch.arange(0, d, 2).float() / d) / factors
    cos, sin = (angles.cos() * scale)[:, None], (angles.sin() * scale)[:, None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    hidden = t["token_embd.weight"][input_ids]
    for layer in range(int(metadata["llama.block_count"])):
        p = f"blk.{layer}."
        x = _rms(hidden, t[p + "attn_norm.weight"], eps)
        q, k, v = (x @ t[f"{p}attn_{s}.weight"].T + t.get(f"{p}attn_{s}.bias", 0) for s in "qkv")
        q, k = _rope(q.view(n, heads, d), cos, sin), _rope(k.view(n, kv, d), cos, sin)
        k, v = (m.view(n, kv, d).repeat_interleave(heads // kv, dim=1) for m in (k, v))
        scores = torch.einsum("nhd,mhd->hnm", q, k) / d ** 0.5
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attended = torch.einsum("hnm,mhd->nhd", weights, v).reshape(n, heads * d)
        hidden = hidden + attended @ t[p + "attn_output.weight"].T + t.get(p + "attn_output.bias", 0)
        x = _rms(hidden, t[p + "ffn_norm.weight"], eps)
        gated = torch.nn.functional.silu(x @ t[p + "ffn_gate.weight"].T) * (x @ t[p + "ffn_up.weight"].T)
        hidden = hidden + gated @ t[p + "ffn_down.weight"].T
    output = t.get("output.weight", t["token_embd.weight"])
    return _rms(hidden, t["output_norm.weight"], eps) @ output.T
