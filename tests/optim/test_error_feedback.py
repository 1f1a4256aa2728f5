"""Error feedback on the delayed update (Zmushko et al., 2026): its formula, its stable step
on the delayed quadratic, its one buffer per weight, and a checkpoint round trip."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pipemare import PipeMareConfig, PipeMareOptimizer, derive_delays
from pipemare.optim.corrections import ErrorFeedback
from pipemare.optim.corrections.error_feedback import stable_step
from pipemare.optim.settings import resolve
from pipemare.optim.stability import delayed_gd_bound, is_stable, largest_stable_step
from support.models import train_toy_pipeline

OFF = PipeMareConfig.off()


def three_stages(coefficient: float | str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    stages = {i: list(model[i].parameters()) for i in range(3)}
    cfg = dataclasses.replace(OFF, error_feedback=coefficient)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, stages, PipeMareOptimizer(sgd, stages, derive_delays("pipemare", 3, 1), cfg)


@pytest.mark.parametrize("coefficient", [1.0, 0.5, "delay"])
def test_each_update_adds_c_times_its_change_since_the_last(coefficient):
    model, stages, opt = three_stages(coefficient)  # τ = 2, 1, 0
    (ef,) = opt.corrections
    assert isinstance(ef, ErrorFeedback)
    c = {"delay": 2.0}.get(coefficient, coefficient)  # type: ignore[call-overload]
    assert ef.stage_coefficient(0) == c and ef.stage_coefficient(2) == 0.0
    w = model[0].weight
    expected = w.detach().clone()
    last = None
    for m in range(4):
        g = torch.randn(3, 3)
        opt.record(m)
        for p in stages[0]:
            p.grad = g.clone() if p is w else torch.zeros_like(p)
        opt.step(0, m)
        step = -0.1 * g
        # the first update has nothing to compare with: an ordinary step
        expected += step if last is None else step + c * (step - last)
        last = step
        torch.testing.assert_close(w.detach(), expected)
    # the last stage has no delay: no buffer, and its updates are the optimiser's own
    v = model[2].weight
    before = v.detach().clone()
    for p in stages[2]:
        p.grad = torch.ones_like(p)
    opt.step(2, 4)
    torch.testing.assert_close(v.detach(), before - 0.1)
    assert v not in ef.previous


def test_bad_settings_are_refused():
    for bad in (-1.0, "auto", True, float("nan")):
        with pytest.raises(ValueError, match="error_feedback must be"):
            PipeMareConfig(error_feedback=bad)
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    names = [
        c.name for c in resolve(PipeMareConfig(error_feedback=1.0), adam, stages=2).corrections
    ]
    assert names.index("error_feedback") == names.index("weight_prediction") + 1


@pytest.mark.parametrize("tau", [1, 2, 4, 8])
@pytest.mark.parametrize("coefficient", [1.0, "delay"])
def test_its_stable_step_on_the_delayed_quadratic_follows_its_polynomial(tau, coefficient):
    """Plain SGD with error feedback contracts while z^{τ+2} - z^{τ+1} + αλ((1+c)z - c) has
    every root inside the unit circle. Against uncorrected asynchrony's 2 sin(π/(4τ+2)) it
    narrows the range at short delays (0.618 against 1 at τ = 1, like weight prediction on
    plain SGD) and, with c = 1, widens it a little at long ones (0.1995 against 0.1845 at
    τ = 8); c = τ narrows it at every delay.

    The run's range is bracketed, not bisected: it contracts at 0.98 times the polynomial's
    step and not at 1.02 times (the bisection's own test at the two rates that bound a result
    within 2%), and contracts at asynchrony's bound exactly where it should be wider."""
    cfg = dataclasses.replace(OFF, error_feedback=coefficient)
    c = float(tau) if coefficient == "delay" else coefficient
    predicted = stable_step(tau, c)
    assert is_stable(0.98 * predicted, tau, cfg, steps=1200)
    assert not is_stable(1.02 * predicted, tau, cfg, steps=1200)
    async_bound = delayed_gd_bound(tau)
    wider = not (tau <= 2 or coefficient == "delay")
    assert is_stable(async_bound, tau, cfg, steps=1200) == wider
    assert stable_step(tau, 0.0) == pytest.approx(async_bound, rel=1e-6)


def test_with_heavy_ball_momentum_it_widens_the_stable_step():
    momentum = lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)  # noqa: E731
    fed = dataclasses.replace(OFF, error_feedback=1.0)
    for tau in (1, 2):
        plain = largest_stable_step(tau, OFF, momentum, high=4.0)
        # its range reaches past 1.5 times no correction's: it contracts there
        assert is_stable(1.5 * plain, tau, fed, momentum), (tau, plain)


def test_one_buffer_per_weight_of_a_delayed_stage_and_a_checkpoint_round_trip():
    model, stages, opt = three_stages(1.0)
    for m in range(3):
        opt.record(m)
        for s in range(3):
            for p in stages[s]:
                p.grad = torch.randn_like(p)
            opt.step(s, m)
    sizes = [sum(p.numel() * 4 for p in stages[s]) for s in range(3)]
    assert [opt.buffer_bytes(s)["error_feedback"] for s in range(3)] == [*sizes[:2], 0]

    state = opt.state_dict()
    copy, copy_stages, restored = three_stages(1.0)
    copy.load_state_dict(model.state_dict())
    restored.load_state_dict(state)
    grads = {s: [torch.randn_like(p) for p in stages[s]] for s in range(2)}
    for o, st in ((opt, stages), (restored, copy_stages)):
        o.record(3)
        for s in range(2):
            for p, g in zip(st[s], grads[s], strict=True):
                p.grad = g.clone()
            o.step(s, 3)
    for a, b in zip(model.parameters(), copy.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach())


def test_a_pipeline_with_error_feedback_trains():
    pipe, first, last = train_toy_pipeline(
        lambda ps: torch.optim.Adam(ps, lr=3e-3), PipeMareConfig(error_feedback=1.0)
    )
    assert last < 0.5 * first
    assert "error_feedback(c=1)" in pipe.optimizer.describe()
