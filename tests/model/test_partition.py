"""Cutting a Sequential into stages: balances by parameters and by measured cost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipemare import Pipeline
from pipemare.model import partition


def mse(out, target):
    return ((out - target) ** 2).mean()


def test_balance_by_params():
    net = nn.Sequential(
        nn.Linear(100, 100), nn.Linear(100, 100), nn.Linear(100, 2), nn.Linear(2, 2)
    )
    pipe = Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.1), mse, stages=2, balance="params")
    assert pipe.balance == [1, 3]
    # ties (the ReLU costs nothing) go to the most even split
    net = nn.Sequential(
        nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 2), nn.ReLU(), nn.Linear(2, 2)
    )
    assert partition.balance_by_params(net, 2) == [2, 3]


@pytest.mark.parametrize(
    ("costs", "stages", "expected"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([5, 1, 1, 1, 1, 1], 2, [1, 5]),
        ([1, 2, 3, 4, 5], 3, [3, 1, 1]),
        ([0, 0, 0], 3, [1, 1, 1]),
    ],
)
def test_balance_by_cost_minimises_the_slowest_stage(costs, stages, expected):
    assert partition.balance_by_cost(costs, stages) == expected
