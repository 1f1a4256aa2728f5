"""T1, learning-rate rescheduling (Yang et al., "PipeMare", MLSys 2021).

``α_{k,i} = α_k · max(τ_i, 1) ** -(1 - min(k / K, 1))``: stage ``i`` starts at ``α/τ_i`` and
reaches the user's rate after ``K`` steps, following the ``1/τ`` shape of the stability bound
of delayed gradient descent (:func:`pipemare.optim.stability.delayed_gd_bound`). The
public re-implementation of Ajanthan et al. (ICML 2025, PluralisResearch/AsyncPP) applies the
same factor with ``τ_i = P - 1 - i`` and K about 12-14% of the run.
"""

from __future__ import annotations

from pipemare.optim.corrections.base import Correction

__all__ = ["LRReschedule", "lr_factor"]


def lr_factor(delay: float, step: int, horizon: int) -> float:
    """T1's factor on the user's learning rate at a stage with forward delay ``delay``.

    Example:
        >>> lr_factor(4.0, 0, 100), lr_factor(4.0, 50, 100), lr_factor(4.0, 100, 100)
        (0.25, 0.5, 1.0)
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    progress = 1.0 if horizon <= 0 else min(step / horizon, 1.0)
    return max(delay, 1.0) ** -(1.0 - progress)


class LRReschedule(Correction):
    """T1: each stage's rate divided by its forward delay at first, relaxed over ``horizon`` steps.

    Args:
        horizon: K, in optimiser steps counted from ``start`` (the end of T3's warm-up).
        start: the first step the rescheduling applies to (earlier steps use the user's rate).
    """

    name = "lr_reschedule"
    derived_for = "any optimiser: a factor on the rate, never above 1"

    def __init__(self, horizon: int, start: int = 0) -> None:
        if horizon < 0:
            raise ValueError(f"T1's horizon must be >= 0 steps, got {horizon}")
        self.horizon, self.start = horizon, start

    def lr_factor(self, stage: int, step: int) -> float:
        """T1's factor (:func:`lr_factor`) for the stage's forward delay."""
        if not self._applies(step):
            return 1.0
        return lr_factor(self.view.delays[stage].forward, step - self.start, self.horizon)
