"""Bytes a layer sends to the next stage and saves for its backward pass, and the calibration of
the fixed per-action cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from pipemare.engine.microbatch import _map
from pipemare.model.partition import _flat, _layers, _leaf, _nbytes
from pipemare.planner.measurements import ForwardContext


def _rows(value: Any, n: int) -> Any:
    return _map(value, lambda t: t[:n] if t.dim() > 0 else t)


def _storages(value: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in _flat(value)}


class _Bytes(NamedTuple):
    output: int
    saved: int
    saves_input: bool
    saves_output: bool
    params: int
    grads: int


def _bytes_pass(
    seq: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    forward_context: ForwardContext | None,
) -> tuple[list[_Bytes], int]:
    """Per layer its bytes, and the bytes of the model's input."""
    params = {id(p) for p in seq.parameters()}
    seen: set[int] = set()
    out_rows: list[_Bytes] = []
    layers = _layers(seq)
    x = sample
    for i, (_, layer) in enumerate(layers):
        saved: dict[int, int] = {}
        leaf = _leaf(x)
        context = forward_context() if forward_context is not None else contextlib.nullcontext()
        with _counting(saved, params), context:
            out = layer(leaf)
            if i == len(layers) - 1 and loss_fn is not None:
                loss_fn(out, target)
        ins, outs = _storages(leaf), _storages(out)
        other = sum(n for ptr, n in saved.items() if ptr not in ins | outs and ptr != 0)
        own = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        out_rows.append(
            _Bytes(
                _nbytes(out),
                other,
                bool(ins & set(saved)),
                bool(outs & set(saved)),
                sum(p.numel() * p.element_size() for p in own),
                sum(p.numel() * p.element_size() for p in own if p.requires_grad),
            )
        )
        x = _detach(out)
    return out_rows, _nbytes(sample)


def _counting(saved: dict[int, int], params: set[int]) -> contextlib.AbstractContextManager[Any]:
    """Record the storage and size of every tensor autograd saves, parameters excepted."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(base) not in params and id(t) not in params:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _detach(value: Any) -> Any:
    return _map(value, lambda t: t.detach())


def _sum_loss(output: Any, _target: Any) -> torch.Tensor:
    """Stand-in loss: the sum of the output, so the backward pass starts from ones."""
    parts = [t.sum() for t in _flat(output) if t.is_floating_point()]
    return torch.stack(parts).sum() if parts else torch.zeros(())


def _first_holders(seq: nn.Sequential) -> list[list[nn.Parameter]]:
    seen: set[int] = set()
    holders = []
    for _, layer in _layers(seq):
        own = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        holders.append(own)
    return holders
