"""Splitting an ``nn.Sequential`` into contiguous stages, and choosing the split (the balance)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

__all__ = ["balance_by_cost", "balance_by_params", "check_sequential", "even_balance", "split"]


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
