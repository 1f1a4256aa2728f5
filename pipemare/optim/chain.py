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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["ChainedOptimizer", "owner_of"]


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


def owner_of(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The optimiser that steps ``group``: ``optimizer`` itself, or the chained one owning it."""
    return optimizer.owner(group) if isinstance(optimizer, ChainedOptimizer) else optimizer
