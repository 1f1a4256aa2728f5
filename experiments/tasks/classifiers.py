"""Image classifiers written as for one device; pipemare pipelines their ``nn.Sequential``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import pytorch_lightning as pl
import torch
import torchmetrics
from pytorch_lightning.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.nn import functional as F

__all__ = ["ARCHITECTURES", "DigitsCNN", "ImageClassifier", "TaskModule"]


class TaskModule(pl.LightningModule):
    """Optimiser and LR schedule given as callables, so configs choose them (LightningCLI style).

    A subclass builds ``self.net`` (what pipemare pipelines) and says what a batch feeds it
    (:meth:`_outputs`) and how its output is scored (:meth:`_loss`); the steps here log
    ``{stage}_loss`` and, for the stages named in :attr:`metric_options`, the torchmetrics
    module ``self.{stage}_{metric}`` updated with the batch.
    """

    net: nn.Module
    #: the metric's name: its modules are ``self.train_{metric}``, ``self.val_{metric}``, ...
    metric = ""
    #: the stages whose metric is logged, with their ``self.log`` options
    metric_options: ClassVar[dict[str, dict[str, Any]]] = {
        "train": {"on_step": False, "on_epoch": True},
        "val": {"prog_bar": True},
    }

    def __init__(self, optimizer: OptimizerCallable, scheduler: LRSchedulerCallable | None) -> None:
        super().__init__()
        # Lightning collects the arguments of every __init__ up the call, the subclass's too;
        # the callables are no hyperparameters a checkpoint could hold
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self._optimizer, self._scheduler = optimizer, scheduler

    def configure_optimizers(self) -> Any:
        opt = self._optimizer(self.parameters())
        if self._scheduler is None:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": self._scheduler(opt), "interval": "step"},
        }

    def _outputs(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """``self.net``'s output on a batch, and the targets it is scored against."""
        x, y = batch
        return self.net(x), y

    def _loss(self, output: Any, targets: torch.Tensor, stage: str) -> torch.Tensor:
        raise NotImplementedError

    def _step(self, stage: str, batch: Any) -> torch.Tensor:
        output, targets = self._outputs(batch)
        loss = self._loss(output, targets, stage)
        name = f"{stage}_{self.metric}"
        metric = getattr(self, name) if stage in self.metric_options else None
        if metric is not None:
            metric(output, targets)
        self.log(f"{stage}_loss", loss, prog_bar=stage != "test")
        if metric is not None:
            self.log(name, metric, **self.metric_options[stage])
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step("train", batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step("val", batch)


def _block(cin: int, cout: int, pool: nn.Module | None = None) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
    if pool is not None:
        layers.append(pool)
    return nn.Sequential(*layers)


def digits_cnn(num_classes: int = 10, width: int = 16) -> nn.Sequential:
    """8x8 digits: two convolutions, a pool and a two-layer head (9 layers)."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 16, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


def mnist_cnn(num_classes: int = 10, width: int = 8) -> nn.Sequential:
    """28x28 digits in 8 layers (a fine-grained pipeline's units): six conv blocks, two linear."""
    w = width
    return nn.Sequential(
        _block(1, w),
        _block(w, w, nn.MaxPool2d(2)),
        _block(w, 2 * w),
        _block(2 * w, 2 * w, nn.MaxPool2d(2)),
        _block(2 * w, 4 * w),
        _block(4 * w, 4 * w, nn.AdaptiveAvgPool2d(1)),
        nn.Sequential(nn.Flatten(), nn.Linear(4 * w, 16 * w), nn.ReLU()),
        nn.Linear(16 * w, num_classes),
    )


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(min(8, channels // 2), channels)


class _Residual(nn.Module):
    """A ResNet basic block (He et al., 2016): two 3x3 convolutions and a shortcut.

    ``norm="batch"`` is the original; ``"group"`` keeps no running statistics. BatchNorm's
    running averages mix activations produced by older weights, and in an asynchronous
    pipeline also by older weights of every earlier stage, so evaluating in eval mode can lag
    the trained weights badly (measured on MNIST: 50% accuracy with running statistics against
    88% with batch statistics for the same weights).
    """

    def __init__(self, cin: int, cout: int, stride: int, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = _norm(norm, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(norm, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def cifar_resnet(depth: int = 56, num_classes: int = 10) -> nn.Sequential:
    """ResNet-``depth`` for 32x32 images, one residual block per layer of the Sequential."""
    if (depth - 2) % 6:
        raise ValueError(f"CIFAR ResNet depth must be 6n+2 (20, 32, 44, 56, 110), got {depth}")
    n = (depth - 2) // 6
    layers: list[nn.Module] = [
        nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
    ]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(n):
            layers.append(_Residual(cin, cout, stride if i == 0 else 1))
            cin = cout
    layers += [nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


def mnist_resnet(num_classes: int = 10, width: int = 8) -> nn.Sequential:
    """28x28 digits, 8 layers: a stem, five residual blocks (GroupNorm), pooling, a classifier."""
    w = width
    stem = nn.Sequential(nn.Conv2d(1, w, 3, 1, 1, bias=False), _norm("group", w), nn.ReLU())
    return nn.Sequential(
        stem,
        _Residual(w, w, 1, "group"),
        _Residual(w, 2 * w, 2, "group"),
        _Residual(2 * w, 2 * w, 1, "group"),
        _Residual(2 * w, 4 * w, 2, "group"),
        _Residual(4 * w, 4 * w, 1, "group"),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        nn.Linear(4 * w, num_classes),
    )


ARCHITECTURES: dict[str, Callable[..., nn.Sequential]] = {
    "digits_cnn": digits_cnn,
    "mnist_cnn": mnist_cnn,
    "mnist_resnet": mnist_resnet,
    "resnet20": functools.partial(cifar_resnet, 20),
    "resnet56": functools.partial(cifar_resnet, 56),
    "resnet110": functools.partial(cifar_resnet, 110),
}


class ImageClassifier(TaskModule):
    """An image classifier with torchmetrics accuracy; ``self.net`` is what pipemare pipelines.

    Args:
        arch: one of :data:`ARCHITECTURES`.
        num_classes: output classes.
        optimizer: e.g. ``torch.optim.Adam`` or ``functools.partial(torch.optim.SGD, lr=0.1)``.
        scheduler: an optional LR scheduler callable, stepped every training step.
        label_smoothing: for the cross-entropy loss.
    """

    metric = "acc"
    metric_options: ClassVar[dict[str, dict[str, Any]]] = {**TaskModule.metric_options, "test": {}}

    def __init__(
        self,
        arch: str = "mnist_cnn",
        num_classes: int = 10,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
        label_smoothing: float = 0.0,
    ) -> None:
        if arch not in ARCHITECTURES:
            raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        super().__init__(optimizer, scheduler)
        self.net = ARCHITECTURES[arch](num_classes=num_classes)
        self.label_smoothing = label_smoothing
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, logits: torch.Tensor, y: torch.Tensor, stage: str) -> torch.Tensor:
        smoothing = self.label_smoothing if stage == "train" else 0.0
        return F.cross_entropy(logits, y, label_smoothing=smoothing)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step("test", batch)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(1)


class DigitsCNN(ImageClassifier):
    """The 8x8-digits CNN with its optimiser named by a string (handy outside configs).

    Args:
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"`` (momentum 0.9).
        width: channels of the first convolution.
    """

    def __init__(self, lr: float = 1e-3, optimizer: str = "adam", width: int = 16) -> None:
        choices: dict[str, Callable[..., torch.optim.Optimizer]] = {
            "adam": functools.partial(torch.optim.Adam, lr=lr),
            "adamw": functools.partial(torch.optim.AdamW, lr=lr),
            "sgd": functools.partial(torch.optim.SGD, lr=lr, momentum=0.9),
        }
        if optimizer not in choices:
            raise ValueError(f"optimizer must be one of {', '.join(choices)}, got {optimizer!r}")
        super().__init__(arch="digits_cnn", optimizer=choices[optimizer])
        self.save_hyperparameters()
        self.net = digits_cnn(width=width)
