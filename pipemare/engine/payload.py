"""What travels between stages: a Tensor or a tuple of Tensors (gradients may hold None)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Payload", "as_payload", "leaves", "tensors", "tensors_in"]

Payload = tuple[torch.Tensor | None, ...]  # gradients: None where an input got none


def as_payload(value: Any, stage: int, what: str = "output") -> Any:
    """Check that what a stage hands to the next one can travel: a Tensor or a tuple of Tensors."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return value
    kind = type(value).__name__
    if isinstance(value, (tuple, list)):
        kinds = sorted({type(v).__name__ for v in value})
        kind = f"{kind} of {', '.join(kinds)}"
    raise TypeError(
        f"stage {stage}'s {what} is a {kind}; between stages only a Tensor or a tuple of "
        "Tensors can travel. Return a tuple of tensors from the stage's last layer (pack other "
        "values into tensors) or move the stage boundary with `balance`"
    )


def tensors(value: Any) -> tuple[Any, ...]:
    """The entries of a payload as a tuple (a bare tensor becomes a 1-tuple)."""
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a stage's input or output: a tensor, or the entries of a tuple, list or
    dict (one level deep)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def leaves(value: Any) -> Any:
    """A received payload as fresh leaves, so a stage's backward can return their gradients."""

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().requires_grad_(x.is_floating_point() or x.is_complex())

    return leaf(value) if isinstance(value, torch.Tensor) else tuple(leaf(x) for x in value)
