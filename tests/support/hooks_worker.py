"""A Lightning script whose gradient hooks record what each update applies, for the hook tests.

The module logs each parameter's gradient norm from ``on_before_optimizer_step`` and counts
``on_after_backward``; a callback records, per step, what Lightning logged, and the norms each
update applied. Launched by tests/lightning/test_gradient_hooks_distributed.py in a subprocess
(Lightning's launcher re-runs it per rank), or, both stages simulated, in the test's process.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import pipemare
from pipemare.engine.lagged import snapshot_lag

STEPS, BATCH = 8, 12


class LogsNorms(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        )
        #: per update applied here: (stage, minibatch, {parameter: gradient norm})
        self.applied: list[tuple[int, int, dict[str, float]]] = []
        self.after_backward = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_after_backward(self):
        self.after_backward += 1

    def on_before_optimizer_step(self, optimizer):
        stage, k = self.trainer.strategy.update
        norms = {n: float(p.grad.norm()) for n, p in self.named_parameters() if p.grad is not None}
        self.applied.append((stage, k, norms))
        for name, norm in norms.items():
            self.log(f"grad/{name}", norm)
        self.log("updated", float(k), reduce_fx="max")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Logged(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.logged_metrics.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stages", type=int, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pl.seed_everything(0)
    logged = Logged()
    strategy = pipemare.PipeMareStrategy(stages=args.stages, microbatches=2, balance=[3, 2])
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the same order in processes and in the simulator
        callbacks=[logged],
    )
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(STEPS * BATCH, 5, generator=gen), torch.randint(0, 3, (STEPS * BATCH,))
    model = LogsNorms()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    rank = int(os.environ.get("RANK", trainer.global_rank))
    report = {
        "lag": snapshot_lag("pipemare", 2, 2) + 1,  # the hooks' logs: see pipemare.lightning.hooks
        "applied": model.applied,
        "after_backward": model.after_backward,
        "steps": logged.steps,
    }
    (args.out / f"report-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
