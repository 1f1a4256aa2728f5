"""The CUDA path: the simulator on a GPU matches the CPU run (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipemare import Pipeline

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("schedule", ["1f1b", "pipemare", "pipedream"])
def test_cuda_simulator_matches_cpu(schedule):
    def run(device):
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
        )
        net.to(device)
        pipe = Pipeline(
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            nn.functional.cross_entropy,
            stages=3,
            microbatches=2,
            schedule=schedule,
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            pipe.step((torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)))
        pipe.drain()
        return [p.detach().cpu() for p in net.parameters()]

    for a, b in zip(run("cuda"), run("cpu"), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
