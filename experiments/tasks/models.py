"""Models built as ``nn.Sequential`` so pipemare can cut them into fine-grained stages."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResidualBlock", "residual_mlp"]


class ResidualBlock(nn.Module):
    """``x + W2 relu(W1 norm(x))``: a pre-norm MLP block, the unit of a fine-grained pipeline."""

    def __init__(self, width: int, expansion: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, expansion * width)
        self.fc2 = nn.Linear(expansion * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def residual_mlp(inputs: int, classes: int, width: int = 64, blocks: int = 6) -> nn.Sequential:
    """Input projection, ``blocks`` residual blocks, a final norm and a classifier head."""
    return nn.Sequential(
        nn.Linear(inputs, width),
        *[ResidualBlock(width) for _ in range(blocks)],
        nn.LayerNorm(width),
        nn.Linear(width, classes),
    )
