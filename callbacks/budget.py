"""PipelineTimeBudget: stop training once the pipeline has had a given time on P devices."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_info
from typing_extensions import override

from pipemare.callbacks import _common as common
from pipemare.callbacks.pipeline import PipelineMonitor
from pipemare.lightning.manual import steps_per_batch
from pipemare.lines import text

__all__ = ["PipelineTimeBudget"]


class PipelineTimeBudget(Callback):
    """Stops the fit when the run's pipeline time (what P devices would take) reaches
    ``seconds``, so that schedules are compared at equal time on the same devices rather than
    at equal steps.

    With ``step_seconds`` (seconds per optimiser step from per-action times measured once and
    replayed through the schedule, :func:`pipemare.planner.replayed_step_time`) the budget is a
    number of steps, ``floor(seconds / step_seconds)``, fixed before the first batch: the run's
    ``max_steps`` is lowered to it, T1's horizon is derived from it when the pipeline is built,
    and the run stops exactly there. Nothing reads a
    clock, so two runs stop at the same step. This is what ``pipemare study`` uses.

    Without it, the budget follows :class:`PipelineMonitor`'s clock, checked every
    ``check_every_n_steps`` steps on every rank, which stop together (the decision is reduced
    over processes). At its first check with a measured pipeline time the callback estimates
    the steps the budget allows (from the time per step so far) and derives T1's horizon again
    from them, once, and says so. The estimate is a measurement, so where the run stops and
    the horizon move with the machine's speed; ``PipeMareConfig(reschedule_steps=...)`` fixes
    the horizon. A resumed run keeps its checkpoint's horizon either way.

    Args:
        seconds: the budget.
        step_seconds: the pipeline time of one optimiser step; None: read the monitor's clock.
        check_every_n_steps: how often to check the clock (default: the monitor's logging
            interval, when its clock advances).
    """

    def __init__(
        self,
        seconds: float,
        step_seconds: float | None = None,
        check_every_n_steps: int | None = None,
    ) -> None:
        if not seconds > 0:
            raise ValueError(f"the pipeline-time budget must be > 0 seconds, got {seconds}")
        if step_seconds is not None and not step_seconds > 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
        self.seconds, self.step_seconds = seconds, step_seconds
        self.check_every_n_steps = check_every_n_steps
        self.stopped_at: int | None = None
        """The global step the budget stopped the run at (None: it did not)."""
        self.estimated_steps: int | None = None
        """The optimiser steps the budget was estimated to allow (None: not estimated)."""
        self._sized = False

    @property
    def allowed_steps(self) -> int | None:
        """The optimiser steps the budget allows at ``step_seconds`` (None: clock-driven)."""
        if self.step_seconds is None:
            return None
        # the tolerance keeps a budget of exactly k steps at k despite rounding in the division
        return math.floor(self.seconds / self.step_seconds * (1 + 1e-9))

    def _monitor(self, trainer: pl.Trainer) -> PipelineMonitor:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, PipelineMonitor):
                return callback
        raise ValueError(
            "PipelineTimeBudget reads the pipeline time from a PipelineMonitor: add "
            "pipemare.callbacks.PipelineMonitor() to the Trainer's callbacks"
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.step_seconds is None:
            self._monitor(trainer)  # refuse a Trainer without the clock before training starts

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        allowed = self.allowed_steps
        if allowed is not None:
            self._cap_steps(trainer, allowed)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sized = trainer.global_step > 0  # resumed: the checkpoint's horizon stands

    def _cap_steps(self, trainer: pl.Trainer, allowed: int) -> None:
        """End the run after ``allowed`` optimiser steps: Lightning's ``max_steps`` lowered
        before the first batch (of validation's sanity check, too) builds the pipeline, which
        derives T1's horizon from it."""
        if allowed >= trainer.estimated_stepping_batches:
            return  # the budget does not end the run before its own length does
        self.estimated_steps = allowed
        trainer.fit_loop.epoch_loop.max_steps = allowed * steps_per_batch(trainer)
        rank_zero_info(
            text(
                "budget.steps", seconds=self.seconds, steps=allowed, step_seconds=self.step_seconds
            )
        )

    def _size_run(self, trainer: pl.Trainer, spent: float) -> None:
        """T1's horizon from the steps the budget allows at the time per step so far."""
        steps = trainer.global_step / steps_per_batch(trainer)  # optimiser steps per batch
        estimate = math.floor(self.seconds * steps / spent)
        estimate = trainer.strategy.broadcast(estimate, src=0)  # each rank has its own clock
        self._set_run_length(
            trainer, estimate, f"{spent / steps * 1e3:.1f} ms per step over the first {steps:g}"
        )

    def _set_run_length(self, trainer: pl.Trainer, estimate: int, why: str) -> None:
        self._sized = True
        pipe = common.pipeline(trainer)
        settings = None if pipe is None else pipe.settings
        known = None if settings is None else settings.total_steps
        if settings is None or known is None or estimate >= known:
            return  # the budget does not end the run before max_steps does
        was = settings.horizon
        self.estimated_steps = estimate
        strategy = common.strategy_of(trainer)
        assert strategy is not None  # there is a pipeline
        horizon = strategy.set_run_length(estimate)
        if horizon is not None and horizon != was:
            rank_zero_info(
                text(
                    "budget.horizon",
                    was=was,
                    horizon=horizon,
                    seconds=self.seconds,
                    estimate=estimate,
                    why=why,
                    known=known,
                )
            )

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        allowed = self.allowed_steps
        if allowed is not None:  # Lightning stops at the lowered max_steps
            if trainer.global_step >= allowed * steps_per_batch(trainer) > 0:
                self.stopped_at = trainer.global_step
            return
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
