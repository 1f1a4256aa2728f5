"""Forward weight prediction: run a delayed stage's forward with the weights its update will meet.

A stage whose gradient lands ``s`` updates after its forward pass runs that forward with
``ŵ = w + s · δ``, where ``δ`` is the optimiser's own recent step (an exponential average of
``w_new - w_old``, decay γ; γ = 0 is the last step). This is the prediction of SpecTrain
(Chen et al., 2018, from SGD's momentum), XPipe (Guan et al., 2019, from Adam's step) and
PipeOptim (2023, ``Ŵ_{t+s} = W_t - lr · s · ΔW_t`` with the update rule of SGD-M, Adam or
AdamW); taking the step that was actually applied covers every optimiser and every
learning-rate factor at once. Kosson et al. ("Pipelined Backpropagation at Scale", 2020) call
it linear weight prediction and pair it with spike compensation (:mod:`.spike`).

The prediction is applied to the parameters *in place* for the duration of the forward and
undone after it, so no copy of the weights is kept; the delayed backward then sees the live
weights of its own time, which is what the forward was aiming at. ``s`` is exact: the index of
the update that will consume the microbatch's gradient minus the stage's version at the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from pipemare.optim.corrections.base import StepAveraged, foreach_pair

__all__ = ["WeightPrediction", "predicted_weight"]


@torch.no_grad()
def predicted_weight(weight: torch.Tensor, step: torch.Tensor, horizon: float) -> torch.Tensor:
    """Reference: ``ŵ = w + s · δ``, out of place (the correction applies it in place).

    Example:
        >>> predicted_weight(torch.tensor([1.0]), torch.tensor([-0.5]), 3).item()
        -0.5
    """
    return weight + horizon * step


class WeightPrediction(StepAveraged):
    """Forward passes run with ``w + s · δ``; one step-average buffer per weight.

    Args:
        decay: γ of the step average (0: the last step only; nearer 1: a smoother direction).
        scale: factor on the horizon ``s`` (1: extrapolate all the way to the update).
    """

    name = "weight_prediction"
    derived_for = (
        "SGD with momentum (SpecTrain), Adam (XPipe), SGD-M/Adam/AdamW (PipeOptim); extrapolates"
        " the step actually taken, so Muon too; 'auto' stands aside for SGD without momentum,"
        " whose stable range it narrows (on the delayed quadratic, from 1.0 to 0.62 at τ = 1)"
    )

    def __init__(self, decay: float = 0.0, scale: float = 1.0) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"the prediction's step decay must lie in [0, 1), got {decay}")
        if scale < 0:
            raise ValueError(f"the prediction's horizon scale must be >= 0, got {scale}")
        self.decay, self.scale = decay, scale
        super().__init__()

    def _step_decay(self, stage: int) -> float | None:
        return self.decay if self.view.delays[stage].forward_max > 0 else None

    @contextlib.contextmanager
    def forward_weights(self, stage: int, horizon: int) -> Iterator[None]:
        s = self.scale * horizon * self.view.stage_strength(stage)
        pairs = []
        if s != 0:
            pairs = [
                (p, u) for p in self.view.params[stage] if (u := self.steps.neg.get(p)) is not None
            ]
        self._move(pairs, -s)  # u = -δ
        try:
            yield
        finally:
            self._move(pairs, s)

    @staticmethod
    def _move(pairs: list[tuple[nn.Parameter, torch.Tensor]], alpha: float) -> None:
        foreach_pair(
            [p for p, _ in pairs],
            [u for _, u in pairs],
            lambda ps, us: torch._foreach_add_(ps, us, alpha=alpha),
            lambda p, u: p.add_(u, alpha=alpha),
        )
