"""Splitting a minibatch into microbatches along the first dimension."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["batch_size", "scatter", "to_device"]


def _map(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists, namedtuples and mappings."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: _map(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # mappings that cannot be built from a dict (defaultdict, ...)
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(v, fn) for v in batch)
    return batch


def _sizes(batch: Any) -> set[int]:
    sizes: set[int] = set()
    _map(batch, lambda t: sizes.add(t.shape[0]) if t.dim() > 0 else None)
    return sizes


def batch_size(batch: Any) -> int:
    """The common first dimension of every tensor in ``batch`` (a tensor or nested containers)."""
    sizes = _sizes(batch)
    if not sizes:
        raise ValueError("the batch holds no tensor with a batch dimension to split")
    if len(sizes) > 1:
        raise ValueError(
            f"the batch's tensors disagree on the batch dimension (sizes {sorted(sizes)}); "
            "every tensor in a batch must have the samples along dim 0"
        )
    return sizes.pop()


def scatter(batch: Any, chunks: int) -> list[Any]:
    """Split ``batch`` into ``chunks`` microbatches whose sizes differ by at most one.

    Tensors are split along dim 0 (views, no copy); anything else is shared by every
    microbatch. Tuples, lists, namedtuples and dicts keep their type.

    Example:
        >>> [x.shape[0] for x, _ in scatter((torch.zeros(5, 2), torch.zeros(5)), 2)]
        [3, 2]
    """
    if chunks < 1:
        raise ValueError(f"microbatches must be at least 1, got {chunks}")
    size = batch_size(batch)
    if size < chunks:
        raise ValueError(
            f"a batch of {size} samples cannot be split into {chunks} microbatches; "
            f"use a batch size >= {chunks} or fewer microbatches"
        )

    def piece(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t.tensor_split(chunks)[i] if t.dim() > 0 else t

    return [_map(batch, piece(i)) for i in range(chunks)]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in ``batch`` (nested tuples, lists, dicts) to ``device``."""
    return _map(batch, lambda t: t.to(device))
