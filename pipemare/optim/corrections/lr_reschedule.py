"""T1, learning-rate rescheduling (Yang et al., "PipeMare", MLSys 2021).

``α_{k,i} = α_k · max(τ_i, 1) ** -(1 - min(k / K, 1))``: stage ``i`` starts at ``α/τ_i`` and
reaches the user's rate after ``K`` steps, following the ``1/τ`` shape of the stability bound
of delayed gradient descent (:func:`pipemare.optim.stability.delayed_gd_bound`). The
public re-implementation of Ajanthan et al. (ICML 2025, PluralisResearch/AsyncPP) applies the
same factor with ``τ_i = P - 1 - i`` and K about 12-14% of the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from pipemare.optim.corrections.base import Correction, is_adam_family

if TYPE_CHECKING:  # the config names these functions' defaults: imported there at run time
    from pipemare.optim.config import PipeMareConfig

__all__ = [
    "AUTO_FRACTIONS",
    "FALLBACK_HORIZON",
    "LRReschedule",
    "fraction_horizon",
    "horizon",
    "horizon_basis",
    "horizon_fraction",
    "lr_factor",
]

#: T1's horizon in steps when neither it nor the run's length is known.
FALLBACK_HORIZON = 500

#: ``reschedule_fraction="auto"``'s horizon, as a fraction of the run: at N = 1 for an
#: optimiser whose every group is of the Adam family, and otherwise (SGD, Muon, Muon + AdamW,
#: no optimiser to read, or N > 1). docs/results.md has the measurements behind both.
AUTO_FRACTIONS = {"adam": 0.5, "other": 0.13}


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


# -- the horizon K: from the config, the optimiser, N and the run's length ----------------------


def horizon_fraction(
    config: PipeMareConfig, optimizer: torch.optim.Optimizer, microbatches: int
) -> tuple[float, str]:
    """T1's horizon as a fraction of the run, ``"auto"`` resolved for the optimiser and N,
    and why.

    Example:
        >>> from pipemare.optim.config import PipeMareConfig
        >>> adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        >>> config = PipeMareConfig()
        >>> horizon_fraction(config, adam, 1)[0], horizon_fraction(config, adam, 4)[0]
        (0.5, 0.13)
    """
    if config.reschedule_fraction != "auto":
        return float(config.reschedule_fraction), "reschedule_fraction"
    groups = optimizer.param_groups
    adam = bool(groups) and all(is_adam_family(optimizer, g) for g in groups)
    if adam and microbatches == 1:
        return AUTO_FRACTIONS[
            "adam"
        ], "the Adam family at N = 1, measured better on language models"
    what = "N > 1 keeps the delays short" if adam else "the optimiser is not of the Adam family"
    return AUTO_FRACTIONS["other"], f"AsyncPP's 12-14% of the run, as {what}"


def fraction_horizon(fraction: float, total_steps: int, warmup: int) -> int:
    """T1's horizon as ``fraction`` of the run's steps after the warm-up.

    Example:
        >>> fraction_horizon(0.13, 1000, 0), fraction_horizon(0.5, 1000, 200)
        (130, 400)
    """
    return round(fraction * max(total_steps - warmup, 0))


def horizon(
    config: PipeMareConfig,
    fraction: tuple[float, str],
    total_steps: int | None,
    steps_per_epoch: int | None,
) -> tuple[int, str | None]:
    """K in steps, and why where it was derived on the user's behalf (None where the config
    gives it in steps or epochs).

    Raises:
        ValueError: ``reschedule_epochs`` without the steps per epoch.
    """
    if config.reschedule_steps is not None:
        return config.reschedule_steps, None
    if config.reschedule_epochs is not None:
        if steps_per_epoch is None:
            raise ValueError(
                "reschedule_epochs needs the steps per epoch: pass steps_per_epoch to the "
                "Pipeline (the Lightning strategy does), or set reschedule_steps"
            )
        return round(config.reschedule_epochs * steps_per_epoch), None
    if total_steps is None:
        return FALLBACK_HORIZON, "the run's length is not known"
    k = fraction_horizon(fraction[0], total_steps, config.warmup_steps)
    why = f"{fraction[0]:g} of the run's {total_steps} steps"
    if config.warmup_steps:
        why += f" after {config.warmup_steps} warm-up steps"
    if config.reschedule_fraction == "auto":
        why += f": {fraction[1]}"
    return k, why


def horizon_basis(state: Mapping[str, Any]) -> str:
    """In words, what the horizon of a run's stored state (``RunSettings.run_state``) was
    derived from."""
    settings = state["settings"]
    if settings["reschedule_steps"] is not None:
        return f"reschedule_steps={settings['reschedule_steps']}"
    if settings["reschedule_epochs"] is not None:
        return f"{settings['reschedule_epochs']:g} epochs of {state['steps_per_epoch']} steps"
    if state["total_steps"] is None:
        return "no known run length"
    warmup = settings["warmup_steps"]
    after = f" after {warmup} warm-up steps" if warmup else ""
    return f"{settings['reschedule_fraction']:g} of the run's {state['total_steps']} steps{after}"
