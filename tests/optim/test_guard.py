"""The delayed heavy-ball bound, the stability guard, and the default's stable step range against
uncorrected asynchrony for every optimiser family on the delayed quadratic."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

from pipemare import Pipeline, PipeMareConfig, PipeMareOptimizer, derive_delays
from pipemare.optim import MuonAdamW
from pipemare.optim.corrections import StabilityGuard
from pipemare.optim.settings import resolve
from pipemare.optim.stability import (
    _delayed_quadratic,
    delayed_gd_bound,
    delayed_momentum_bound,
    is_stable,
    largest_stable_step,
)

OFF = PipeMareConfig.off()
GUARD = dataclasses.replace(OFF, stability_guard=True)


def sgd(momentum: float = 0.0, nesterov: bool = False):
    return lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=nesterov)


@pytest.mark.parametrize("tau", [0, 1, 2, 5, 9])
def test_the_heavy_ball_bound_is_delayed_gds_without_momentum(tau):
    assert delayed_momentum_bound(tau, 0.0) == pytest.approx(delayed_gd_bound(tau), abs=1e-8)
    assert delayed_momentum_bound(0, 0.9) == pytest.approx(3.8, abs=1e-8)  # 2(1 + β)


@pytest.mark.parametrize(("tau", "beta"), [(1, 0.5), (4, 0.9), (8, 0.9)])
def test_torch_sgd_with_momentum_is_stable_up_to_the_roots_bound(tau, beta):
    measured = largest_stable_step(tau, OFF, sgd(beta), steps=1000)
    assert measured == pytest.approx(delayed_momentum_bound(tau, beta), rel=0.03)


def test_momentum_shrinks_the_delayed_range_about_as_one_minus_beta():
    # the step each gradient takes in total, α/(1 - β), keeps about delayed GD's range
    for tau in (1, 4, 16):
        total = delayed_momentum_bound(tau, 0.9) / (1 - 0.9)
        assert 0.75 * delayed_gd_bound(tau) < total <= delayed_gd_bound(tau) * 1.0001


@pytest.mark.parametrize("rate", [0.5, 0.9])
def test_the_guard_leaves_a_stable_run_exactly_as_it_was(rate):
    step = rate * delayed_momentum_bound(4, 0.9)
    assert _delayed_quadratic(step, 4, sgd(0.9), GUARD, 600) == _delayed_quadratic(
        step, 4, sgd(0.9), OFF, 600
    )


@pytest.mark.parametrize(("tau", "beta"), [(1, 0.9), (4, 0.9), (8, 0.5)])
def test_the_guard_stops_a_divergence_that_uncorrected_asynchrony_runs_into(tau, beta):
    """At twice the stable step the iteration grows by 3% or more per update: the guard halves
    the rate within its warm-up and a few updates, and keeps it bounded for as long as it runs
    (it doubles back, the growth resumes, it halves again). A slower growth (1.5 times the
    stable step with momentum 0.9: under 2% per update) stays below its threshold."""
    step = 2 * delayed_momentum_bound(tau, beta)
    for steps in (600, 1200):
        assert _delayed_quadratic(step, tau, sgd(beta), OFF, steps) > 1e7
        assert _delayed_quadratic(step, tau, sgd(beta), GUARD, steps) < 1e4


@pytest.mark.parametrize(("tau", "step"), [(1, 0.9), (2, 0.58)])
def test_the_guard_backs_off_a_correction_that_leaves_the_stable_range(tau, step):
    """Weight prediction forced on for plain SGD (``"auto"`` stands aside there) narrows the
    stable range from delayed GD's 1.0 and 0.62 to 0.62 and 0.37; in between, the prediction
    diverges where no correction would not, until the guard backs it off."""
    wp = dataclasses.replace(OFF, weight_prediction=True)
    assert largest_stable_step(tau, wp) < step < delayed_gd_bound(tau)
    assert _delayed_quadratic(step, tau, sgd(), OFF, 600) < 1e-3
    assert _delayed_quadratic(step, tau, sgd(), wp, 600) == math.inf
    guarded = dataclasses.replace(wp, stability_guard=True)
    assert _delayed_quadratic(step, tau, sgd(), guarded, 600) < 1e-3


OPTIMIZERS = {
    "sgd-momentum-0.5": sgd(0.5),
    "sgd-momentum-0.9": sgd(0.9),
    "nesterov-0.9": sgd(0.9, nesterov=True),
}
# Adam and AdamW are not here: on the one-weight quadratic their normalised step never grows
# (every rate up to the search's ceiling counts as stable, corrected or not), so the check
# could not fail; their family is compared on a network (tests/engine/test_fine_grain.py).
# Plain SGD is the one exception, below.


@pytest.mark.parametrize("tau", [1, 8])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_default_is_stable_wherever_uncorrected_asynchrony_is(name, tau):
    """The default ("auto": each correction where it applies, the guard) keeps at least the
    stable step range of no correction, for every momentum family it may meet; so does the
    default without its guard (the guard is a safety net, not what makes them safe).

    One bisection, two runs: the default contracts at the unguarded default's largest stable
    step (its range reaches at least as far), and no correction does not just past it."""
    make = OPTIMIZERS[name]
    unguarded = largest_stable_step(tau, PipeMareConfig(stability_guard=False), make, steps=600)
    assert is_stable(unguarded, tau, PipeMareConfig(), make, steps=600)
    assert not is_stable(unguarded + 2e-3, tau, OFF, make, steps=600)


def test_for_plain_sgd_the_default_trades_the_quadratics_range_for_consistent_weights():
    """Plain SGD gets local accumulation by default (it measured best on the networks: at every
    rate the protocol shared with async it trained better, and it never diverged where async
    did not, which the default without it did). On one quadratic that costs range per
    gradient: about 1/τ, against delayed GD's 2 sin(π/(4τ+2)); the exception is stated here."""
    plain = largest_stable_step(8, OFF, sgd(), steps=600)
    default = largest_stable_step(8, PipeMareConfig(), sgd(), steps=600)
    assert default == pytest.approx(1 / 8, rel=0.1) and default < plain
    assert largest_stable_step(1, PipeMareConfig(), sgd(), steps=600) >= 0.99  # τ = 1: k = 1


def two_stages():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    return model, {0: list(model[0].parameters()), 1: list(model[1].parameters())}


def test_the_guard_halves_on_a_runaway_recovers_and_its_state_travels_in_the_checkpoint():
    model, stages = two_stages()
    opt = PipeMareOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        stages,
        derive_delays("pipemare", 2, 1),
        dataclasses.replace(OFF, stability_guard=True),
    )
    (guard,) = opt.corrections
    assert isinstance(guard, StabilityGuard)

    def update(k, scale):
        opt.record(k)
        for p in stages[0]:
            p.grad = torch.full_like(p, scale)
        opt.step(0, k)

    for k in range(60):
        update(k, 1.0 + 0.5 * (k % 2))  # noisy but calm
    assert guard.factor(0) == 1.0 and opt.lr_factor(0, 60) == 1.0 and not guard.backoffs
    for k in range(60, 75):
        update(k, 1.3 ** (k - 59))  # a geometric runaway
    halvings = guard.backoffs[0]
    assert 1 <= halvings <= 4 and guard.factor(0) == 0.5**halvings
    assert opt.effective_lr(0, 75) == pytest.approx(0.1 * 0.5**halvings)
    assert guard.factor(1) == 1.0  # the other stage is not touched
    saved = opt.state_dict()
    model2 = copy.deepcopy(model)
    restored = PipeMareOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9),
        {0: list(model2[0].parameters()), 1: list(model2[1].parameters())},
        derive_delays("pipemare", 2, 1),
        dataclasses.replace(OFF, stability_guard=True),
    )
    restored.load_state_dict(saved)
    assert restored.corrections[0].factor(0) == 0.5**halvings
    assert restored.corrections[0].ratio(0) == pytest.approx(guard.ratio(0))
    for k in range(75, 75 + halvings * guard.recovery):
        update(k, 1.0)  # calm again: the factor doubles back every `recovery` updates
    assert guard.factor(0) == 1.0 and guard.backoffs[0] == halvings


def test_the_guard_weakens_the_corrections_it_backs_off():
    model, stages = two_stages()
    delays = derive_delays("pipemare", 2, 1)
    opt = PipeMareOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), stages, delays
    )
    assert opt.guard is not None
    before = opt.momentum(0, 1000)
    opt.guard._stage_state(0)[2] = 0.5  # as after one halving
    assert opt.momentum(0, 1000) == pytest.approx(0.5 + (before - 0.5) / 2)
    m = opt.momentum(0, 1000)
    # the guard's own 1/2, delay-aware momentum's SGD rate scaling, spike compensation's a at
    # half the delay (T1 is over by step 1000)
    expected = 0.5 * (1 - m) / (1 - 0.5) * m ** (delays[0].forward / 2)
    assert opt.lr_factor(0, 1000) == pytest.approx(expected)


def test_the_guard_reads_the_gradient_norms_the_engines_finite_check_took(monkeypatch):
    """Where the engine checks gradients for NaN and Inf it takes their norms; the guard reads
    those instead of a second pass, and keeps the same averages as when it takes its own."""
    foreach_norm, vector_norm = torch._foreach_norm, torch.linalg.vector_norm

    def run(check_finite: bool) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 3))
        pipe = Pipeline(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            nn.functional.mse_loss,
            stages=3,
            microbatches=3,
            check_finite=check_finite,
        )
        taken = []  # one entry per gradient whose norm is taken, by either of torch's calls

        def grads_in(tensors) -> int:
            return sum(any(t is p.grad for p in model.parameters()) for t in tensors)

        def foreach(ts, *a, **k):
            taken.append(grads_in(ts))
            return foreach_norm(ts, *a, **k)

        def single(t, *a, **k):
            taken.append(grads_in([t]))
            return vector_norm(t, *a, **k)

        with monkeypatch.context() as m:
            m.setattr(torch, "_foreach_norm", foreach)
            m.setattr(torch.linalg, "vector_norm", single)
            for _ in range(20):
                pipe.step((torch.randn(6, 6), torch.randn(6, 3)))
        guard = pipe.optimizer.guard
        assert guard is not None
        return [s.clone() for s in guard.state.values()], sum(taken)

    checked, passes = run(check_finite=True)
    unchecked, guard_passes = run(check_finite=False)
    assert guard_passes > 0 and passes == guard_passes  # one pass per update, not two
    assert len(checked) == 3 and all(s[3] > 0 for s in checked)  # every stage averaged norms
    for a, b in zip(checked, unchecked, strict=True):
        assert torch.equal(a, b)


def test_muon_adamw_runs_under_the_guard():
    model, stages = two_stages()
    groups = [
        {"params": [model[0].weight, model[1].weight], "use_muon": True},
        {"params": [model[0].bias, model[1].bias], "use_muon": False},
    ]
    with warnings.catch_warnings():  # "auto" stands aside quietly, saying why
        warnings.simplefilter("error")
        opt = PipeMareOptimizer(MuonAdamW(groups), stages, derive_delays("pipemare", 2, 1))
    assert opt.guard is not None and "stability_guard" in opt.describe()


def test_every_correction_says_which_optimisers_it_was_derived_for():
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    every = [
        c
        for config in (
            PipeMareConfig(discrepancy_correction=True, weight_prediction=False, warmup_steps=1),
            PipeMareConfig(local_accumulation=1),
            PipeMareConfig(),
        )
        for c in resolve(config, sgd, stages=2).build()
    ]
    names = {c.name for c in every}
    assert len(names) == 7
    assert all(len(c.derived_for) > 20 for c in every)
