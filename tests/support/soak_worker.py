"""A long run that watches its own memory: a byte-level GPT with its head tied to its token
embedding and a torchmetrics perplexity updated and logged in ``training_step``, trained
through ``strategy="pipemare"`` under each schedule in turn, on one process (the stages
simulated) or one process per stage (torchrun). Every ``--every`` steps each process counts
its live tensors and reads its resident memory; each rank writes the samples to --out.

The tests run it short; ``--steps 1536 --every 128`` is the 12 epochs of 128 steps of the
issue that found the leaks (see docs/benchmarks.md, "Memory over a long run"); ``--compile``
compiles each stage.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger

import pipemare
from pipemare.callbacks import ConvergenceMonitor, PipelineMonitor, StalenessMonitor
from pipemare.callbacks.memory import resident_mb
from support.data import CharCorpusDataModule
from support.gpt import CharGPT
from support.memory import live_tensors, settle_imports
from support.models import quiet_trainer


class MemorySamples(pl.Callback):
    """Every ``every`` steps: (step, resident MB, live tensors)."""

    def __init__(self, every: int) -> None:
        self.every, self.samples = every, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0:
            self.samples.append((trainer.global_step, resident_mb(), live_tensors()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schedules", nargs="+", default=list(pipemare.SCHEDULES))
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--devices", type=int, default=1, help="processes (torchrun) or 1")
    parser.add_argument("--monitors", action="store_true", help="attach pipemare's three")
    parser.add_argument("--compile", action="store_true", help="compile each stage (inductor)")
    args = parser.parse_args()
    settle_imports()  # before the first run: every tensor of the runs is counted
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, list] = {}
    for schedule in args.schedules:
        pl.seed_everything(0)
        model = CharGPT(d_model=32, heads=2, layers=2, context=32)
        samples = MemorySamples(args.every)
        callbacks: list[pl.Callback] = [samples]
        logger: Any = False
        if args.monitors:  # they log through the trainer's logger, here every 10 steps
            callbacks += [StalenessMonitor(), PipelineMonitor(), ConvergenceMonitor()]
            logger = CSVLogger(args.out, name=schedule)
        trainer = quiet_trainer(
            pipemare.PipeMareStrategy(
                stages=args.stages,
                microbatches=args.microbatches,
                schedule=schedule,
                compile=args.compile,
            ),
            devices=args.devices,
            max_steps=args.steps,
            limit_val_batches=0,
            callbacks=callbacks,
            logger=logger,
            log_every_n_steps=10,
        )
        trainer.fit(model, CharCorpusDataModule(context=32, batch_size=16))
        report[schedule] = samples.samples
    rank = int(os.environ.get("RANK", 0))
    (args.out / f"soak-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main()
