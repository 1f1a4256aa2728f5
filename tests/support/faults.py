"""A layer that starts producing Inf on cue, for divergence tests (in-process and launched)."""

from __future__ import annotations

from torch import nn

from support.models import DigitsCNN


class Explode(nn.Module):
    """Outputs Inf from its n-th training forward on: a stand-in for a layer that blows up."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.calls = after, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                return x * float("inf")
        return x


class Exploding(DigitsCNN):
    """DigitsCNN with an Explode layer after its fifth layer (MaxPool2d), counting the
    training loop's forwards only: the pipeline, planned before the sanity check, measures its
    layers in training mode before the loop starts."""

    def __init__(self, after: int):
        super().__init__(lr=1e-3)
        layers = list(self.net)
        self.net = nn.Sequential(*layers[:5], Explode(after), *layers[5:])

    def on_train_start(self) -> None:
        self.net[5].calls = 0
