"""A step's error through a fixed output projection as a quadratic form (pure torch).

The refinements match the original layer's output T = R0 W^T, where R is what the heads read from the values and
W the output projection: |R W^T - T|^2 summed over rows. Written as R.(R G - 2 T W) + |T|^2 with G = W^T W, its
gradient 2 (R G - T W) is the forward's own product, so a step runs one product with the projection, not two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def quadratic_pays(output_weight: torch.Tensor | None) -> bool:
    """Whether the error as a quadratic form is the cheaper: its Gram matrix is (H d)^2 where the output projection
    is D x H d, so only where the heads are no wider than the model (Llama, Qwen2, GPT-2, BERT; not Gemma's)."""
    return output_weight is not None and output_weight.shape[1] <= output_weight.shape[0]


@dataclass
class QuadraticTargets:
    """What a step's error needs of the original output T at each row, for QuadraticError: T W (the rows' (H d)-wide
    target behind the output projection W) and |T|^2; and W^T W."""

    gram: torch.Tensor  # (H d, H d) in the products' dtype
    back: torch.Tensor  # (..., H d): T W, at least float32 once gathered
    energy: torch.Tensor  # (...): |T|^2 per row, at least float32

    @classmethod
    def of(cls, target_output: torch.Tensor, output_weight: torch.Tensor, products: torch.dtype) -> QuadraticTargets:
        """From stacked targets (S, n, D), a few sequences at a time; T W waits in the targets' own dtype (float16
        records: half of float32's bytes), or in float32 where that dtype cannot hold it."""
        wide = functools.reduce(torch.promote_types, (target_output.dtype, output_weight.dtype), torch.float32)
        weight = output_weight.to(wide)
        back = torch.empty(*target_output.shape[:-1], weight.shape[1], dtype=target_output.dtype,
                           device=target_output.device)
        energy = torch.empty(target_output.shape[:-1], dtype=wide, device=target_output.device)
        for start in range(0, target_output.shape[0], 8):
            part = target_output[start : start + 8].to(wide)
            projected = part @ weight
            if back.dtype != wide and not torch.isfinite(projected.to(back.dtype)).all():
                back = back.to(wide)
            back[start : start + 8] = projected
            energy[start : start + 8] = (part * part).sum(-1)
        return cls((weight.T @ weight).to(products), back, energy)

    def gathered(self, gather) -> QuadraticTargets:
        """The rows a step draws: `gather` takes stacked (S, n, ...) to (B, rows, ...)."""
        return QuadraticTargets(self.gram, gather(self.back).to(self.energy.dtype), gather(self.energy))


def per_layer(rows: torch.Tensor, matrix: torch.Tensor, layers: int = 1) -> torch.Tensor:
    """rows (L b, ..., k) @ matrix: one (k, n) matrix for all, or one per layer (L, k, n), each layer's rows
    against its own; (L b, ..., n)."""
    if matrix.dim() == 2:
        return rows @ matrix
    return (rows.reshape(layers, -1, rows.shape[-1]) @ matrix).view(*rows.shape[:-1], matrix.shape[-1])


class QuadraticError(torch.autograd.Function):
    """sum over rows of w |R W^T - T|^2 - |T|^2 = w R.(R G - 2 T W), with G = W^T W; the gradient with respect to
    the heads' reading R is 2 w (R G - T W), the forward's own product: the output projection's product in the
    backward is not needed (at SmolLM2's shape, a step's error forward and backward 0.96 -> 0.70 ms). The value
    is a difference of large terms (cancellation) in the products' precision: for Adam's steps, which read only
    the gradient; held-out checks take the plain error. Where the heads are wider than the model (quadratic_pays)
    it is not used."""

    @staticmethod
    def forward(ctx, read: torch.Tensor, gram: torch.Tensor, back: torch.Tensor, rows: torch.Tensor,
                layers: int = 1):
        # `rows`: each row's weight (0 for padding); `gram` (L, H d, H d): each of L layers' own, for its rows
        residual = per_layer(read.to(gram.dtype), gram, layers).to(back.dtype) - back  # R G - T W
        ctx.save_for_backward(residual, rows)
        ctx.dtype = read.dtype
        return ((read.to(back.dtype) * (residual - back)).sum(-1) * rows).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        residual, rows = ctx.saved_tensors
        return (residual * (2 * grad * rows[..., None])).to(ctx.dtype), None, None, None, None
