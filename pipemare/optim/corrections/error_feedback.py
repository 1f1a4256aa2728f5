"""Error feedback on the delayed update (Zmushko et al., arXiv 2606.30634, 2026).

Under a one-step delay every update arrives a step late. The correction applies, after the
optimiser's own update ``d_t`` (its displacement of the weights), the change since the last
one: ``w ← w + c (d_t − d_{t−1})``. Summed over a run the extra terms telescope to ``c d_T``,
so the weights travel as far as without it; each update only lands earlier, by about ``c``
steps to first order. The paper uses ``c = 1`` at the constant one-step delay of
PipeDream-2BW and reports it recovering 58–90% of the gap between asynchronous and
synchronous training (Muon, SOAP, AdamW at 360M parameters).

Here a stage's delay can be up to ``P − 1`` updates: ``coefficient="delay"`` sets ``c = τ_i``
per stage (a linear extrapolation of the update ``τ_i`` steps ahead, which has no support in
the paper beyond ``τ = 1``); a number uses that ``c`` on every delayed stage. The last stage
(no delay) is left alone. Memory: one buffer per weight (``d_{t−1}``), plus a copy of one
stage's weights while it steps.

On ``f = λu²/2`` with plain SGD the iteration is
``u_{t+1} = u_t − α((1 + c) g_{t−τ} − c g_{t−τ−1})``: it contracts while every root of
``z^{τ+2} − z^{τ+1} + αλ((1 + c) z − c)`` lies inside the unit circle (:func:`stable_step`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from pipemare.optim.corrections.base import Correction, Params

__all__ = ["ErrorFeedback", "stable_step"]


def stable_step(delay: int, coefficient: float, tol: float = 1e-9) -> float:
    """The largest ``αλ`` at which SGD with error feedback contracts on the delayed quadratic.

    Example:
        >>> round(stable_step(1, 0.0), 4)  # no feedback: delayed GD, 2 sin(π/6)
        1.0
    """
    if delay < 0 or coefficient < 0:
        raise ValueError(f"delay and coefficient must be >= 0, got {delay} and {coefficient}")

    def contracts(step: float) -> bool:
        poly = np.zeros(delay + 3)
        poly[0], poly[1] = 1.0, -1.0  # z^{τ+2} - z^{τ+1}
        poly[-2] += step * (1.0 + coefficient)
        poly[-1] -= step * coefficient
        return bool(np.max(np.abs(np.roots(poly))) < 1.0)

    low, high = 0.0, 4.0
    while high - low > tol:
        mid = (low + high) / 2
        if contracts(mid):
            low = mid
        else:
            high = mid
    return low


class ErrorFeedback(Correction):
    """Adds ``c (d_t − d_{t−1})`` after each delayed stage's update (see the module).

    Args:
        coefficient: ``c``: a number >= 0 for every delayed stage (the paper's 1), or
            ``"delay"``: each stage's forward delay ``τ_i``.
        start: the first step it applies to (T3's warm-up steps have no delay).
    """

    name = "error_feedback"
    derived_for = (
        "Muon, SOAP and AdamW at a one-step delay (Zmushko et al., 2026); it corrects the step "
        "the optimiser took, so it runs with any optimiser"
    )

    def __init__(self, coefficient: float | str = 1.0, start: int = 0) -> None:
        if coefficient != "delay" and not (
            isinstance(coefficient, (int, float)) and coefficient >= 0
        ):
            raise ValueError(f"coefficient must be a number >= 0 or 'delay', got {coefficient!r}")
        self.coefficient, self.start = coefficient, start
        self.previous: dict[nn.Parameter, torch.Tensor] = {}  # d_{t-1}, one per weight
        self._before: dict[int, list[torch.Tensor]] = {}  # the stage's weights before its step

    def keeps_copy(self, stage: int) -> bool:
        """A delayed stage keeps its previous step (a copy of its trained weights' size)."""
        return self.view.delays[stage].forward > 0

    def stage_coefficient(self, stage: int) -> float:
        """``c`` of ``stage`` now (0 on a stage without delay; the guard's strength on it)."""
        delay = self.view.delays[stage].forward
        if delay <= 0:
            return 0.0
        c = delay if self.coefficient == "delay" else float(self.coefficient)
        return c * self.view.stage_strength(stage)

    @torch.no_grad()
    def before_step(self, stage: int, params: Params) -> None:
        if self.view.delays[stage].forward > 0:
            self._before[stage] = [p.detach().clone() for p in params]

    @torch.no_grad()
    def after_step(self, stage: int, minibatch: int, params: Params, hparams: Any) -> None:
        before = self._before.pop(stage, None)
        if before is None:
            return
        c = self.stage_coefficient(stage) if self._applies(minibatch) else 0.0
        for p, old in zip(params, before, strict=True):
            step = p.detach() - old  # d_t, the optimiser's own displacement
            last = self.previous.get(p)
            if last is not None and c > 0:
                p.detach().add_((step - last.to(step.dtype)).mul_(c))
            keep = step if step.dtype in (torch.float32, torch.float64) else step.float()
            self.previous[p] = keep

    def buffers(self) -> dict[nn.Parameter, torch.Tensor]:
        return self.previous

    def load_buffers(self, buffers: Mapping[nn.Parameter, torch.Tensor]) -> None:
        self.previous = {p: b.to(p.device) for p, b in buffers.items()}
