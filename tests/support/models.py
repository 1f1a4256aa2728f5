"""Small pipelines, data and trainers that many tests (and the worker scripts) build alike."""

from __future__ import annotations

import itertools
from typing import Any

import pytorch_lightning as pl
import torch
import torchmetrics
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


def plain_mlp(inputs: int, classes: int, width: int = 64, layers: int = 10) -> nn.Sequential:
    """``layers`` Linear layers, ReLU between them, no skip connection and no norm (the hard case
    for delayed gradients); each hidden ``Linear + ReLU`` is one unit of the Sequential. He
    initialisation with zero biases, without which SGD does not train ten such layers."""
    sizes = [inputs] + [width] * (layers - 1)
    units: list[nn.Module] = [
        nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in itertools.pairwise(sizes)
    ]
    net = nn.Sequential(*units, nn.Linear(width, classes))
    for linear in (m for m in net.modules() if isinstance(m, nn.Linear)):
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
    return net


class Classifier(pl.LightningModule):
    """``self.net`` (what the strategy pipelines) scored by cross-entropy; logs ``{stage}_loss``
    and torchmetrics' accuracy ``{stage}_acc`` (train's per epoch), predicts the argmax."""

    net: nn.Module

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.train_acc, self.val_acc, self.test_acc = (
            torchmetrics.Accuracy(task="multiclass", num_classes=classes) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _step(self, stage: str, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        accuracy = getattr(self, f"{stage}_acc")
        accuracy(logits, y)
        self.log(f"{stage}_loss", loss, prog_bar=stage != "test")
        self.log(f"{stage}_acc", accuracy, on_step=False, on_epoch=True)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step("train", batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step("test", batch)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0] if isinstance(batch, (tuple, list)) else batch).argmax(1)


class DigitsCNN(Classifier):
    """A CNN for the 8x8 digits in 9 layers: two convolutions, a pool, a two-layer head.

    ``optimizer`` is ``"adam"``, ``"adamw"`` or ``"sgd"`` (momentum 0.9) at rate ``lr``.
    """

    def __init__(self, lr: float = 1e-3, optimizer: str = "adam", width: int = 16) -> None:
        if optimizer not in ("adam", "adamw", "sgd"):
            raise ValueError(f"optimizer must be adam, adamw or sgd, got {optimizer!r}")
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        lr, kind = self.hparams.lr, self.hparams.optimizer
        if kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)
        adam = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        return adam(self.parameters(), lr=lr)
