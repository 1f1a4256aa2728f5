"""A step's wall time on two gloo processes, for the measurement scripts under
``experiments/results`` (``baseline_n/measure.py``, ``advice/measure.py``).

The experiments' GPT over the char corpus, batch 16, one thread per process, Lightning's
launcher; the step is the wall clock between training steps 10 and 30 on rank 0. Run alone on
the machine.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import pytorch_lightning as pl
import torch

__all__ = ["gpt_and_schedule_arguments", "timed_fit"]


def gpt_and_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every script timing :func:`timed_fit`'s GPT takes: its width, blocks and
    context, then the schedule (the default ``pipemare`` or ``1f1b``) and 1F1B's N."""
    parser.add_argument("width", type=int)
    parser.add_argument("layers", type=int)
    parser.add_argument("context", type=int)
    parser.add_argument("schedule", choices=["pipemare", "1f1b"])
    parser.add_argument("n", type=int, nargs="?", help="1F1B's N")


class _Clock(pl.Callback):
    def __init__(self) -> None:
        self.t: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.t.append(time.perf_counter())


def timed_fit(
    strategy: Any, width: int, layers: int, context: int, devices: int = 2
) -> tuple[pl.Trainer, float]:
    """Fit the GPT of ``width``, ``layers`` blocks and ``context`` tokens for 30 steps under
    ``strategy`` on ``devices`` processes; the trainer and, on rank 0, milliseconds per step
    over steps 10-30 (NaN on other ranks)."""
    from pipemare.experiments.tasks.datamodules import CharCorpusDataModule
    from pipemare.experiments.tasks.gpt import CharGPT

    torch.set_num_threads(1)
    pl.seed_everything(0)
    clock = _Clock()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[clock],
    )
    model = CharGPT(d_model=width, heads=4, layers=layers, context=context)
    trainer.fit(model, CharCorpusDataModule(context=context, batch_size=16))
    if trainer.global_rank != 0:
        return trainer, float("nan")
    steps = clock.t[10:]
    return trainer, (steps[-1] - steps[0]) / (len(steps) - 1) * 1e3
