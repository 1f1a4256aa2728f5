"""Models built as ``nn.Sequential`` so pipemare can cut them into fine-grained stages."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResidualBlock", "plain_mlp", "residual_mlp"]


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


def plain_mlp(inputs: int, classes: int, width: int = 64, layers: int = 10) -> nn.Sequential:
    """``layers`` linear layers with ReLUs between them, no skip connection and no norm: the
    hard case for delayed gradients, whose errors no identity path carries past a stage. Each
    hidden layer is one ``Linear + ReLU`` unit, so a pipeline of ``layers`` stages holds one
    layer per stage. He initialisation (zero biases) keeps the signal's scale through the depth
    (PyTorch's default shrinks it by a constant factor per layer, and at ten layers SGD then
    does not train it at all)."""
    units: list[nn.Module] = [nn.Sequential(nn.Linear(inputs, width), nn.ReLU())]
    units += [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers - 2)]
    units.append(nn.Linear(width, classes))
    net = nn.Sequential(*units)
    for module in net.modules():
        if isinstance(module, nn.Linear):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            nn.init.zeros_(module.bias)
    return net
