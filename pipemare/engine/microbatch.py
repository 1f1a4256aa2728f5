"""Splitting a minibatch into microbatches along the first dimension."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "IGNORE_INDEX",
    "batch_size",
    "check_splits",
    "combine",
    "row_shares",
    "scatter",
    "scatter_filled",
    "to_device",
    "token_shares",
    "zero_loss",
]

#: the label that a token-averaged loss leaves out (PyTorch's cross-entropy default, and Hugging
#: Face's for padding)
IGNORE_INDEX = -100


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


def check_splits(size: int, chunks: int) -> None:
    """Refuse a batch of ``size`` samples that cannot give each of ``chunks`` microbatches one."""
    if size < chunks:
        raise ValueError(
            f"a batch of {size} samples cannot be split into {chunks} microbatches; "
            f"use a batch size >= {chunks} or fewer microbatches"
        )


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
    check_splits(batch_size(batch), chunks)

    def piece(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t.tensor_split(chunks)[i] if t.dim() > 0 else t

    return [_map(batch, piece(i)) for i in range(chunks)]


def scatter_filled(
    batch: Any, chunks: int, shares: Callable[[list[Any]], list[float]]
) -> tuple[list[Any], list[float]]:
    """``batch`` as ``chunks`` microbatches and each one's weight (``shares`` of the real ones).

    A batch of fewer samples than ``chunks`` (an epoch's last, smaller batch) becomes one
    microbatch per sample, and the slots left are filled with copies of them of weight 0: the
    schedule keeps its N microbatches per minibatch, and the gradient and loss are the
    batch's own. A filler runs forward and backward (its loss is zero: nothing it computes
    reaches the gradient or the logs), so layers that update state in the forward pass, such
    as BatchNorm's running statistics, also see the copies.

    Example:
        >>> mbs, w = scatter_filled(torch.arange(2.0).unsqueeze(1), 4, row_shares)
        >>> [m.tolist() for m in mbs], w
        ([[[0.0]], [[1.0]], [[0.0]], [[1.0]]], [0.5, 0.5, 0.0, 0.0])
    """
    real = scatter(batch, min(chunks, batch_size(batch)))
    fill = chunks - len(real)
    return real + [real[j % len(real)] for j in range(fill)], shares(real) + [0.0] * fill


def zero_loss(outputs: Any) -> torch.Tensor:
    """The loss of a microbatch of weight 0 (a filler of :func:`scatter_filled`): zero, on the
    graph of the last stage's floating-point ``outputs`` so that its backward runs like any
    other's. The step's own loss, and its logs and metrics, are not computed for it.

    Example:
        >>> zero_loss({"logits": torch.ones(2, 3, requires_grad=True)}).item()
        0.0
    """
    parts: list[torch.Tensor] = []
    _map(outputs, lambda t: parts.append(t.sum() * 0) if t.is_floating_point() else None)
    return torch.stack(parts).sum() if parts else torch.zeros(())


def row_shares(chunks: list[Any]) -> list[float]:
    """Each microbatch's share of the rows: the weights of a loss that averages over rows.

    Example:
        >>> row_shares([torch.zeros(3, 2), torch.zeros(1, 2)])
        [0.75, 0.25]
    """
    sizes = [batch_size(c) for c in chunks]
    return [n / sum(sizes) for n in sizes]


def token_shares(shift: int = 0) -> Callable[[list[Any]], list[float]]:
    """Weights for a loss that averages over the label tokens it counts, as Hugging Face's
    losses do (labels equal to :data:`IGNORE_INDEX`, e.g. padding, left out): each
    microbatch's share of the batch's counted tokens, so that the weighted sum of the
    microbatches' mean losses is the batch's mean loss. ``shift``: positions a causal LM drops
    from the front of each row's labels before counting (1: it predicts token ``t + 1``
    from ``t``). The labels are a mapping's ``labels`` entry or a tuple's last element
    (``(inputs, targets)``); microbatches without labels of rank 2 or more (a classifier's one
    label per row) are weighted by rows.

    Example:
        >>> labels = torch.tensor([[5, 6, -100], [7, -100, -100], [1, 2, 3], [4, 5, 6]])
        >>> token_shares()([{"labels": labels[:2]}, {"labels": labels[2:]}])
        [0.3333333333333333, 0.6666666666666666]
    """

    def shares(chunks: list[Any]) -> list[float]:
        counts = []
        for chunk in chunks:
            labels = _labels(chunk)
            if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
                return row_shares(chunks)
            counts.append(int((labels[..., shift:] != IGNORE_INDEX).sum()))
        total = sum(counts)
        return [n / total for n in counts] if total else row_shares(chunks)

    return shares


def _labels(chunk: Any) -> Any:
    """A microbatch's labels: its ``labels`` entry, or the last element of a tuple or list
    (``(inputs, targets)``)."""
    if isinstance(chunk, Mapping):
        return chunk.get("labels")
    if isinstance(chunk, (tuple, list)) and chunk:
        return chunk[-1]
    return None


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in ``batch`` (nested tuples, lists, dicts) to ``device``."""
    return _map(batch, lambda t: t.to(device))


def combine(outputs: list[Any], sizes: list[int]) -> Any:
    """One output for a whole batch from its microbatches' outputs (the inverse of scatter).

    Tensors whose first dimension is their microbatch's size are concatenated; scalars (0-dim
    tensors, Python numbers) are averaged weighted by microbatch size, as a per-sample mean
    over the batch would be; mappings, tuples and lists are combined entry by entry; anything
    else comes back as the list of the microbatches' values.

    Example:
        >>> combine([torch.tensor(1.0), torch.tensor(4.0)], [3, 1])
        tensor(1.7500)
    """
    first, total = outputs[0], sum(sizes)
    if len(outputs) == 1 or first is None:
        return first
    if isinstance(first, torch.Tensor) and all(isinstance(o, torch.Tensor) for o in outputs):
        if first.dim() == 0:
            return sum(o * (n / total) for o, n in zip(outputs, sizes, strict=True))
        if all(o.dim() > 0 and o.shape[0] == n for o, n in zip(outputs, sizes, strict=True)):
            return torch.cat(outputs)
        return list(outputs)
    if isinstance(first, Mapping) and all(isinstance(o, Mapping) for o in outputs):
        return {k: combine([o[k] for o in outputs], sizes) for k in first}
    if isinstance(first, (tuple, list)) and all(
        type(o) is type(first) and len(o) == len(first) for o in outputs
    ):
        parts = [combine([o[i] for o in outputs], sizes) for i in range(len(first))]
        return type(first)(parts) if not hasattr(first, "_fields") else type(first)(*parts)
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(o * (n / total) for o, n in zip(outputs, sizes, strict=True))
    return list(outputs)
