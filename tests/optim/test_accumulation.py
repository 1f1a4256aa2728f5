"""Local gradient accumulation (PACI): which updates a stage holds, what it applies, what it
excludes, its stable step range on the delayed quadratic and its memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pipemare import PipeMareConfig, PipeMareOptimizer, derive_delays
from pipemare.optim.corrections import LocalAccumulation, accumulation_steps
from pipemare.optim.settings import resolve
from pipemare.optim.stability import delayed_gd_bound, largest_stable_step
from support.models import train_toy_pipeline

OFF = PipeMareConfig.off()


def test_a_stage_sums_ceil_tau_over_c_minibatches_per_update():
    assert [accumulation_steps(t) for t in (0.0, 0.5, 1.0, 3.0, 7.0)] == [1, 1, 1, 3, 7]
    assert [accumulation_steps(7.0, c) for c in (1, 2, 3, 7, 8)] == [7, 4, 3, 1, 1]
    with pytest.raises(ValueError, match=">= 1"):
        accumulation_steps(3.0, 0)


def test_each_stage_updates_once_per_its_window_with_the_sum_of_its_gradients():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    stages = {i: list(model[i].parameters()) for i in range(3)}
    delays = derive_delays("pipemare", 3, 1)  # τ = 2, 1, 0
    cfg = dataclasses.replace(OFF, local_accumulation=1)
    opt = PipeMareOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stages, delays, cfg)
    (la,) = opt.corrections
    assert isinstance(la, LocalAccumulation) and la.steps == [2, 1, 1]
    assert [la.holds(0, m) for m in range(4)] == [True, False, True, False]
    assert not any(la.holds(2, m) for m in range(4))
    w0 = model[0].weight.detach().clone()
    grads = [torch.randn(3, 3) for _ in range(2)]
    for m, g in enumerate(grads):
        opt.record(m)
        w = model[0].weight
        w.grad = g.clone() if w.grad is None else w.grad + g  # autograd accumulates
        for p in stages[0][1:]:
            p.grad = torch.zeros_like(p)
        opt.step(0, m)
        if m == 0:  # held: nothing moved, the gradient waits
            assert torch.equal(w.detach(), w0) and torch.equal(w.grad, grads[0])
    torch.testing.assert_close(model[0].weight.detach(), w0 - 0.1 * (grads[0] + grads[1]))
    assert model[0].weight.grad is None


def test_it_excludes_the_corrections_that_count_one_update_per_minibatch():
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    names = [
        c.name for c in resolve(PipeMareConfig(local_accumulation=2), adam, stages=2).corrections
    ]
    assert names == ["lr_reschedule", "local_accumulation", "stability_guard"]
    for clash in (
        {"weight_prediction": True},
        {"spike_compensation": True},
        {"delay_momentum": 0.99},
        {"discrepancy_correction": True, "weight_prediction": False},
    ):
        with pytest.raises(ValueError, match="does not combine"):
            PipeMareConfig(local_accumulation=1, **clash)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="whole number >= 1"):
            PipeMareConfig(local_accumulation=bad)


@pytest.mark.parametrize("crossed", [1, 2])
@pytest.mark.parametrize("tau", [2, 4, 8])
def test_its_stable_step_is_delayed_gd_at_c_over_the_window(tau, crossed):
    """Each update applies the sum of k = ceil(τ/c) gradients that crossed at most c updates:
    stable while k·αλ < 2 sin(π/(4c+2)). Per gradient that is narrower than uncorrected
    asynchrony's 2 sin(π/(4τ+2)) (1/τ against about 1.57/τ at c = 1): accumulation buys
    consistent weights, not a longer step."""
    cfg = dataclasses.replace(OFF, local_accumulation=crossed)
    measured = largest_stable_step(tau, cfg, steps=1200)
    expected = delayed_gd_bound(crossed) / accumulation_steps(tau, crossed)
    assert measured == pytest.approx(expected, rel=0.03)
    assert measured < delayed_gd_bound(tau)


def test_a_pipeline_with_local_accumulation_trains_and_keeps_no_buffer():
    pipe, first, last = train_toy_pipeline(
        lambda ps: torch.optim.SGD(ps, lr=0.2), PipeMareConfig(local_accumulation=1)
    )
    assert last < 0.5 * first
    assert all(pipe.optimizer.buffer_bytes(s)["local_accumulation"] == 0 for s in range(3))
