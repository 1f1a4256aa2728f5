"""A 2-process Lightning run with pipemare's monitors, where stage 1 blows up at a known step."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytorch_lightning as pl
import torch

from pipemare import PipeMareStrategy
from pipemare.callbacks import (
    ConvergenceMonitor,
    MemoryMonitor,
    PipelineMonitor,
    StalenessMonitor,
)
from support.data import DigitsDataModule
from support.faults import Exploding


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--explode-after", type=int, default=2 * 25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    convergence = ConvergenceMonitor(log_every_n_steps=5, on_divergence="stop")
    trainer = pl.Trainer(
        strategy=PipeMareStrategy(microbatches=2, balance=[5, 5]),
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=pl.loggers.CSVLogger(args.out, name="csv"),
        log_every_n_steps=5,
        callbacks=[
            convergence,
            StalenessMonitor(log_every_n_steps=5, discrepancy_every_n_steps=5),
            PipelineMonitor(
                log_every_n_steps=5, trace_path=args.out / "trace.json", trace_steps=(4, 8)
            ),
            MemoryMonitor(log_every_n_steps=5),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Exploding(after=args.explode_after), DigitsDataModule())
    d = convergence.divergence
    report = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "divergence": None
        if d is None
        else {"step": d.step, "stage": d.stage, "message": d.message()},
    }
    (args.out / f"report-rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main()
