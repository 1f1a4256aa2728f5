"""Spike compensation (Kosson et al., "Pipelined Backpropagation at Scale", MLSys 2021).

With momentum ``m``, a gradient that arrives ``D`` updates late has missed the first ``D``
terms of its momentum series ``1 + m + m² + ...``. Spike compensation applies them at once:
the update becomes ``w ← w - η (a v + b g)`` with ``a = m^D`` and ``b = (1 - m^D)/(1 - m)``, so
every gradient has moved the weights by exactly what it would have without the delay, both
``D`` steps after it was computed and in total (``b + a/(1 - m) = 1/(1 - m)``).

For Adam and AdamW the first moment ``m̂`` plays the momentum's part with ``m = β1`` and
``(1 - β1) g`` the gradient's share of it, in Adam's own preconditioning:
``w ← w - η (a m̂ + b (1 - β1) g / (1 - β1^t)) / (√v̂ + ε)``. Plain SGD is left alone (with
``m = 0`` the compensated update equals the plain one).
"""

from __future__ import annotations

import torch

from pipemare.optim.corrections.base import (
    Correction,
    HParams,
    Params,
    StageView,
    group_momentum,
)

__all__ = ["SpikeCompensation", "spike_coefficients", "unsupported"]


def spike_coefficients(momentum: float, delay: float) -> tuple[float, float]:
    """``(a, b) = (m^D, (1 - m^D)/(1 - m))``: the weights of momentum and fresh gradient.

    Example:
        >>> spike_coefficients(0.5, 2)
        (0.25, 1.5)
        >>> spike_coefficients(0.9, 0)
        (1.0, 0.0)
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
    if delay < 0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    a = momentum**delay
    return a, (1.0 - a) / (1.0 - momentum)


def unsupported(opt: torch.optim.Optimizer) -> str | None:
    """Why spike compensation cannot run with ``opt``, or None."""
    if type(opt) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return f"spike compensation supports SGD, Adam and AdamW, not {type(opt).__name__}"
    for g in opt.param_groups:
        if g.get("nesterov") or g.get("dampening", 0):
            return (
                "spike compensation assumes heavy-ball momentum without dampening: use "
                "SGD(momentum=m) with nesterov=False and dampening=0"
            )
        if g.get("amsgrad") or g.get("maximize"):
            return "spike compensation does not support amsgrad or maximize"
    return None


class SpikeCompensation(Correction):
    """Applies the missed momentum terms of a late gradient at once; keeps no buffer.

    Args:
        start: the first step it applies to (T3's warm-up steps have no delay).
    """

    name = "spike_compensation"
    derived_for = (
        "heavy-ball SGD (Kosson et al.), extended here to Adam and AdamW; 'auto' stands aside"
        " for Nesterov, dampening, Muon and other optimisers"
    )

    def __init__(self, start: int = 0) -> None:
        self.start = start

    def bind(self, view: StageView) -> None:
        super().bind(view)
        problem = unsupported(view.optimizer)
        if problem is not None:  # resolve() refuses it first; a correction built by hand too
            raise ValueError(f"{problem}; or switch it off (spike_compensation=False)")

    def _delay(self, stage: int) -> float:
        return self.view.delays[stage].forward * self.view.stage_strength(stage)

    def lr_factor(self, stage: int, step: int) -> float:
        """``a`` of :func:`spike_coefficients` for the stage's delay (1 without momentum)."""
        if not self._applies(step):
            return 1.0
        # The optimiser's own step becomes a·(its update); the b term is added after it.
        # All groups of one optimiser share a momentum in practice; the first one's is used,
        # as the stage's update will see it (a delay-aware momentum may have changed it).
        m = self.view.stage_momentum(stage, step)
        if m == 0.0:  # without momentum the compensated update is the plain one
            return 1.0
        return spike_coefficients(m, self._delay(stage))[0]

    @torch.no_grad()
    def after_step(self, stage: int, minibatch: int, params: Params, hparams: HParams) -> None:
        delay = self._delay(stage)
        if delay <= 0 or not self._applies(minibatch):
            return
        decoupled = isinstance(self.view.optimizer, torch.optim.AdamW)
        for p, hp in zip(params, hparams, strict=True):
            m = group_momentum(hp)
            if p.grad is None or m == 0.0:
                continue
            a, b = spike_coefficients(m, delay)
            lr = float(hp["lr"]) / a  # the rate before this correction's own factor
            state = self.view.optimizer.state[p]
            adam = "betas" in hp
            if adam:
                t = float(state["step"])
                beta1, beta2 = hp["betas"]
                denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(hp["eps"])
                direction = state["exp_avg"] / (1 - beta1**t) / denom
            else:
                direction = state["momentum_buffer"]
            g = p.grad
            wd = hp.get("weight_decay", 0)
            if wd and not (decoupled or hp.get("decoupled_weight_decay")):
                # L2 decay is part of the gradient the optimiser saw: of the weights before
                # its step, which the step's own direction gives back
                g = g.add(p.detach() + float(hp["lr"]) * direction, alpha=wd)
            if adam:
                p.addcdiv_(g, denom, value=-lr * b * (1 - beta1) / (1 - beta1**t))
            else:
                p.add_(g, alpha=-lr * b)
