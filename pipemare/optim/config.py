"""Typed, validated configuration of the staleness corrections (T1, T2, T3 and newer ones)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipemare.optim.corrections.momentum import RISES

__all__ = ["PipeMareConfig"]

# The fields' kinds, for the type checks (the others are numbers).
_FLAGS = ("lr_reschedule", "discrepancy_correction", "stability_guard")
_SWITCHES = ("weight_prediction", "spike_compensation")
_STEPS = ("reschedule_steps", "warmup_steps")
_OPTIONAL = ("reschedule_steps", "reschedule_epochs")


@dataclasses.dataclass
class PipeMareConfig:
    """Which staleness corrections the user asks for, and their settings; each can be switched
    on alone. What ``"auto"`` becomes for a run (its optimiser, layout and length) is decided
    in one place, :func:`pipemare.optim.settings.resolve`, which says why.

    Example:
        >>> cfg = PipeMareConfig(warmup_steps=20)
        >>> cfg.lr_reschedule, cfg.weight_prediction, cfg.delay_momentum, cfg.warmup_steps
        (True, 'auto', 'auto', 20)
        >>> PipeMareConfig.off().per_minibatch_named()
        []
    """

    lr_reschedule: bool = True
    """T1: scale each stage's learning rate by ``1/τ_i`` at first, relaxing to the user's."""

    reschedule_steps: int | None = None
    """T1's horizon K in optimiser steps after the warm-up; takes precedence when set."""

    reschedule_epochs: float | None = None
    """T1's horizon in epochs (needs the steps per epoch); used when ``reschedule_steps`` is not."""

    reschedule_fraction: float | str = "auto"
    """T1's horizon as a fraction of the run's steps after the warm-up, when neither of the
    above is set; ``"auto"``: half the run at N = 1 where every param group is of the Adam
    family (Adam, AdamW, NAdam, RotatedAdamW: measured better on the language models there),
    0.13 otherwise (AsyncPP's 12-14%; SGD, Muon, Muon + AdamW, and N > 1, where the delays
    are short and the longer horizon measured worse:
    :data:`~pipemare.optim.corrections.lr_reschedule.AUTO_FRACTIONS`). Without the run's
    length (the engine not told ``total_steps``; Lightning always tells it) the horizon is
    :data:`~pipemare.optim.corrections.lr_reschedule.FALLBACK_HORIZON` steps."""

    discrepancy_correction: bool = False
    """T2: run each backward pass with ``w - Δ δ``, an estimate of the forward-time weights."""

    discrepancy_decay: float = 0.1
    """T2's D: a stage's velocity decay is ``γ_i = D ** (1/Δ_i)``; D=0 keeps only the last step."""

    warmup_steps: int = 0
    """T3: run the first W optimiser steps with a synchronous (flushing 1F1B) pipeline."""

    weight_prediction: bool | str = "auto"
    """Run each delayed forward with ``w + s δ``, the weights its update will meet: ``True``,
    ``False`` or ``"auto"``: on unless T2 is on (they exclude each other) or the optimiser is
    SGD without momentum (where prediction narrows the stable step range: docs/schedules.md)."""

    prediction_decay: float = 0.0
    """γ of the step average the prediction extrapolates (0: the last step)."""

    prediction_scale: float = 1.0
    """Factor on the prediction's horizon ``s``."""

    spike_compensation: bool | str = "auto"
    """Apply a late gradient's missed momentum terms at once: ``True`` (SGD, Adam, AdamW; an
    error for other optimisers), ``False``, or ``"auto"``: on where the optimiser supports it."""

    delay_momentum: float | str | None = "auto"
    """Raise each stage's momentum with its delay, from the optimiser's own at the last stage to
    this value at the most delayed one (Ajanthan et al.'s Nesterov method without a weight
    stash uses 0.99; SGD's rate keeps each gradient's total step); ``"auto"``: 0.99 for the
    Adam family and SGD with momentum, off for Muon + AdamW (measured better off); None: off."""

    delay_momentum_rise: str = "depth"
    """How a stage's momentum follows its delay ``τ_i``: ``"depth"`` (Ajanthan et al.'s rise
    per update of delay at N = 1, kept at every N), ``"share"`` (the most delayed stage gets
    ``m_max`` at any N: Ajanthan et al.'s schedule), ``"window"`` or ``"stretch"``: the formulas in
    :mod:`pipemare.optim.corrections.momentum`, the measurements in docs/results.md."""

    stability_guard: bool = True
    """Halve a stage's rate and the strength of its corrections while its gradient norm runs
    away (its average over about ten updates above ``guard_threshold`` times its average over
    about a hundred); they double back 100 updates later
    (:class:`~pipemare.optim.corrections.StabilityGuard`)."""

    guard_threshold: float = 3.0
    """The guard's trigger: the gradient norm's recent average over its long-run average."""

    local_accumulation: int | str | None = "auto"
    """PACI's local gradient accumulation: each stage sums ``ceil(τ_i / c)`` minibatches'
    gradients per update, so a gradient crosses about ``c`` of its stage's updates (this value;
    None: off; ``"auto"``: ``c = 1`` for SGD without momentum, which no other correction
    serves, off otherwise). A number excludes weight prediction, spike compensation,
    delay-aware momentum and T2 (they count one update per minibatch): their ``"auto"``
    settings stand aside for it."""

    error_feedback: float | str | None = None
    """Error feedback on the delayed update (Zmushko et al., 2026): after a delayed stage's
    update ``d_t``, add ``c (d_t - d_{t-1})``; a number ``c`` for every delayed stage (the
    paper's 1, at a one-step delay), ``"delay"``: ``c = τ_i`` per stage; None: off
    (:class:`~pipemare.optim.corrections.ErrorFeedback`)."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.reschedule_steps is not None and self.reschedule_steps < 0:
            raise ValueError(f"reschedule_steps must be >= 0, got {self.reschedule_steps}")
        fraction = self.reschedule_fraction
        if fraction != "auto" and not 0.0 <= fraction <= 1.0:  # type: ignore[operator]
            raise ValueError(f"reschedule_fraction must lie in [0, 1] or be 'auto', got {fraction}")
        if self.reschedule_epochs is not None and self.reschedule_epochs < 0:
            raise ValueError(f"reschedule_epochs must be >= 0, got {self.reschedule_epochs}")
        if self.reschedule_steps is not None and self.reschedule_epochs is not None:
            raise ValueError("set T1's horizon one way: reschedule_steps or reschedule_epochs")
        if not 0.0 <= self.discrepancy_decay < 1.0:
            raise ValueError(f"discrepancy_decay must lie in [0, 1), got {self.discrepancy_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.prediction_decay < 1.0:
            raise ValueError(f"prediction_decay must lie in [0, 1), got {self.prediction_decay}")
        if self.prediction_scale < 0:
            raise ValueError(f"prediction_scale must be >= 0, got {self.prediction_scale}")
        dm = self.delay_momentum
        in_range = isinstance(dm, (int, float)) and not isinstance(dm, bool) and 0.0 <= dm < 1.0
        if dm is not None and dm != "auto" and not in_range:
            raise ValueError(f"delay_momentum must lie in [0, 1), or be 'auto' or None, got {dm!r}")
        la = self.local_accumulation
        whole = isinstance(la, int) and not isinstance(la, bool) and la >= 1
        if la is not None and la != "auto" and not whole:
            raise ValueError(
                f"local_accumulation must be a whole number >= 1, 'auto' or None, got {la!r}"
            )
        if whole:
            explicit = self.per_minibatch_named()
            if explicit:
                raise ValueError(
                    f"local_accumulation does not combine with {', '.join(explicit)}: they count "
                    "one update per minibatch; switch them off or leave them 'auto'"
                )
        ef = self.error_feedback
        number = isinstance(ef, (int, float)) and not isinstance(ef, bool)
        valid = number and math.isfinite(float(ef)) and float(ef) >= 0  # type: ignore[arg-type]
        if ef is not None and ef != "delay" and not valid:
            raise ValueError(f"error_feedback must be a number >= 0, 'delay' or None, got {ef!r}")
        if self.guard_threshold <= 1.0:
            raise ValueError(f"guard_threshold must be > 1, got {self.guard_threshold}")
        if self.weight_prediction is True and self.discrepancy_correction:
            raise ValueError(
                "weight_prediction and discrepancy_correction do not combine: with the forward "
                "run at the predicted weights, the backward's live weights already match it and "
                "T2 would move them away; switch one off (discrepancy_correction=False)"
            )

    @classmethod
    def off(cls) -> PipeMareConfig:
        """No correction: a plain asynchronous (or synchronous) pipeline."""
        return cls(
            lr_reschedule=False,
            discrepancy_correction=False,
            weight_prediction=False,
            spike_compensation=False,
            delay_momentum=None,
            warmup_steps=0,
            stability_guard=False,
            local_accumulation=None,
        )

    @classmethod
    def t1_t2(cls, **settings: Any) -> PipeMareConfig:
        """PipeMare's own pair, T1 and T2, with a horizon of 500 steps.

        ``settings`` override fields, e.g. ``PipeMareConfig.t1_t2(warmup_steps=20)`` for T1-T3.
        """
        base: dict[str, Any] = {
            "weight_prediction": False,
            "spike_compensation": False,
            "delay_momentum": None,
            "stability_guard": False,
            "local_accumulation": None,
            "discrepancy_correction": True,
            "reschedule_steps": 500,
        }
        return cls(**{**base, **settings})

    def per_minibatch_named(self) -> list[str]:
        """The corrections counting one update per minibatch that are asked for by name (local
        accumulation excludes them)."""
        asked = (
            ("weight_prediction", self.weight_prediction is True),
            ("spike_compensation", self.spike_compensation is True),
            ("delay_momentum", self.delay_momentum not in (None, "auto")),
            ("discrepancy_correction", self.discrepancy_correction),
        )
        return [name for name, on in asked if on]


def _check_types(config: PipeMareConfig) -> None:
    """Refuse a value of the wrong type (a string from YAML, a fractional step count, NaN)."""
    for name, value in dataclasses.asdict(config).items():
        if name in ("delay_momentum", "local_accumulation", "error_feedback"):
            continue  # checked with their ranges
        if name == "reschedule_fraction" and value == "auto":
            continue
        if name == "delay_momentum_rise":
            if value not in RISES:
                raise ValueError(f"{name} must be one of {RISES}, got {value!r}")
            continue
        if value is None and name in _OPTIONAL:
            continue
        if name in _FLAGS:
            ok, need = isinstance(value, bool), "True or False"
        elif name in _SWITCHES:
            ok, need = isinstance(value, bool) or value == "auto", "True, False or 'auto'"
        elif name in _STEPS:
            ok = isinstance(value, int) and not isinstance(value, bool)
            need = "a whole number of steps"
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok, need = ok and math.isfinite(value), "a finite number"
            if name == "reschedule_fraction":
                need += " in [0, 1] or 'auto'"
        if not ok:
            raise ValueError(f"{name} must be {need}, got {value!r}")
