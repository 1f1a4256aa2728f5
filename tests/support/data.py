"""Real data that needs no network, for the tests: scikit-learn's 8x8 handwritten digits, and
bytes of Python's own standard-library source for a byte-level language model."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


def digits(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``sklearn.datasets.load_digits`` (1797 images of 64 pixels, scaled to [0, 1]), shuffled
    by ``seed`` and cut five to one: ``(x_train, y_train, x_val, y_val)``, images flattened."""
    from sklearn.datasets import load_digits

    pixels, labels = load_digits(return_X_y=True)
    x = torch.tensor(pixels / 16.0, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(len(x) * 5 / 6)
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


class _Held(pl.LightningDataModule):
    """A training and a validation set held in memory; test and predict read validation."""

    train_set: TensorDataset
    val_set: TensorDataset
    batch_size: int
    shuffle = True
    val_batch_size = 100

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class DigitsDataModule(_Held):
    """The digits as ``(1, 8, 8)`` images; the validation set is the fixed sixth of them."""

    def __init__(self, batch_size: int = 32, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed

    def setup(self, stage: str | None = None) -> None:
        x, y, xv, yv = digits(self.seed)
        self.train_set = TensorDataset(x.view(-1, 1, 8, 8), y)
        self.val_set = TensorDataset(xv.view(-1, 1, 8, 8), yv)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.val_set.tensors[0]), batch_size=self.val_batch_size)


#: standard-library modules whose source is the text (on every machine with Python)
SOURCES = (
    "argparse", "collections/__init__", "dataclasses", "functools", "inspect", "json/decoder",
    "pathlib", "typing", "textwrap", "enum", "logging/__init__", "contextlib", "abc", "csv",
    "heapq", "bisect", "string", "random", "statistics", "fractions",
)  # fmt: skip


def _windows(ids: torch.Tensor, context: int, limit: int | None = None) -> TensorDataset:
    """Consecutive ``context``-byte windows (at most ``limit``), each with the window one byte
    later as its targets."""
    n = (len(ids) - 1) // context
    if limit is not None:
        n = min(n, limit)
    inputs, targets = ids[: n * context], ids[1 : n * context + 1]
    return TensorDataset(inputs.view(n, context), targets.view(n, context))


class CharCorpusDataModule(_Held):
    """Next-byte prediction on :data:`SOURCES` (about 0.9 MB): the first 90% is cut into
    training windows, the first ``val_windows`` windows of the rest are validation."""

    val_batch_size = 128

    def __init__(self, context: int = 32, batch_size: int = 16, val_windows: int = 512) -> None:
        super().__init__()
        self.context, self.batch_size, self.val_windows = context, batch_size, val_windows

    def setup(self, stage: str | None = None) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        text = b"".join((root / f"{name}.py").read_bytes() for name in SOURCES)
        ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = int(len(ids) * 0.9)
        self.train_set = _windows(ids[:cut], self.context)
        self.val_set = _windows(ids[cut:], self.context, self.val_windows)
