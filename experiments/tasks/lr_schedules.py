"""Learning-rate schedules as classes, so YAML configs can name them (``class_path``).

Their warm-up is ``lr_warmup_steps``, apart from PipeMare's own ``warmup_steps`` (T3: the first
steps run a flushing schedule), which a config may set too.
"""

from __future__ import annotations

import math

import torch

__all__ = ["InverseSqrt", "WarmupConstant", "WarmupCosine"]


class WarmupConstant(torch.optim.lr_scheduler.LambdaLR):
    """Linear warm-up over ``lr_warmup_steps``, then the optimiser's LR."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_warmup_steps: int = 100) -> None:
        self.lr_warmup_steps = lr_warmup_steps
        super().__init__(optimizer, lambda k: min(1.0, (k + 1) / max(lr_warmup_steps, 1)))


class WarmupCosine(torch.optim.lr_scheduler.LambdaLR):
    """Linear warm-up over ``lr_warmup_steps``, then cosine decay to ``final`` times the LR at
    ``total_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_warmup_steps: int = 100,
        total_steps: int = 1000,
        final: float = 0.0,
    ) -> None:
        def factor(k: int) -> float:
            if k < lr_warmup_steps:
                return (k + 1) / lr_warmup_steps
            progress = min(1.0, (k - lr_warmup_steps) / max(total_steps - lr_warmup_steps, 1))
            return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))

        super().__init__(optimizer, factor)


class InverseSqrt(torch.optim.lr_scheduler.LambdaLR):
    """The Transformer schedule (Vaswani et al. 2017): linear warm-up over ``lr_warmup_steps``,
    then ``1/sqrt(step)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_warmup_steps: int = 4000) -> None:
        w = lr_warmup_steps
        super().__init__(optimizer, lambda k: min((k + 1) / w, math.sqrt(w / (k + 1))))
