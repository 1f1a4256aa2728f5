"""Data x pipeline parallelism, launched by tests/test_replicas.py in a subprocess.

``--devices 4 --stages 2`` runs two copies of a 2-stage pipeline (Lightning's launcher
re-runs this script per rank); ``--strategy single`` trains the same model on one device
with the copies' combined batch, the reference (run in the test's process: ``main(argv)``).
Each rank writes what it saw to --out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import pipemare
from support.data import DigitsDataModule
from support.models import DigitsCNN, quiet_trainer


class DigitsMLP(pl.LightningModule):
    """No BatchNorm or dropout: one device and the copies compute the same function."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, 48),
            nn.Tanh(),
            nn.Linear(48, 32),
            nn.Tanh(),
            nn.Linear(32, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        self.log("train_max", loss, reduce_fx="max", on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class SameOrder(DigitsDataModule):
    """For the one-device reference: the order Lightning gives a training loader under a
    distributed strategy (a shuffling DistributedSampler, seed 0, reseeded every epoch), here
    with one replica; D copies of the pipeline split each of its batches between them."""

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, shuffle=True)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True
        )


class Record(pl.Callback):
    """Every step's reported loss, and the batches this rank was given."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_labels: list[list[int]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        if trainer.current_epoch == 0 and batch_idx < 3:
            self.first_labels.append(batch[1].tolist())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="per copy of the pipeline")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--balance", default="time", help='"time" or layer counts, e.g. 5,4')
    parser.add_argument("--strategy", default="pipemare", help="'single': one plain device")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pl.seed_everything(args.seed)
    if args.model == "mlp":
        model: pl.LightningModule = DigitsMLP()
    else:
        model = DigitsCNN(lr=2e-3)
    single = args.strategy == "single"
    data = (SameOrder if single else DigitsDataModule)(batch_size=args.batch)
    strategy = (
        "auto"
        if single
        else pipemare.PipeMareStrategy(
            stages=args.stages,
            microbatches=args.microbatches,
            schedule=args.schedule,
            balance=args.balance
            if args.balance == "time"
            else [int(n) for n in args.balance.split(",")],
        )
    )
    record = Record()
    checkpoint = ModelCheckpoint(dirpath=args.out / "ckpt", save_last=True, monitor="val_loss")
    trainer = quiet_trainer(
        strategy,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.epochs,
        callbacks=[record, checkpoint],
        enable_checkpointing=True,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, data)
    rank = trainer.global_rank
    torch.save(
        {k: v.cpu() for k, v in model.state_dict().items()}, args.out / f"weights-rank{rank}.pt"
    )
    s = trainer.strategy
    report = {
        "rank": rank,
        "world_size": trainer.world_size,
        "losses": record.losses,
        "first_labels": record.first_labels,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "train_batches": trainer.num_training_batches,
        "best_model_score": float(checkpoint.best_model_score),
        "replicas": getattr(s, "replicas", 1),
        "pipelines": [list(g) for g in s.rank_layout.pipelines]
        if hasattr(s, "rank_layout")
        else None,
        "pipelines_cross_nodes": getattr(
            getattr(s, "rank_layout", None), "pipelines_cross_nodes", None
        ),
        "stage_groups": [list(g) for g in s.rank_layout.stage_groups]
        if hasattr(s, "rank_layout")
        else None,
    }
    (args.out / f"report-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main()
