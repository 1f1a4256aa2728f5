"""Lightning DataModules over real datasets that need no network."""

from __future__ import annotations

import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

from pipemare.experiments.data import digits

__all__ = ["DigitsDataModule"]


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's 1797 handwritten 8x8 digits as ``(1, 8, 8)`` images in [0, 1].

    Args:
        batch_size: samples per batch (one optimiser step).
        shuffle: reshuffle the training set every epoch.
        seed: the fixed train/validation split.
    """

    def __init__(self, batch_size: int = 32, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed

    def setup(self, stage: str | None = None) -> None:
        x_train, y_train, x_val, y_val = digits(seed=self.seed)
        self.train_set = TensorDataset(x_train.view(-1, 1, 8, 8), y_train)
        self.val_set = TensorDataset(x_val.view(-1, 1, 8, 8), y_val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=100)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.val_set.tensors[0]), batch_size=100)
