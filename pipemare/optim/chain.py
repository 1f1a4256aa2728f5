"""Several optimisers stepped as one: what a pipeline steps when a user returns two.

A Lightning module under manual optimisation may return, say, ``torch.optim.Muon`` for its
hidden matrices and ``AdamW`` for the rest. A pipeline stage updates the parameters it owns,
whichever optimiser holds them, so the engine steps the optimisers through one
:class:`ChainedOptimizer`: its parameter groups are the optimisers' own group dicts, in order,
so a learning-rate scheduler attached to either optimiser still drives the rate the stages
use, and the corrections read each group's family from the optimiser that owns it
(:meth:`ChainedOptimizer.owner`).

Its ``state_dict`` is torch's format over the concatenated groups: parameter ``i`` of the
chain is parameter ``i - offset`` of the optimiser whose span holds ``i``
(:meth:`ChainedOptimizer.span`), as if one optimiser held every group.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["ChainedOptimizer", "copies_of", "owner_of", "rebuild"]


class ChainedOptimizer(torch.optim.Optimizer):
    """Steps ``optimizers`` one after the other, as one optimiser over all their groups.

    Args:
        optimizers: two or more ``torch.optim`` optimisers over disjoint parameters.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> muon = torch.optim.Muon([net[0].weight], lr=0.02)
        >>> adam = torch.optim.AdamW([net[0].bias, *net[1].parameters()], lr=1e-3)
        >>> chain = ChainedOptimizer([muon, adam])
        >>> len(chain.param_groups), type(chain.owner(chain.param_groups[1])).__name__
        (2, 'AdamW')
        >>> chain.span(adam)
        (1, 3)
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        optimizers = list(optimizers)
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, ChainedOptimizer):
                raise TypeError(
                    f"a ChainedOptimizer chains torch.optim optimisers, not {type(opt).__name__}"
                )
        if len(optimizers) < 2:
            n = len(optimizers)
            raise ValueError(f"a ChainedOptimizer chains two optimisers or more, not {n}")
        seen: dict[int, int] = {}
        for i, opt in enumerate(optimizers):
            for g in opt.param_groups:
                for p in g["params"]:
                    if seen.setdefault(id(p), i) != i:
                        raise ValueError(
                            f"optimisers {seen[id(p)]} and {i} both hold a parameter of shape "
                            f"{tuple(p.shape)}; each parameter must belong to one optimiser, or "
                            "two updates would apply to it every step"
                        )
        self.optimizers = optimizers
        self.defaults: dict[str, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every optimiser's groups (the same dicts), in the chain's order."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        """Every optimiser's per-parameter state, merged (the per-parameter dicts are theirs)."""
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def owner(self, group: Mapping[str, Any]) -> torch.optim.Optimizer:
        """The optimiser whose parameter group ``group`` is (the very dict)."""
        for opt in self.optimizers:
            if any(g is group for g in opt.param_groups):
                return opt
        raise KeyError("the group belongs to none of the chained optimisers")

    def span(self, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        """``(offset, count)``: where ``optimizer``'s parameters sit in the chain's numbering."""
        offset = 0
        for opt in self.optimizers:
            count = sum(len(g["params"]) for g in opt.param_groups)
            if opt is optimizer or getattr(optimizer, "optimizer", None) is opt:
                return offset, count
            offset += count
        raise KeyError(f"{type(optimizer).__name__} is not one of the chained optimisers")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise ValueError("a ChainedOptimizer steps without a closure")
        for opt in self.optimizers:
            opt.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError(
            "a ChainedOptimizer cannot tell which optimiser a new group belongs to: add it to "
            "that optimiser (its add_param_group) instead"
        )

    def state_dict(self) -> dict[str, Any]:
        """torch's format, over the chain's numbering."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        for opt in self.optimizers:
            offset, _ = self.span(opt)
            sd = opt.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            for g in sd["param_groups"]:
                groups.append(dict(g, params=[offset + i for i in g["params"]]))
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, each optimiser its part."""
        groups = list(state_dict["param_groups"])
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the state holds {len(groups)} parameter groups, the chain "
                f"{len(self.param_groups)}"
            )
        start = 0
        for opt in self.optimizers:
            offset, count = self.span(opt)
            mine = groups[start : start + len(opt.param_groups)]
            start += len(opt.param_groups)
            opt.load_state_dict(
                {
                    "state": {
                        int(i) - offset: s
                        for i, s in state_dict["state"].items()
                        if offset <= int(i) < offset + count
                    },
                    "param_groups": [
                        dict(g, params=[int(i) - offset for i in g["params"]]) for g in mine
                    ],
                }
            )

    def __repr__(self) -> str:
        return f"ChainedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"


def _construct(like: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """An optimiser of ``like``'s type and defaults over ``params`` (the defaults its
    constructor takes: AdamW's hold one it does not)."""
    takes = inspect.signature(type(like)).parameters
    return type(like)(params, **{k: v for k, v in like.defaults.items() if k in takes})


def _of_kind(optimizer: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """A fresh optimiser of ``optimizer``'s kind (a chain's first) with its defaults over
    ``params``, which it never held: what the planner times an engine's fixed costs with."""
    first = optimizer.optimizers[0] if isinstance(optimizer, ChainedOptimizer) else optimizer
    params = list(params)  # a failed constructor may have used up an iterator
    try:
        return _construct(first, params)
    except (TypeError, ValueError):  # one that needs its own groups (MuonAdamW's use_muon)
        return torch.optim.SGD(params, lr=0.0)


def rebuild(
    optimizer: torch.optim.Optimizer,
    old: Sequence[torch.nn.Parameter],
    new: Sequence[torch.nn.Parameter],
) -> torch.optim.Optimizer:
    """The same optimiser, fresh, over ``new``: a copy of the parameters ``old`` in the same
    order (a deep copy of the model). Each group keeps its hyperparameters and each chained
    optimiser its type; a parameter the optimiser does not hold stays out of it.

    Example:
        >>> import copy
        >>> net = torch.nn.Linear(2, 2)
        >>> chain = ChainedOptimizer([torch.optim.SGD([net.weight], lr=0.1),
        ...                           torch.optim.AdamW([net.bias], lr=0.01)])
        >>> twin = copy.deepcopy(net)
        >>> fresh = rebuild(chain, list(net.parameters()), list(twin.parameters()))
        >>> fresh, [g["lr"] for g in fresh.param_groups], fresh.state == {}
        (ChainedOptimizer(SGD, AdamW), [0.1, 0.01], True)
    """
    old, new = list(old), list(new)
    if len(old) != len(new):
        raise ValueError(f"rebuild needs as many new parameters as old: {len(new)}, {len(old)}")
    where = {id(p): i for i, p in enumerate(old)}
    subs = optimizer.optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    built = []
    for opt in subs:
        groups = [
            dict(g, params=[new[where[id(p)]] for p in g["params"] if id(p) in where])
            for g in opt.param_groups
        ]
        groups = [g for g in groups if g["params"]]
        if groups:
            built.append(_construct(opt, groups))
    if not built:
        raise ValueError("the optimiser holds none of the parameters to rebuild it over")
    return built[0] if len(built) == 1 else ChainedOptimizer(built)


def copies_of(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]
) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """What the planner profiles a model's copies with: ``optimizer`` :func:`rebuild` over a
    copy of ``params`` (as many, in the same order); over other parameters (the planner's
    trivial layers), a fresh optimiser of its kind."""
    old = list(params)

    def make(new: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        new = list(new)
        return rebuild(optimizer, old, new) if len(new) == len(old) else _of_kind(optimizer, new)

    return make


def owner_of(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The optimiser that steps ``group``: ``optimizer`` itself, or the chained one owning it."""
    return optimizer.owner(group) if isinstance(optimizer, ChainedOptimizer) else optimizer
