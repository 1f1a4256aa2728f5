"""Typed, validated configuration of PipeMare's techniques (T1, T2, T3)."""

from __future__ import annotations

import dataclasses

__all__ = ["PipeMareConfig"]


@dataclasses.dataclass
class PipeMareConfig:
    """Which PipeMare techniques run, and their settings. Each can be switched on alone.

    Example:
        >>> cfg = PipeMareConfig(discrepancy_correction=False, warmup_steps=20)
        >>> cfg.lr_reschedule, cfg.discrepancy_correction, cfg.warmup_steps
        (True, False, 20)
    """

    lr_reschedule: bool = True
    """T1: scale each stage's learning rate by ``1/τ_i`` at first, relaxing to the user's."""

    reschedule_steps: int = 500
    """T1's horizon K: optimiser steps (after the warm-up) until every stage uses the user's LR."""

    discrepancy_correction: bool = True
    """T2: run each backward pass with ``w - Δ δ``, an estimate of the forward-time weights."""

    discrepancy_decay: float = 0.1
    """T2's D: a stage's velocity decay is ``γ_i = D ** (1/Δ_i)``; D=0 keeps only the last step."""

    warmup_steps: int = 0
    """T3: run the first W optimiser steps with a synchronous (flushing 1F1B) pipeline."""

    def __post_init__(self) -> None:
        if self.reschedule_steps < 0:
            raise ValueError(f"reschedule_steps must be >= 0, got {self.reschedule_steps}")
        if not 0.0 <= self.discrepancy_decay < 1.0:
            raise ValueError(f"discrepancy_decay must lie in [0, 1), got {self.discrepancy_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")

    @classmethod
    def off(cls) -> PipeMareConfig:
        """No technique: a plain asynchronous (or synchronous) pipeline."""
        return cls(lr_reschedule=False, discrepancy_correction=False, warmup_steps=0)

    @classmethod
    def for_schedule(cls, corrected: bool) -> PipeMareConfig:
        """The default for a schedule: T1 and T2 for ``pipemare``, nothing for the others."""
        return cls() if corrected else cls.off()
