"""RunSummary: what a finished run writes next to its logs, for the study runner and dashboard."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from pipemare.lightning.manual import steps_per_batch

__all__ = ["RunSummary", "memory_report"]


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_report(trainer: pl.Trainer) -> dict[str, Any]:
    """Per stage, in MB: weights (and the part of them that its update steps: not the frozen
    parameters, a LoRA model's base, nor its copies of weights tied to an earlier stage's),
    optimiser state (and the part of it that is a rotated basis,
    :class:`~pipemare.optim.RotatedAdamW`'s factors), PipeDream's weight stash (peak: copies of
    the trained weights), the corrections' buffers (in all and per correction); and the peak
    number of microbatches whose activations a stage held. Every figure is read off the
    tensors the run holds, not derived from the optimiser's groups."""
    from pipemare.optim.rotated import extra_state_bytes

    pipe = getattr(trainer.strategy, "pipeline", None)
    if pipe is None:
        return {}
    mb = 1 / 2**20
    stages = []
    for stage in pipe.stages:
        params = list(stage.module.parameters())
        copies = {id(p) for p in pipe.ties.copies_on(stage.index)}  # stepped by their owner
        trained = [p for p in params if p.requires_grad and id(p) not in copies]
        state = [
            t
            for p in params
            for t in pipe.optimizer.optimizer.state.get(p, {}).values()
            if isinstance(t, torch.Tensor)
        ]
        buffers = pipe.optimizer.buffer_bytes(stage.index)
        stages.append(
            {
                "stage": stage.index,
                "weights_mb": _bytes(params) * mb,
                "trainable_mb": _bytes(trained) * mb,
                "optimizer_state_mb": _bytes(state) * mb,
                "rotated_basis_mb": extra_state_bytes(pipe.optimizer.optimizer, params) * mb,
                "stash_mb": stage.peak_stashed_bytes * mb,
                "correction_buffers_mb": sum(buffers.values()) * mb,
                "corrections_mb": {name: size * mb for name, size in buffers.items()},
                "peak_in_flight": stage.peak_in_flight,
            }
        )
    return {"stages": stages}


class RunSummary(Callback):
    """Writes ``summary.json`` into ``path`` when fitting ends (rank 0): final and best metrics,
    steps, wall time, the pipeline's delays and memory, and whether training diverged.

    The pipeline time it reports is ``step_seconds`` per optimiser step where given (replayed
    from per-action times measured once: the same in every run), else the
    ``PipelineMonitor``'s clock; the clock's reading is kept as ``measured_pipeline_time_s``.

    Args:
        path: the run's directory.
        monitor: the metric whose best value is reported, with its mode (``"max"``/``"min"``).
        step_seconds: the pipeline time of one optimiser step (None: the monitor's clock).
    """

    def __init__(
        self,
        path: str,
        monitor: str = "val_loss",
        mode: str = "min",
        step_seconds: float | None = None,
    ) -> None:
        self.path, self.monitor, self.mode = Path(path), monitor, mode
        self.step_seconds = step_seconds
        self._start = 0.0
        self._best: float | None = None
        self._history: list[tuple[int, float]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if trainer.sanity_checking or value is None:
            return
        value = float(value)
        self._history.append((trainer.global_step, value))
        better = self._best is None or (
            value > self._best if self.mode == "max" else value < self._best
        )
        if better:
            self._best = value

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        memory = memory_report(trainer)  # every rank reaches this; only rank 0 writes
        if trainer.global_rank != 0:
            return
        from pipemare.callbacks import ConvergenceMonitor, PipelineMonitor, PipelineTimeBudget

        divergence = next(
            (c.divergence for c in trainer.callbacks if isinstance(c, ConvergenceMonitor)), None
        )
        convergence = next(
            (c for c in trainer.callbacks if isinstance(c, ConvergenceMonitor)), None
        )
        pipe = getattr(trainer.strategy, "pipeline", None)
        clock = next((c for c in trainer.callbacks if isinstance(c, PipelineMonitor)), None)
        budget = next((c for c in trainer.callbacks if isinstance(c, PipelineTimeBudget)), None)
        measured = None if clock is None else clock.pipeline_time
        # seconds per global step: several optimisers under manual optimisation step each once
        step_s = None
        if self.step_seconds is not None:
            step_s = self.step_seconds / steps_per_batch(trainer)
        summary = {
            "status": "diverged" if divergence is not None else "complete",
            "divergence": None if divergence is None else divergence.message(),
            "monitor": self.monitor,
            "mode": self.mode,
            "final": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
            "best": self._best,
            "history": self._history,
            "global_step": trainer.global_step,
            "wall_time_s": time.perf_counter() - self._start,
            "pipeline_time_s": measured if step_s is None else trainer.global_step * step_s,
            "step_s": step_s,
            "measured_pipeline_time_s": measured,
            "budget_s": None if budget is None else budget.seconds,
            "steps_to_target": getattr(convergence, "steps_to_target", None),
            "time_to_target": getattr(convergence, "time_to_target", None),
            "strategy": type(trainer.strategy).__name__,
            "schedule": getattr(trainer.strategy, "schedule", None),
            "stages": pipe.num_stages if pipe is not None else None,
            "microbatches": getattr(trainer.strategy, "microbatches", None),
            "balance": list(pipe.balance) if pipe is not None else None,
            "tau_fwd": [d.forward for d in pipe.delays] if pipe is not None else None,
            "memory": memory,
        }
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "summary.json").write_text(json.dumps(summary, indent=1))
