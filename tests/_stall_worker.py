"""A long 3-process Lightning run for the failure tests: every rank writes its PID at the start,
rank 1 writes "ready" after a few steps, and the test then kills or stops rank 1 by PID."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytorch_lightning as pl
import torch
from _models import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pipemare


class Small(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Pids(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        (self.out / f"pid-rank{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 5:
            (self.out / "ready").write_text(str(os.getpid()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stall-timeout", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    x = torch.randn(4096, 8)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    trainer = quiet_trainer(
        pipemare.PipeMareStrategy(stall_timeout=args.stall_timeout, balance="even"),
        devices=3,
        max_epochs=1000,
        callbacks=[Pids(args.out)],
    )
    trainer.fit(Small(), data)


if __name__ == "__main__":
    main()
