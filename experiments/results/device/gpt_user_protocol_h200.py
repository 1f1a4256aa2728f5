"""Run on the lent GPU (2026-11-27, H200): a larger byte-level GPT under the user's protocol at
equal steps. The one-device rate (AdamW sweep), then pipemare's default and uncorrected async at
P = 2, 4, 8 (stages simulated on the one GPU, N chosen by the strategy) at that rate; one JSON
line per run in OUT/gpt_gpu.jsonl. ``python gpt_user_protocol_h200.py --out OUT``."""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

from pipemare import PipeMareStrategy
from pipemare.experiments.tasks.datamodules import CharCorpusDataModule
from pipemare.experiments.tasks.gpt import CharGPT


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.values: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.values.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))


def train_once(
    log: Path, steps: int, lr: float, schedule: str | None = None, stages: int = 1
) -> float:
    pl.seed_everything(0, verbose=False)
    adamw = functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.01)
    model = CharGPT(d_model=512, heads=8, layers=8, context=64, optimizer=adamw)
    data = CharCorpusDataModule(context=64, batch_size=32)
    strategy = "auto" if schedule is None else PipeMareStrategy(stages=stages, schedule=schedule)
    record = _Record()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        val_check_interval=steps // 5,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, data)
    result = {
        "schedule": schedule or "one device",
        "P": stages,
        "N": getattr(trainer.strategy, "microbatches", 1),
        "lr": lr,
        "val": record.values,
        "final": record.values[-1][1],
        "wall_s": round(time.perf_counter() - start, 1),
    }
    with log.open("a") as f:
        f.write(json.dumps(result) + "\n")
    return float(result["final"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    log = args.out / "gpt_gpu.jsonl"
    finals = {lr: train_once(log, args.steps, lr) for lr in (3e-4, 1e-3, 3e-3)}
    best = min(finals, key=lambda lr: (finals[lr], lr))
    for stages in (2, 4, 8):
        for schedule in ("pipemare", "async"):
            train_once(log, args.steps, best, schedule, stages)


if __name__ == "__main__":
    main()
