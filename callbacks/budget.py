"""PipelineTimeBudget: stop training once the pipeline has had a given time on P devices."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_info

from pipemare.callbacks import _common as common
from pipemare.callbacks.pipeline import PipelineMonitor
from pipemare.lightning.manual import steps_per_batch

__all__ = ["PipelineTimeBudget"]


class PipelineTimeBudget(Callback):
    """Stops the fit when the run's pipeline time (:class:`PipelineMonitor`'s clock: what P
    devices would take) reaches ``seconds``, so that schedules are compared at equal time on
    the same devices rather than at equal steps. Checked every ``check_every_n_steps`` steps on
    every rank, which stop together (the decision is reduced over processes).

    A run stopped by the budget is shorter than ``max_steps`` says, and T1's horizon, by
    default a fraction of the run, was derived from ``max_steps``. At its first check with a
    measured pipeline time the callback therefore estimates the steps the budget allows (from
    the time per step so far) and derives the horizon again from them, once, and says so. A
    resumed run keeps its checkpoint's horizon. The estimate is a measurement, so the horizon
    moves with the machine's speed; ``PipeMareConfig(reschedule_steps=...)`` fixes it.

    Args:
        seconds: the budget.
        check_every_n_steps: how often to check (default: the monitor's logging interval, when
            its clock advances).
    """

    def __init__(self, seconds: float, check_every_n_steps: int | None = None) -> None:
        if not seconds > 0:
            raise ValueError(f"the pipeline-time budget must be > 0 seconds, got {seconds}")
        self.seconds, self.check_every_n_steps = seconds, check_every_n_steps
        self.stopped_at: int | None = None
        """The global step the budget stopped the run at (None: it did not)."""
        self.estimated_steps: int | None = None
        """The optimiser steps the budget was estimated to allow (None: not estimated)."""
        self._sized = False

    def _monitor(self, trainer: pl.Trainer) -> PipelineMonitor:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, PipelineMonitor):
                return callback
        raise ValueError(
            "PipelineTimeBudget reads the pipeline time from a PipelineMonitor: add "
            "pipemare.callbacks.PipelineMonitor() to the Trainer's callbacks"
        )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._monitor(trainer)  # refuse a Trainer without the clock before training starts

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sized = trainer.global_step > 0  # resumed: the checkpoint's horizon stands

    def _size_run(self, trainer: pl.Trainer, spent: float) -> None:
        """T1's horizon from the steps the budget allows at the time per step so far."""
        self._sized = True
        pipe = common.pipeline(trainer)
        steps = trainer.global_step / steps_per_batch(trainer)  # optimiser steps per batch
        estimate = math.floor(self.seconds * steps / spent)
        estimate = trainer.strategy.broadcast(estimate, src=0)  # each rank has its own clock
        settings = None if pipe is None else pipe.settings
        known = None if settings is None else settings.total_steps
        if settings is None or known is None or estimate >= known:
            return  # the budget does not end the run before max_steps does
        was = settings.horizon
        self.estimated_steps = estimate
        horizon = trainer.strategy.set_run_length(estimate)  # type: ignore[attr-defined]
        if horizon is not None and horizon != was:
            rank_zero_info(
                f"pipemare: T1's horizon {was} -> {horizon} steps: the pipeline-time budget of "
                f"{self.seconds:g} s allows about {estimate} steps ({spent / steps * 1e3:.1f} ms "
                f"per step over the first {steps:g}), not the {known} of max_steps"
            )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        monitor = self._monitor(trainer)
        every = self.check_every_n_steps or common.interval(trainer, monitor.log_every_n_steps)
        if trainer.global_step % max(every, 1):
            return
        if not self._sized and monitor.pipeline_time > 0:
            self._size_run(trainer, monitor.pipeline_time)
        spent = monitor.pipeline_time >= self.seconds
        if trainer.strategy.reduce_boolean_decision(spent, all=False):
            trainer.should_stop = True
            if self.stopped_at is None:
                self.stopped_at = trainer.global_step
