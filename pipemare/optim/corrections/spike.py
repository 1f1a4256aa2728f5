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

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

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
        # One fused pass per param group (and Adam step count): a loop over the weights costs
        # several small kernels per tensor, a visible share of a step on narrow layers.
        groups: dict[tuple[int, float], tuple[Mapping[str, Any], list[nn.Parameter]]] = {}
        state = self.view.optimizer.state
        for p, hp in zip(params, hparams, strict=True):
            if p.grad is None or group_momentum(hp) == 0.0:
                continue
            t = float(state[p]["step"]) if "betas" in hp else 0.0
            groups.setdefault((id(hp), t), (hp, []))[1].append(p)
        decoupled = isinstance(self.view.optimizer, torch.optim.AdamW)
        for (_, t), (hp, ps) in groups.items():
            self._compensate(ps, hp, t, delay, decoupled)

    def _compensate(
        self,
        params: list[nn.Parameter],
        hp: Mapping[str, Any],
        t: float,
        delay: float,
        decoupled: bool,
    ) -> None:
        """The ``b`` term of one group's weights ``params`` (Adam's step count ``t``), each with a
        gradient."""
        a, b = spike_coefficients(group_momentum(hp), delay)
        lr = float(hp["lr"]) / a  # the rate before this correction's own factor
        state = self.view.optimizer.state
        ps: list[torch.Tensor] = list(params)
        adam = "betas" in hp
        if adam:
            beta1, beta2 = hp["betas"]
            # Adam's denominator √v̂ + ε is (√v + ε·r)/r with r = √(1 - β2^t): r moves into the
            # step's factor, two passes over the second moment instead of three
            root = math.sqrt(1 - beta2**t)
            denom = torch._foreach_sqrt([state[p]["exp_avg_sq"] for p in ps])
            torch._foreach_add_(denom, hp["eps"] * root)
        grads: list[torch.Tensor] = [p.grad for p in ps if p.grad is not None]
        wd = hp.get("weight_decay", 0)
        if wd and not (decoupled or hp.get("decoupled_weight_decay")):
            # L2 decay is part of the gradient the optimiser saw: of the weights before its
            # step, which the step's own direction gives back
            if adam:
                direction = torch._foreach_div([state[p]["exp_avg"] for p in ps], denom)
                torch._foreach_mul_(direction, root / (1 - beta1**t))
            else:
                direction = tuple(state[p]["momentum_buffer"] for p in ps)
            before = torch._foreach_add([p.detach() for p in ps], direction, alpha=float(hp["lr"]))
            grads = list(torch._foreach_add(grads, before, alpha=wd))
        if adam:
            value = -lr * b * (1 - beta1) / (1 - beta1**t) * root
            torch._foreach_addcdiv_(ps, grads, denom, value=value)
        else:
            torch._foreach_add_(ps, grads, alpha=-lr * b)
