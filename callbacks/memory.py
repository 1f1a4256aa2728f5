"""Each process's memory as training goes: a run that keeps something per step shows it here,
as a line that rises step after step, hours before it runs out of memory."""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from typing_extensions import override

from pipemare.callbacks import _common as common

__all__ = ["MemoryMonitor", "memory_now", "resident_mb"]


def resident_mb() -> float | None:
    """This process's resident memory now (not its peak), in MB; None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def _peak_resident_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes there, KB here


def memory_now() -> dict[str, float]:
    """This process's memory in MB: resident now and at its peak, and where CUDA is in use the
    memory its tensors hold on the current device, now and at the peak."""
    out = {"peak_resident_mb": _peak_resident_mb()}
    now = resident_mb()
    if now is not None:
        out["resident_mb"] = now
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
        out["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


class MemoryMonitor(Callback):
    """Logs each process's memory every ``log_every_n_steps`` training steps (default: the
    Trainer's), under any strategy: ``pipemare/memory/rank{r}/{name}`` per process and
    ``pipemare/memory/{name}``, the largest over the processes, for the names of
    :func:`memory_now`. Every process takes part (its values are gathered), and the Trainer's
    loggers write them, W&B included.

    Example:
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(callbacks=[MemoryMonitor(log_every_n_steps=100)])  # doctest: +SKIP
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        self.log_every_n_steps = log_every_n_steps

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step % common.interval(trainer, self.log_every_n_steps) != 0:
            return
        parts = common.gather(trainer, memory_now())
        metrics = {
            f"{common.PREFIX}/memory/rank{r}/{name}": value
            for r, part in enumerate(parts)
            for name, value in part.items()
        }
        for name in parts[0]:
            metrics[f"{common.PREFIX}/memory/{name}"] = max(part[name] for part in parts)
        common.log(trainer, metrics)
