"""LightningModules written as for one device; pipemare pipelines their ``nn.Sequential``."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F

__all__ = ["DigitsCNN"]


class DigitsCNN(pl.LightningModule):
    """A small CNN for 8x8 digit images: two conv blocks and a two-layer classifier.

    Args:
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"`` (momentum 0.9).
        width: channels of the first convolution.
    """

    def __init__(self, lr: float = 1e-3, optimizer: str = "adam", width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 16, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("test_acc", (logits.argmax(1) == y).float().mean())

    def predict_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if self.hparams.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
