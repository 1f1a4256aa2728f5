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
