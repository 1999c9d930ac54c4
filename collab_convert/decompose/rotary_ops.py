"""The runtime operations of the shared rotary key (see rotary.py), shared by the model and the tests.

Shapes: heads sit at dim -3 and tokens at dim -2; cos/sin are transformers' (…, n, rotary_dim) tables
(cat(freqs, freqs) layout), broadcastable to the rotated tensor.
"""

from __future__ import annotations

import torch


def rotate_half_dims(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """RoPE on the first rotary_dim dimensions, as transformers' apply_rotary_pos_emb does."""
    rotary, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    turned = torch.cat((-rotary[..., half:], rotary[..., :half]), dim=-1)
    rotated = rotary * cos + turned * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def query_in_shared_basis(query: torch.Tensor, query_core: torch.Tensor, pass_core: torch.Tensor,
                          slot_frequencies: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotated per-head queries (…, N_h, n, d) -> their coordinates against the shared key (…, N_h, n, 2W + P).

    Complex slot s of head i is q_{i,j(s)} * core_{i,s}: a complex scalar per frequency, so it commutes with
    the rotation already applied."""
    half = rotary_dim // 2
    real, imaginary = query[..., slot_frequencies], query[..., half + slot_frequencies]
    core_real, core_imaginary = query_core[:, 0, None, :], query_core[:, 1, None, :]  # (N_h, 1, W)
    parts = [real * core_real - imaginary * core_imaginary, real * core_imaginary + imaginary * core_real]
    if pass_core.shape[-1]:
        parts.append(torch.einsum("...hnp,hpr->...hnr", query[..., rotary_dim:], pass_core))
    return torch.cat(parts, dim=-1)


def rotate_shared_key(key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      slot_frequencies: torch.Tensor) -> torch.Tensor:
    """RoPE on the shared key (…, n, 2W + P): complex slot s turns at its own frequency j(s)."""
    width = slot_frequencies.shape[0]
    cos, sin = cos[..., slot_frequencies], sin[..., slot_frequencies]
    real, imaginary, rest = key[..., :width], key[..., width:2 * width], key[..., 2 * width:]
    return torch.cat((real * cos - imaginary * sin, imaginary * cos + real * sin, rest), dim=-1)
