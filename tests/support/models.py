"""Small pipelines, data and trainers that many tests (and the worker scripts) build alike."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pipemare import Pipeline
from pipemare.optim import MuonAdamW

# What `quiet_trainer` passes to Lightning, for tests that build another Trainer class.
QUIET_CPU_TRAINER: dict[str, Any] = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def quiet_trainer(strategy, **options) -> pl.Trainer:
    """A Trainer on one CPU device that logs, saves and prints nothing; ``options`` override
    any of that (``devices=2``, ``logger=CSVLogger(...)``, ``enable_checkpointing=True``)."""
    return pl.Trainer(strategy=strategy, **{**QUIET_CPU_TRAINER, **options})


def muon_adamw(params, lr: float = 3e-3) -> MuonAdamW:
    """Muon on the 2-D weights, AdamW on the rest, as one optimiser over two kinds of group."""
    ps = list(params)
    groups = [
        {"params": [p for p in ps if p.ndim == 2], "use_muon": True},
        {"params": [p for p in ps if p.ndim != 2], "use_muon": False},
    ]
    return MuonAdamW(groups, lr=lr, weight_decay=0.01)


def sgd_pipeline(model: nn.Module, loss, lr: float, momentum: float = 0.0, **options) -> Pipeline:
    """``model`` in a Pipeline trained by plain SGD; ``options`` go to the Pipeline."""
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return Pipeline(model, sgd, loss, **options)


def three_class_points(n: int, batch: int = 12) -> DataLoader:
    """``n`` random 5-feature points with random labels of 3 classes (seed 0), in batches."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def train_toy_pipeline(make_optimizer, config, epochs: int = 7) -> tuple[Pipeline, float, float]:
    """A 3-stage Tanh MLP on a separable 2-class toy set (seed 0) trained for ``epochs`` epochs
    of 8 minibatches under ``config``: the pipeline, and the summed loss of the first epoch and
    of the last."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )
    x = torch.randn(256, 4)
    y = (x[:, 0] > 0).long()
    pipe = Pipeline(
        model,
        make_optimizer(model.parameters()),
        nn.functional.cross_entropy,
        stages=3,
        schedule="pipemare",
        config=config,
    )
    sums = []
    for _ in range(epochs):
        sums.append(
            sum(float(pipe.step((x[i : i + 32], y[i : i + 32]))) for i in range(0, 256, 32))
        )
    return pipe, sums[0], sums[-1]
