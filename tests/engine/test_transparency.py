"""Synchronous schedules reproduce plain single-process training."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipemare import Pipeline
from support.models import muon_adamw, sgd_pipeline

OPTIMIZERS = {
    "momentum-sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3),
    "muon-adamw": muon_adamw,
}


def model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 16),
        nn.Tanh(),
        nn.Linear(16, 5),
    )


def batches(steps=5, size=12):
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(size, 10, generator=gen), torch.randint(0, 5, (size,), generator=gen))
        for _ in range(steps)
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (2, 1), (2, 3), (3, 4), (4, 2), (7, 6)])
def test_sync_schedules_equal_plain_training(schedule, opt, stages, micro):
    data = batches()
    ref = model()
    ref_opt = OPTIMIZERS[opt](ref.parameters())
    for x, y in data:
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()

    net = model()
    pipe = Pipeline(
        net,
        OPTIMIZERS[opt](net.parameters()),
        nn.functional.cross_entropy,
        stages=stages,
        microbatches=micro,
        schedule=schedule,
    )
    losses = [pipe.step(b) for b in data]
    pipe.drain()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert all(loss is not None for loss in losses)


def test_reported_loss_is_the_minibatch_mean_with_uneven_microbatches():
    net = model()
    ref = copy.deepcopy(net)
    ce = nn.functional.cross_entropy
    pipe = sgd_pipeline(net, ce, lr=0.0, stages=3, microbatches=4, schedule="gpipe")
    x, y = batches(1, size=10)[0]  # microbatches of 3, 3, 2, 2
    loss = pipe.step((x, y))
    torch.testing.assert_close(loss, nn.functional.cross_entropy(ref(x), y))


def test_t3_warmup_is_synchronous_then_the_pipeline_fills():
    from pipemare import PipeMareConfig

    data = batches(steps=6)
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    net = model()
    cfg = PipeMareConfig.t1_t2(lr_reschedule=False, discrepancy_correction=False, warmup_steps=3)
    pipe = Pipeline(
        net,
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
        nn.functional.cross_entropy,
        stages=4,
        microbatches=2,
        schedule="async",
        config=cfg,
    )
    for step, (x, y) in enumerate(data[:3]):
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        pipe.step((x, y))
        assert [s.in_flight for s in pipe.stages] == [0, 0, 0, 0], f"flushed after step {step}"
        for a, b in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for batch in data[3:]:
        pipe.step(batch)
    assert [s.in_flight for s in pipe.stages] == [3, 2, 1, 0]  # asynchronous from step 3 on
    assert [s.version for s in pipe.stages] == [4, 5, 5, 6]  # stage i lags by ceil((P-1-i)/N)
