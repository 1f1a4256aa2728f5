"""Gradient clipping across stages: exact for flushing schedules, lagged for the others."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from pipemare.engine.clip import GradClip, NormBoard, global_norm_lag
from support.models import sgd_pipeline


def model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def batches(n=5):
    gen = torch.Generator().manual_seed(2)
    return [
        (3 * torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(n)
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_sync_clipping_equals_plain_training(schedule, algorithm):
    ref = model()
    net = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    clipped = 0
    for x, y in batches():
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        if algorithm == "norm":
            clipped += float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)) > 0.3
        else:
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.05)
        ref_opt.step()
    kwargs = {"clip_grad_norm": 0.3} if algorithm == "norm" else {"clip_grad_value": 0.05}
    loss = nn.functional.cross_entropy
    pipe = sgd_pipeline(net, loss, lr=0.5, stages=3, microbatches=2, schedule=schedule, **kwargs)
    for b in batches():
        pipe.step(b)
    pipe.drain()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    if algorithm == "norm":
        assert clipped >= 3  # the threshold was active
        assert set(pipe.clip.last_norm) == {0, 1, 2}


def test_lagged_norm_combines_own_current_with_others_past():
    board = NormBoard(2)
    clip = GradClip("norm", 1.0, board, lag=2)
    params = [[nn.Parameter(torch.zeros(1))], [nn.Parameter(torch.zeros(1))]]

    def grads(stage, value):
        params[stage][0].grad = torch.tensor([value])

    for k in range(3):
        for stage, value in ((1, 3.0 + k), (0, 4.0 + k)):
            grads(stage, value)
            clip.post(stage, k, params[stage])
    # update 2 of stage 0: its own current norm (6) with stage 1's norm of update 0 (3)
    grads(0, 6.0)
    assert clip.ready(0, 2)
    clip.apply(0, 2, params[0])
    assert clip.last_norm[0] == pytest.approx(math.hypot(6.0, 3.0), rel=1e-6)
    assert params[0][0].grad.item() == pytest.approx(6.0 / math.hypot(6.0, 3.0), rel=1e-5)
    # the first `lag` updates have no past to combine with: the stage's own norm
    grads(1, 3.0)
    clip.apply(1, 0, params[1])
    assert clip.last_norm[1] == pytest.approx(3.0)


def test_lag_values():
    assert global_norm_lag(4, 1, flushes=True) == 0
    assert global_norm_lag(4, 1, flushes=False) == 4
    assert global_norm_lag(8, 4, flushes=False) == 3


def test_async_clipping_bounds_updates():
    net = model()
    pipe = sgd_pipeline(
        net,
        nn.functional.cross_entropy,
        lr=1.0,
        stages=3,
        microbatches=1,
        schedule="async",
        clip_grad_norm=0.01,
    )
    before = [p.detach().clone() for p in net.parameters()]
    for b in batches(8):
        pipe.step(b)
    pipe.drain()
    moved = math.sqrt(
        sum(
            float((p.detach() - q).pow(2).sum())
            for p, q in zip(net.parameters(), before, strict=True)
        )
    )
    # 8 updates of lr * (a global norm of at most 0.01, estimated from partly older norms)
    assert moved < 8 * 0.01 * 1.5


def test_choose_one_clipping():
    net = model()
    with pytest.raises(ValueError, match="choose one of clip_grad_norm and clip_grad_value"):
        sgd_pipeline(
            net,
            nn.functional.cross_entropy,
            lr=0.1,
            stages=2,
            clip_grad_norm=1.0,
            clip_grad_value=1.0,
        )
