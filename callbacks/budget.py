"""PipelineTimeBudget: stop training once the pipeline has had a given time on P devices."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from pipemare.callbacks import _common as common
from pipemare.callbacks.pipeline import PipelineMonitor

__all__ = ["PipelineTimeBudget"]


class PipelineTimeBudget(Callback):
    """Stops the fit when the run's pipeline time (:class:`PipelineMonitor`'s clock: what P
    devices would take) reaches ``seconds``, so that schedules are compared at equal time on
    the same devices rather than at equal steps. Checked every ``check_every_n_steps`` steps on
    every rank, which stop together (the decision is reduced over processes).

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
        spent = monitor.pipeline_time >= self.seconds
        if trainer.strategy.reduce_boolean_decision(spent, all=False):
            trainer.should_stop = True
            if self.stopped_at is None:
                self.stopped_at = trainer.global_step
