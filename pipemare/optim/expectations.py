"""What the user's protocol measured, said once at setup where it matters.

``pipemare user-protocol`` (docs/results.md, "The user's protocol") runs every task at the
rate tuned on one device, at P = 2, 4 and 8 with the default N, and compares the pipeline time
pipemare takes to come within 1% (0.5 point) of 1F1B's final quality with 1F1B's own at its
fastest N. :data:`MEASURED` keeps, per optimiser family and P, in how many of the tasks
measured pipemare got there sooner (at most 0.8 of 1F1B's time, or within 0.05 of 1F1B's
bubble bound where that is above 0.75). Where it lost in most of them, the run's settings carry
a decision that says so, with the alternative that won; a test holds this table to the
published results (``experiments/results/user_protocol/results.json``).
"""

from __future__ import annotations

import torch

from pipemare.optim.corrections.base import group_momentum, is_adam_family, is_muon

__all__ = ["MEASURED", "expectation", "optimizer_family"]

#: (family, P) -> (tasks where pipemare reached 1F1B's quality sooner, tasks measured), from
#: ``pipemare user-protocol`` on small models with CPU cores for devices (2026-11-27): at
#: N = P the asynchronous pipeline runs P times the actions of 1F1B at N = 1 or 2, and each
#: action's fixed cost dominates there, so 1F1B won every cell on time while pipemare matched
#: its quality in 17 of 21
MEASURED: dict[tuple[str, int], tuple[int, int]] = {
    ("adam", 2): (0, 4),
    ("adam", 4): (0, 4),
    ("adam", 8): (0, 4),
    ("muon", 2): (0, 1),
    ("muon", 4): (0, 1),
    ("muon", 8): (0, 1),
    ("sgd", 2): (0, 1),
    ("sgd", 4): (0, 1),
    ("sgd", 8): (0, 1),
}

#: the names the families are said with
_NAMES = {"adam": "the Adam family", "muon": "Muon + AdamW", "sgd": "SGD with momentum"}


def optimizer_family(optimizer: torch.optim.Optimizer) -> str | None:
    """``"muon"`` if any group steps as Muon, ``"adam"`` if every group is of the Adam family,
    ``"sgd"`` for SGD with momentum; None otherwise (nothing was measured for it)."""
    groups = optimizer.param_groups
    if any(is_muon(optimizer, g) for g in groups):
        return "muon"
    if all(is_adam_family(optimizer, g) for g in groups):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD) and all(group_momentum(g) for g in groups):
        return "sgd"
    return None


def expectation(optimizer: torch.optim.Optimizer, stages: int) -> str | None:
    """What to expect of pipemare's default at P = ``stages`` with ``optimizer``, where the
    protocol measured that 1F1B reaches the one-device quality sooner in most tasks; None where
    pipemare won, or nothing was measured."""
    kind = optimizer_family(optimizer)
    if kind is None or (kind, stages) not in MEASURED:
        return None
    sooner, tasks = MEASURED[(kind, stages)]
    if 2 * sooner > tasks:
        return None
    return (
        f"{_NAMES[kind]} at P = {stages}: 1f1b reached the one-device quality sooner in "
        f"{tasks - sooner} of the {tasks} small models measured on CPU cores, where each "
        "microbatch's fixed cost dominates (docs/results.md, the user's protocol); "
        "strategy='pipemare_1f1b' runs it"
    )
