"""Real datasets that need no network: scikit-learn's 8x8 handwritten digits."""

from __future__ import annotations

import torch

__all__ = ["digits"]


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
