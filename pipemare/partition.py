"""Splitting an ``nn.Sequential`` into contiguous stages, and choosing the split (the balance)."""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "balance_by_cost",
    "balance_by_params",
    "balance_by_time",
    "check_sequential",
    "even_balance",
    "layer_times",
    "split",
]


def check_sequential(model: object, what: str = "the model") -> nn.Sequential:
    """Return ``model`` if it is an ``nn.Sequential``, else raise an error that says what to do."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"{what} must be a torch.nn.Sequential so it can be cut into stages, got "
            f"{type(model).__name__}; express the pipelined part as nn.Sequential(layer, ...)"
        )
    return model


def _check_stages(num_layers: int, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if stages > num_layers:
        raise ValueError(
            f"cannot cut {num_layers} layers into {stages} stages: every stage needs at least "
            f"one layer; use stages <= {num_layers} or split the model into more layers"
        )


def even_balance(num_layers: int, stages: int) -> list[int]:
    """Layers per stage, as equal as possible, earlier stages taking the remainder."""
    _check_stages(num_layers, stages)
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def balance_by_cost(costs: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of per-layer costs into ``stages`` parts minimising the largest part.

    Ties are broken towards the even split, so layers that cost nothing (activations) do not
    pile up on one stage.
    """
    n = len(costs)
    _check_stages(n, stages)
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ValueError(f"layer costs must be non-negative, got {c}")
        prefix.append(prefix[-1] + float(c))

    # best[j][l]: (max part cost, spread) for the first l layers cut into j parts.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    ideal = n / stages
    for j in range(1, stages + 1):
        for end in range(j, n - (stages - j) + 1):
            for begin in range(j - 1, end):
                prev = best[j - 1][begin]
                if prev == inf:
                    continue
                part = prefix[end] - prefix[begin]
                cand = (max(prev[0], part), prev[1] + abs((end - begin) - ideal))
                if cand < best[j][end]:
                    best[j][end], cut[j][end] = cand, begin
    balance, end = [], n
    for j in range(stages, 0, -1):
        begin = cut[j][end]
        balance.append(end - begin)
        end = begin
    return balance[::-1]


def balance_by_params(model: nn.Sequential, stages: int) -> list[int]:
    """Split so that every stage holds about the same number of parameters."""
    check_sequential(model)
    costs = [sum(p.numel() for p in layer.parameters()) for layer in model]
    return balance_by_cost(costs, stages)


def layer_times(model: nn.Sequential, sample: Any, repeats: int = 3) -> list[float]:
    """Median seconds of each layer's forward plus backward pass on ``sample`` (the model's input).

    Each layer runs on the output of the previous one, as in the pipeline; gradients flow into
    a detached copy of the layer's input and are thrown away (parameters keep theirs).
    """
    check_sequential(model)
    # Lightning may call this from validation, under inference mode: time with autograd on.
    with torch.inference_mode(False), torch.enable_grad():
        return _layer_times(model, _clone(sample), repeats)


def _layer_times(model: nn.Sequential, sample: Any, repeats: int) -> list[float]:
    sync = torch.cuda.synchronize if _on_cuda(sample) else (lambda: None)
    times, x = [], sample
    for layer in model:
        samples = []
        for _ in range(repeats + 1):
            leaf = _leaf(x)
            start = time.perf_counter()
            out = layer(leaf)
            outs = [t for t in _flat(out) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            sync()
            samples.append(time.perf_counter() - start)
        for p in layer.parameters():
            p.grad = None
        times.append(statistics.median(samples[1:]))  # the first run warms caches up
        with torch.no_grad():
            x = layer(_leaf(x))
    return times


def balance_by_time(model: nn.Sequential, sample: Any, stages: int) -> list[int]:
    """Split so that every stage's measured forward+backward time is about the same."""
    return balance_by_cost(layer_times(model, sample), stages)


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return []


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def _leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_leaf(v) for v in value)
    return value


def _on_cuda(value: Any) -> bool:
    return any(t.is_cuda for t in _flat(value))


def split(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` into consecutive ``nn.Sequential`` stages of ``balance[i]`` layers each.

    The stages share the layer objects with ``model``: no parameter is copied.
    """
    check_sequential(model)
    balance = list(balance)
    _check_stages(len(model), len(balance))
    if any(b < 1 for b in balance) or sum(balance) != len(model):
        raise ValueError(
            f"balance {balance} must list a positive layer count per stage summing to the "
            f"model's {len(model)} layers"
        )
    layers = list(model.named_children())
    stages, start = [], 0
    for size in balance:
        stages.append(nn.Sequential(OrderedDict(layers[start : start + size])))
        start += size
    return stages
