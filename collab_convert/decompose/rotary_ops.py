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
    return rotate_slots(key, cos[..., slot_frequencies], sin[..., slot_frequencies])


def rotate_slots(x: torch.Tensor, slot_cos: torch.Tensor, slot_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (…, n, 2W + P) shared-basis coordinates, with cos/sin already taken at each slot's frequency."""
    width = slot_cos.shape[-1]
    real, imaginary, rest = x[..., :width], x[..., width:2 * width], x[..., 2 * width:]
    return torch.cat((real * slot_cos - imaginary * slot_sin, imaginary * slot_cos + real * slot_sin, rest), dim=-1)


def query_basis_matrix(query_core: torch.Tensor, pass_core: torch.Tensor, slot_frequencies: torch.Tensor,
                       rotary_dim: int, head_dim: int) -> torch.Tensor:
    """query_in_shared_basis as one real matrix per head, (N_h, d, 2W + P), to apply BEFORE RoPE.

    A complex scalar per frequency commutes with the rotation, so core-then-rotate (in the shared basis, as the
    key is rotated) equals rotate-then-core: one batched product and the key's rotation replace the query's
    own RoPE and the per-slot gathers."""
    heads, _, width = query_core.shape
    half, slots = rotary_dim // 2, torch.arange(width, device=query_core.device)
    real, imaginary = query_core[:, 0], query_core[:, 1]
    matrix = query_core.new_zeros(heads, head_dim, 2 * width + pass_core.shape[-1])
    matrix[:, slot_frequencies, slots] = real  # Re(q c) = q_re c_re - q_im c_im
    matrix[:, half + slot_frequencies, slots] = -imaginary
    matrix[:, slot_frequencies, width + slots] = imaginary  # Im(q c) = q_re c_im + q_im c_re
    matrix[:, half + slot_frequencies, width + slots] = real
    if pass_core.shape[-1]:
        matrix[:, rotary_dim:, 2 * width:] = pass_core
    return matrix


def slot_coordinates(queries: torch.Tensor, slots: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotated queries (..., d) at each slot's frequency, (..., 2W + p): the real parts, the imaginary parts, then
    the pass-through dimensions: what a head's complex core per slot multiplies."""
    if not rotary_dim:  # absolute positions: every dimension passes through, in order
        return queries
    half = rotary_dim // 2
    rest = torch.arange(rotary_dim, queries.shape[-1], device=slots.device)
    # indexing, not index_select: along the last dimension index_select took 4x as long on a CPU (a SmolLM2 layer's
    # stacked queries: 13.7 against 3.1 ms a block of 32 sequences), the same numbers
    return queries[..., torch.cat([slots, half + slots, rest]).to(queries.device)]
