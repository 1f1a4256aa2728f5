"""A Lightning script whose every step says which minibatch it ran, for the lagged-report tests.

Each sample carries its index; the module logs the smallest index of the minibatch, a copy of
its loss, and epoch sums of the indices, and a callback records, per step and on every rank,
what Lightning saw. Launched by tests/test_lagged.py in a subprocess (Lightning's launcher
re-runs it per rank), or, every stage simulated, run in the test's own process (``main(argv)``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pipemare

BATCH, TRAIN, VAL = 8, 40, 24  # 5 training and 3 validation batches per epoch


def indexed(n: int, offset: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(offset)
    x = torch.randn(n, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(offset, offset + n))


class Indexed(pl.LightningModule):
    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        self.nan_at = nan_at  # a sample index whose minibatch gets NaN inputs
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        if self.nan_at is not None and bool((idx == self.nan_at).any()):
            x = x * float("nan")
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("first_index", idx.min().float(), reduce_fx="min")
        self.log("loss_copy", loss)
        self.log("index_sum", idx.sum().float(), reduce_fx="sum", on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, _, idx = batch
        self.net(x)
        self.log("val_index_sum", idx.sum().float(), reduce_fx="sum", on_epoch=True)
        return idx.float().mean()

    def predict_step(self, batch, batch_idx):
        x, _, idx = batch
        return self.net(x)[:, 0] * 0 + idx.float()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Record(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.epochs: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.steps.append(
            {
                "batch_idx": batch_idx,
                "own_first_index": int(batch[2].min()),
                "loss": float(outputs["loss"]),
                "first_index": float(m["first_index"]) if "first_index" in m else None,
                "loss_copy": float(m["loss_copy"]) if "loss_copy" in m else None,
                "lag": float(trainer.progress_bar_metrics.get("lag", 0.0)),
            }
        )

    def on_train_epoch_end(self, trainer, pl_module):
        m = trainer.callback_metrics
        self.epochs.append(
            {"index_sum": float(m["index_sum"]), "val_index_sum": float(m["val_index_sum"])}
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--schedule", default="pipemare")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--nan-at", type=int, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pl.seed_everything(0)
    record = Record()
    strategy = pipemare.PipeMareStrategy(
        stages=args.stages, microbatches=args.microbatches, schedule=args.schedule, balance="even"
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the same order in processes and in the simulator
        callbacks=[record],
    )
    model = Indexed(args.nan_at)
    train = DataLoader(indexed(TRAIN, 0), batch_size=BATCH)
    val = DataLoader(indexed(VAL, 1000), batch_size=BATCH)
    trainer.fit(model, train, val)
    predictions = trainer.predict(model, DataLoader(indexed(VAL, 1000), batch_size=BATCH))
    rank = int(os.environ.get("RANK", trainer.global_rank))
    report = {
        "lag": strategy.lag,
        "steps": record.steps,
        "epochs": record.epochs,
        "predictions": [p.tolist() for p in predictions],
    }
    (args.out / f"report-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
