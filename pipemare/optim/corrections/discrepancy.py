"""T2, discrepancy correction (Yang et al., "PipeMare", MLSys 2021).

A delayed backward pass should use the weights its forward ran with. Without a stash, T2
estimates them from a velocity kept per weight, ``δ ← γ_i δ + (1 - γ_i)(w_new - w_old)``:
the backward uses ``w - Δ_i δ``, with ``Δ_i = τ_fwd,i - τ_bkwd,i`` the updates between the two
passes and ``γ_i = D ** (1/Δ_i)``. D = 0.1 left the least discrepancy in the project's
measurement (docs/schedules.md, "Staleness corrections").
"""

from __future__ import annotations

import torch
from torch import nn

from pipemare.optim.corrections.base import StepAveraged

__all__ = ["DiscrepancyCorrection", "backward_weight", "velocity_decay", "velocity_update"]


def velocity_decay(discrepancy: float, decay: float) -> float:
    """T2: the stage's velocity decay ``γ_i = D ** (1 / Δ_i)`` (0 where ``Δ_i <= 0``).

    Example:
        >>> velocity_decay(2.0, 0.25), velocity_decay(0.0, 0.25)
        (0.5, 0.0)
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"the discrepancy decay D must lie in [0, 1), got {decay}")
    return decay ** (1.0 / discrepancy) if discrepancy > 0 else 0.0


@torch.no_grad()
def velocity_update(
    velocity: torch.Tensor, old: torch.Tensor, new: torch.Tensor, gamma: float
) -> torch.Tensor:
    """T2 reference: ``δ ← γ δ + (1 - γ)(w_new - w_old)``, out of place (used by tests)."""
    return gamma * velocity + (1.0 - gamma) * (new - old)


@torch.no_grad()
def backward_weight(weight: torch.Tensor, velocity: torch.Tensor, delta: float) -> torch.Tensor:
    """T2: the backward pass's estimate of forward-time weights, ``w - Δ δ``.

    The result keeps ``weight``'s strides so views saved by autograd can be re-applied to it.
    """
    out = torch.empty_like(weight)
    torch.sub(weight, velocity.to(weight.dtype), alpha=delta, out=out)
    return out


class DiscrepancyCorrection(StepAveraged):
    """T2: the backward pass runs with ``w - Δ δ``; one velocity buffer per weight.

    Args:
        decay: D; a stage's velocity decay is ``γ_i = D ** (1/Δ_i)``; D = 0 keeps the last step.
    """

    name = "discrepancy_correction"
    derived_for = "any optimiser: it averages the steps the optimiser actually took"

    def __init__(self, decay: float = 0.1) -> None:
        velocity_decay(1.0, decay)  # validates D
        self.decay = decay
        super().__init__()

    def _step_decay(self, stage: int) -> float | None:
        discrepancy = self.view.delays[stage].discrepancy
        # Stages whose backward is not behind their forward (the last one) need no velocity.
        return velocity_decay(discrepancy, self.decay) if discrepancy > 0 else None

    def backward_weight(self, param: nn.Parameter, delta: int) -> torch.Tensor | None:
        u = self.steps.neg.get(param)
        if delta <= 0 or u is None:
            return None
        return backward_weight(param.detach(), u, -float(delta))

    def velocity(self, param: nn.Parameter) -> torch.Tensor | None:
        return self.steps.velocity(param)
