"""PipeMare's corrections as pure functions: T1 LR rescheduling, T2 discrepancy correction.

The techniques are named by Yang et al., "PipeMare: Asynchronous Pipeline Parallel DNN
Training" (MLSys 2021). The formulas are this project's definitions (docs: DESIGN.md); the
optimiser wrapper only wires them in.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "backward_weight",
    "delayed_gd_stability_bound",
    "lr_factor",
    "velocity_decay",
    "velocity_update",
]


def lr_factor(delay: float, step: int, horizon: int) -> float:
    """T1: the factor on the user's learning rate at a stage with forward delay ``delay``.

    ``α_{k,i} = α_k · max(τ_i, 1) ** -(1 - min(k / K, 1))``: the stage starts at ``α/τ_i`` and
    reaches the user's ``α`` after ``K = horizon`` steps, following the ``1/τ`` shape of the
    stability bound of delayed gradient descent (:func:`delayed_gd_stability_bound`).

    Example:
        >>> lr_factor(4.0, 0, 100), lr_factor(4.0, 50, 100), lr_factor(4.0, 100, 100)
        (0.25, 0.5, 1.0)
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    progress = 1.0 if horizon <= 0 else min(step / horizon, 1.0)
    return max(delay, 1.0) ** -(1.0 - progress)


def velocity_decay(discrepancy: float, decay: float) -> float:
    """T2: the stage's velocity decay ``γ_i = D ** (1 / Δ_i)``.

    A stage whose backward lags its forward by more updates averages its velocity over more
    of them. Stages with ``Δ_i <= 0`` need no correction; they get ``γ = 0``.
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


def delayed_gd_stability_bound(delay: int) -> float:
    """Largest stable ``αλ`` of ``u_{t+1} = u_t - αλ u_{t-τ}`` (delay τ, curvature λ).

    The bound is ``2 sin(π / (4τ + 2))``, about ``π / (2τ + 1)`` for large τ, so the stable
    step shrinks like ``1/τ``: the reason T1 divides the learning rate by the delay.
    """
    if delay < 0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    return 2.0 * math.sin(math.pi / (4 * delay + 2))
