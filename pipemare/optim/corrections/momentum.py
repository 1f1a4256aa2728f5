"""Delay-aware momentum: the weight-stash-free form of the Nesterov method of Ajanthan et al.,
"Nesterov Method for Asynchronous Pipeline Parallel Optimization" (ICML 2025).

Their method keeps Nesterov's look-ahead and discounts the stale gradient by ``1 - γ``:
``w_{t+1} = w_t + d_t - η (1 - γ) ∇f(w_{t-τ} + d_{t-τ})`` with ``d_t = γ (w_t - w_{t-1})``.
As ``γ → 1`` the look-ahead step ``d_t``, built from fresh history, carries the update and
follows the drift the delay causes, while each late gradient enters with a small weight. Their
code runs it as torch's NAdam with ``β1 = 0.99`` on stashed weights (PluralisResearch/AsyncPP,
``run.bash``: ``--momentum 0.99``); their variant without a weight stash gives each stage a
momentum that grows with its delay, 0.9 at the last stage to 0.99 at the first.

This correction is that schedule of momenta. Stage ``i`` with forward delay ``τ_i`` updates
with ``m_i = m + (m_max - m) τ_i / τ_max``, ``m`` the user's momentum (β1 of the Adam family,
SGD's and Muon's ``momentum``) and ``τ_max`` the longest delay of the pipeline. For the Adam
family and Muon, whose momentum is an average, that is all. For SGD, whose momentum buffer is
a sum, the stage's rate is scaled by ``(1 - m_i)/(1 - m)``, so every gradient still moves the
weights by ``η/(1 - m)`` in total and only the way it is spread over the following updates
changes; that is the paper's ``(1 - γ)`` discount. The look-ahead itself comes from the
optimiser (NAdam, ``SGD(nesterov=True)``) or from weight prediction, which runs each forward at
the weights its update will meet along the optimiser's own step. No buffer.
"""

from __future__ import annotations

import warnings
from typing import Any

from pipemare.optim.corrections.base import (
    Correction,
    StageView,
    group_momentum,
    momentum_is_average,
)

__all__ = ["DelayMomentum", "delay_momenta"]


def delay_momenta(user: float, top: float, delays: list[float]) -> list[float]:
    """Each stage's momentum: ``user`` at no delay, ``top`` at the longest delay, linear between.

    Example:
        >>> delay_momenta(0.9, 0.99, [3.0, 1.5, 0.0])
        [0.99, 0.945, 0.9]
    """
    longest = max(delays, default=0.0)
    if longest <= 0:
        return [user for _ in delays]
    return [round(user + (top - user) * d / longest, 12) for d in delays]


class DelayMomentum(Correction):
    """Raises each stage's momentum with its delay (see the module's docstring).

    Args:
        top: the momentum of the stage with the longest delay (Ajanthan et al.: 0.99).
        start: the first step it applies to (T3's warm-up steps have no delay).
        strict: refuse an optimiser without momentum; otherwise (the config's ``"auto"``) stand
            aside for it and for SGD without momentum, where the momentum would be new rather
            than raised.
    """

    name = "delay_momentum"
    derived_for = (
        "Nesterov/NAdam (Ajanthan et al.); a summed momentum (SGD) keeps each gradient's total"
        " step by a rate factor, an averaged one (Adam family, Muon) needs none; 'auto' stands"
        " aside without momentum"
    )

    def __init__(self, top: float, start: int = 0, strict: bool = True) -> None:
        if not 0.0 <= top < 1.0:
            raise ValueError(f"delay_momentum must lie in [0, 1), got {top}")
        self.top, self.start, self.strict = top, start, strict
        self.adam_family = True

    def bind(self, view: StageView) -> None:
        super().bind(view)
        groups = view.optimizer.param_groups
        self.adam_family = all(momentum_is_average(view.optimizer, g) for g in groups)
        has_momentum = all("betas" in g or "momentum" in g for g in groups)
        if not self.strict:
            self.active = self.adam_family or (has_momentum and group_momentum(groups[0]) > 0.0)
            return
        if not has_momentum:
            raise ValueError(
                f"delay_momentum needs an optimiser with momentum (SGD, Adam, AdamW, NAdam, ...),"
                f" not {type(view.optimizer).__name__}; or switch it off (delay_momentum=None)"
            )
        user = group_momentum(groups[0])
        if self.top < user:
            warnings.warn(
                f"delay_momentum={self.top} is below the optimiser's own momentum {user}: "
                "delayed stages will update with less momentum than the last one",
                stacklevel=2,
            )

    def _delays(self) -> list[float]:
        return [d.forward for d in self.view.delays]

    def momentum(self, stage: int, step: int, momentum: float) -> float:
        if not self._applies(step):
            return momentum
        raised = delay_momenta(momentum, self.top, self._delays())[stage]
        return momentum + (raised - momentum) * self.view.stage_strength(stage)

    def lr_factor(self, stage: int, step: int) -> float:
        """For summed (SGD) momentum ``(1 - m_i)/(1 - m)``, keeping each gradient's total step
        ``η/(1 - m)``; 1 for an averaged momentum (the Adam family, Muon)."""
        if self.adam_family or not self._applies(step):
            return 1.0
        user = group_momentum(self.view.optimizer.param_groups[0])
        return (1.0 - self.momentum(stage, step, user)) / (1.0 - user)

    def describe(self) -> dict[str, Any]:
        return {"active": self.active, "max": self.top}
