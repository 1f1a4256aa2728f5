"""The optimiser wrapper: per-stage steps, T1, T2, T3, LR schedulers, state round-trips."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipemare import PipeMareConfig, PipeMareOptimizer, derive_delays
from pipemare.optim import corrections
from support.models import muon_adamw

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "nesterov": lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "muon": lambda p: muon_adamw(p, lr=1e-2),
}


def two_stage():
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    stages = {0: list(model[0].parameters()), 1: list(model[1].parameters())}
    return model, stages


def fill_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_stepping_stages_separately_equals_one_step(name):
    model, stages = two_stage()
    ref = copy.deepcopy(model)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    opt = PipeMareOptimizer(
        OPTIMIZERS[name](model.parameters()),
        stages,
        derive_delays("gpipe", 2, 1),
        PipeMareConfig.off(),
    )
    for k in range(4):
        fill_grads(model, k)
        fill_grads(ref, k)
        opt.record(k)
        opt.step(1, k)  # the last stage first, as in a pipeline
        assert all(p.grad is None for p in stages[1]) and all(p.grad is not None for p in stages[0])
        opt.step(0, k)
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_t1_scales_each_stage_lr_by_its_delay():
    model, stages = two_stage()
    delays = derive_delays("pipemare", 5, 1)[:2]  # the delays of stages 0, 1 of five: τ = 4, 3
    cfg = PipeMareConfig.t1_t2(discrepancy_correction=False, reschedule_steps=10)
    opt = PipeMareOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), stages, delays, cfg)
    for k in (0, 5, 10, 20):
        assert opt.effective_lr(0, k) == pytest.approx(0.5 * corrections.lr_factor(4.0, k, 10))
        assert opt.effective_lr(1, k) == pytest.approx(0.5 * corrections.lr_factor(3.0, k, 10))
    # and the step really uses it: plain SGD moves by lr * grad
    fill_grads(model, 0)
    before = model[0].weight.detach().clone()
    grad = model[0].weight.grad.clone()
    opt.record(0)
    opt.step(0, 0)
    torch.testing.assert_close(model[0].weight.detach(), before - 0.5 / 4 * grad)
    assert opt.param_groups[0]["lr"] == 0.5  # the user's value is left untouched


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_t1_uses_the_lr_recorded_when_the_minibatch_was_fed():
    model, stages = two_stage()
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda k: 0.5**k)
    delays = derive_delays("pipemare", 3, 1)[:2]  # τ = 2, 1
    opt = PipeMareOptimizer(
        sgd, stages, delays, PipeMareConfig.t1_t2(discrepancy_correction=False, reschedule_steps=4)
    )
    opt.record(0)
    sched.step()
    opt.record(1)
    sched.step()  # the user's LR is now 0.25, but minibatch 0's update must use 1.0
    fill_grads(model, 0)
    before, grad = model[0].weight.detach().clone(), model[0].weight.grad.clone()
    opt.step(0, 0)
    torch.testing.assert_close(
        model[0].weight.detach(), before - 1.0 * corrections.lr_factor(2.0, 0, 4) * grad
    )
    assert opt.effective_lr(0, 1) == pytest.approx(0.5 * corrections.lr_factor(2.0, 1, 4))


def test_t3_warmup_delays_t1_start():
    model, stages = two_stage()
    delays = derive_delays("pipemare", 5, 1)[:2]
    cfg = PipeMareConfig.t1_t2(discrepancy_correction=False, reschedule_steps=10, warmup_steps=3)
    opt = PipeMareOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), stages, delays, cfg)
    assert [opt.lr_factor(0, k) for k in range(3)] == [1.0, 1.0, 1.0]
    assert opt.lr_factor(0, 3) == pytest.approx(0.25)  # the asynchronous phase starts at 1/τ
    assert opt.lr_factor(0, 13) == 1.0


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_t2_velocity_follows_its_formula(name):
    model, stages = two_stage()
    delays = derive_delays("pipemare", 3, 1)[:2]  # Δ = 2, 1
    cfg = PipeMareConfig.t1_t2(lr_reschedule=False, discrepancy_decay=0.3)
    opt = PipeMareOptimizer(OPTIMIZERS[name](model.parameters()), stages, delays, cfg)
    gammas = [corrections.velocity_decay(2.0, 0.3), corrections.velocity_decay(1.0, 0.3)]
    ref = {p: torch.zeros_like(p) for p in model.parameters()}
    for k in range(5):
        fill_grads(model, k)
        opt.record(k)
        for stage in (1, 0):
            old = [p.detach().clone() for p in stages[stage]]
            opt.step(stage, k)
            for p, w_old in zip(stages[stage], old, strict=True):
                ref[p] = corrections.velocity_update(ref[p], w_old, p.detach(), gammas[stage])
    for p in model.parameters():
        torch.testing.assert_close(opt.velocity(p), ref[p], rtol=1e-4, atol=1e-6)
        assert ref[p].abs().max() > 1e-3  # the weights moved, so the check means something
    # the backward pass sees w - Δ δ
    w = stages[0][0]
    torch.testing.assert_close(opt.backward_weight(w, 2), w.detach() - 2 * opt.velocity(w))
    assert torch.equal(opt.backward_weight(w, 0), w.detach())


def test_t2_with_d_zero_extrapolates_the_last_step():
    model, stages = two_stage()
    delays = derive_delays("pipemare", 3, 1)[:2]
    cfg = PipeMareConfig.t1_t2(lr_reschedule=False, discrepancy_decay=0.0)
    opt = PipeMareOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stages, delays, cfg)
    w = stages[0][0]
    for k in range(2):
        fill_grads(model, k)
        before = w.detach().clone()
        opt.record(k)
        opt.step(0, k)
    torch.testing.assert_close(opt.velocity(w), w.detach() - before)


def test_t2_off_uses_live_weights():
    model, stages = two_stage()
    opt = PipeMareOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        stages,
        derive_delays("pipemare", 3, 1)[:2],
        PipeMareConfig.t1_t2(discrepancy_correction=False),
    )
    fill_grads(model, 0)
    opt.record(0)
    opt.step(0, 0)
    w = stages[0][0]
    assert opt.velocity(w) is None and torch.equal(opt.backward_weight(w, 3), w.detach())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_round_trip_resumes_exactly(name):
    delays = derive_delays("pipemare", 3, 1)[:2]
    cfg = PipeMareConfig.t1_t2(reschedule_steps=6, discrepancy_decay=0.2)

    def build(model):
        stages = {0: list(model[0].parameters()), 1: list(model[1].parameters())}
        return PipeMareOptimizer(OPTIMIZERS[name](model.parameters()), stages, delays, cfg)

    def run(model, opt, ks):
        for k in ks:
            opt.record(k)
            opt.record(k + 1)  # a pipeline feeds ahead: hyperparameters wait for later updates
            for stage in (1, 0):
                fill_grads(model, 100 * k + stage)
                opt.step(stage, k)

    model_a = two_stage()[0]
    model_b = copy.deepcopy(model_a)
    opt_a = build(model_a)
    run(model_a, opt_a, range(0, 6))
    opt_b_first = build(model_b)
    run(model_b, opt_b_first, range(0, 3))
    state = copy.deepcopy(opt_b_first.state_dict())
    assert len(state["buffers"]["discrepancy_correction"]) == 4 and state["hparams"]
    model_c = copy.deepcopy(model_b)
    opt_c = build(model_c)
    opt_c.load_state_dict(state)
    run(model_c, opt_c, range(3, 6))
    for a, c in zip(model_a.parameters(), model_c.parameters(), strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_rejects_what_it_cannot_do():
    model, stages = two_stage()
    with pytest.raises(TypeError, match="LBFGS re-evaluates the loss"):
        PipeMareOptimizer(
            torch.optim.LBFGS(model.parameters()), stages, derive_delays("async", 2, 1)
        )
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer"):
        PipeMareOptimizer(object(), stages, derive_delays("async", 2, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="discrepancy_decay must lie in"):
        PipeMareConfig.t1_t2(discrepancy_decay=1.5)
