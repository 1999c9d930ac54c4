"""Refinement parameters that read the layer's inputs, preconditioned by those inputs' second moment (pure torch).

A tensor W that multiplies inputs x (x W^T) has a loss whose curvature along W's input side is the inputs' second
moment E[x x^T]. Keys and hidden states are badly conditioned (on a SmolLM2 layer the key moment's eigenvalues
span 2e5), and Adam's per-entry scaling does not see the correlations. So the refinements move W' = W S^(1/4),
and read W = W' S^(-1/4): the same function, other coordinates. The power of a quarter is measured, not derived
(Shampoo's one-sided exponent): on four of SmolLM2's dumped layers at half the key cache, 200 steps at the same rate
reached a held-out output error 5.4% lower than without; full whitening (a half power) 11% higher at that rate and
1% lower at its best (a third of it); a fifth within 0.3% of the quarter. docs/benchmarks.md, "The shared-key
refinement in preconditioned coordinates".
"""

from __future__ import annotations

import torch

POWER = 0.25
RIDGE = 1e-3  # of the moment's mean eigenvalue, added before the roots: directions the inputs never take stay finite


class InputPreconditioner:
    """S^(-1/4) and S^(1/4) for inputs' second moment S (k, k); `readable(W')` = W' S^(-1/4), `moved(W)` = W S^(1/4).
    Stacked (L, k, k) for layers refined side by side."""

    def __init__(self, reading: torch.Tensor, moving: torch.Tensor):
        self.reading, self.moving = reading, moving

    @classmethod
    def of(cls, second_moment: torch.Tensor, power: float | None = None, ridge: float = RIDGE) -> InputPreconditioner:
        power = POWER if power is None else power
        moment = second_moment.double()
        moment = (moment + moment.T) / 2
        moment = moment + ridge * max(float(moment.diagonal().mean()), 1e-30) * torch.eye(
            len(moment), dtype=moment.dtype, device=moment.device)
        values, vectors = torch.linalg.eigh(moment)
        values = values.clamp_min(float(values.max()) * 1e-12)
        reading = (vectors * values ** -power) @ vectors.T
        moving = (vectors * values ** power) @ vectors.T
        return cls(reading.float(), moving.float())

    @classmethod
    def stacked(cls, preconditioners: list[InputPreconditioner]) -> InputPreconditioner:
        return cls(torch.stack([p.reading for p in preconditioners]), torch.stack([p.moving for p in preconditioners]))

    def to(self, device) -> InputPreconditioner:
        return InputPreconditioner(self.reading.to(device), self.moving.to(device))

    def readable(self, moved: torch.Tensor) -> torch.Tensor:
        """The weight the layer reads (..., k) from the refined coordinates."""
        return moved @ self.reading.to(moved.dtype)

    def moved(self, weight: torch.Tensor) -> torch.Tensor:
        """The refined coordinates of a weight (..., k)."""
        return weight @ self.moving.to(weight.dtype)


def second_moment(rows: list[torch.Tensor]) -> torch.Tensor:
    """E[x x^T] over every row of these (n, ..., k)-shaped tensors, flattened to (n, k), in float32."""
    width = rows[0][0].numel()
    total = torch.zeros(width, width, dtype=torch.float32, device=rows[0].device)
    count = 0
    for part in rows:
        flat = part.reshape(part.shape[0], width).float()
        total.addmm_(flat.T, flat)
        count += flat.shape[0]
    return total / max(count, 1)
