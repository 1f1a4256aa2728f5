"""Activation recomputation: exact where weights do not move, its own semantics where they do,
and the memory it saves, measured against a single forward of each stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipemare import Pipeline, PipeMareConfig
from pipemare.optim import corrections
from support.models import sgd_pipeline


def mse(out, target):
    return ((out - target) ** 2).mean()


def batches(count, rows, features, outputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, features, generator=gen), torch.randn(rows, outputs, generator=gen))
        for _ in range(count)
    ]


# -- flushing schedules (and pipedream): recomputation changes nothing ------------------------


def noisy_model():
    """Dropout draws masks, BatchNorm keeps running statistics: both must survive a rerun."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 12),
        nn.BatchNorm1d(12),
        nn.Tanh(),
        nn.Dropout(0.3),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(12, 3),
    )


def train(schedule, recompute, seed=7, steps=6):
    model = noisy_model()
    pipe = Pipeline(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
        mse,
        stages=3,
        microbatches=2,
        schedule=schedule,
        balance=[4, 3, 1],
        seed=seed,
        recompute=recompute,
    )
    for batch in batches(steps, 8, 5, 3):
        pipe.step(batch)
    pipe.drain()
    return pipe, model.state_dict()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_recompute_is_exact_where_backward_weights_are_forward_weights(schedule):
    pipe, recomputed = train(schedule, recompute=True)
    _, saved = train(schedule, recompute=False)
    assert [s.recompute for s in pipe.stages] == [True, True, False]
    assert recomputed.keys() == saved.keys()  # weights and BatchNorm's running statistics
    for name, value in saved.items():
        torch.testing.assert_close(recomputed[name], value, rtol=1e-6, atol=1e-6, msg=name)
    assert int(recomputed["1.num_batches_tracked"]) == 6 * 2  # one per microbatch, not two
    # dropout matters here, so equal weights mean equal masks in the rerun
    _, other_masks = train(schedule, recompute=False, seed=8)
    assert not torch.allclose(other_masks["4.weight"], saved["4.weight"], atol=1e-4)


# -- non-flushing schedules: the rerun sees backward-time weights -----------------------------


def two_stage_model():
    """Stage 0: ``x -> tanh(W1 x + b1) -> W2 a + b2``; stage 1: ``y -> W3 y + b3``."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 2))


def stage0_gradient_of_update1(schedule, recompute):
    """P=2, N=1: stage 0 runs ``F0 F1 B0 U0 F2 B1 U1``, so its update 1 comes from a forward
    at version 0 and a backward at version 1. Returns that gradient, the weight versions
    0 and 1 of stage 0, stage 1's version 1 and the batches."""
    model = two_stage_model()
    w3, b3 = (p.detach().clone() for p in model[3].parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.3)
    log = []
    sgd.register_step_pre_hook(
        lambda opt, args, kwargs: log.append(
            {id(p): p.grad.clone() for g in opt.param_groups for p in g["params"]}
        )
    )
    cfg = (
        PipeMareConfig.t1_t2(lr_reschedule=False, discrepancy_decay=0.25)
        if schedule == "pipemare"
        else None
    )
    pipe = Pipeline(
        model,
        sgd,
        mse,
        stages=2,
        schedule=schedule,
        balance=[3, 1],
        config=cfg,
        recompute=recompute,
    )
    data = batches(3, 5, 3, 2)
    versions = [[p.detach().clone() for p in model[:3].parameters()]]
    for batch in data:
        pipe.step(batch)
        if pipe.stages[0].version == 1 and len(versions) == 1:
            versions.append([p.detach().clone() for p in model[:3].parameters()])
    pipe.drain()
    # updates alternate stage 1, stage 0 from stage 1: stage 0's update 1 is log[3]
    grad = [log[3][id(p)] for p in model[:3].parameters()]
    stage1 = (w3 - 0.3 * log[0][id(model[3].weight)], b3 - 0.3 * log[0][id(model[3].bias)])
    return grad, versions, stage1, data


def stage0_gradient(x, g, activation_weights, backward_weights):
    """Stage 0's gradient by hand: ``tanh`` evaluated at ``activation_weights``, the weight
    terms (``W2`` in ``dL/da``) at ``backward_weights``."""
    w1, b1, _, _ = activation_weights
    _, _, w2, _ = backward_weights
    a = torch.tanh(x @ w1.T + b1)
    d_h = (g @ w2) * (1 - a**2)
    return [d_h.T @ x, d_h.sum(0), g.T @ a, g.sum(0)]


@pytest.mark.parametrize("schedule", ["async", "pipemare", "pipedream"])
def test_delayed_rerun_uses_the_backward_weights_for_every_term(schedule):
    got, (fwd, live), (w3, b3), data = stage0_gradient_of_update1(schedule, recompute=True)
    x, t = data[1]
    # the forward (no graph) ran at version 0 and sent y downstream; stage 1 never reruns
    fw1, fb1, fw2, fb2 = fwd
    y = torch.tanh(x @ fw1.T + fb1) @ fw2.T + fb2
    out = y @ w3.T + b3
    g = (2 * (out - t) / out.numel()) @ w3  # the gradient arriving at stage 0's output

    if schedule == "async":
        bkwd = live
    elif schedule == "pipedream":
        bkwd = fwd  # the stashed forward version
    else:  # T2: after update 0 the velocity is (1 - γ)(w1 - w0), and Δ = 1
        gamma = corrections.velocity_decay(1.0, 0.25)
        bkwd = [w - (1 - gamma) * (w - w0) for w, w0 in zip(live, fwd, strict=True)]
    expected = stage0_gradient(x, g, bkwd, bkwd)  # activations and weights: backward-time
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    default = stage0_gradient(x, g, fwd, bkwd)  # what the saved-activation backward gives
    saved, *_ = stage0_gradient_of_update1(schedule, recompute=False)
    for a, b in zip(saved, default, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    gap = max(float((a - b).abs().max()) for a, b in zip(got, saved, strict=True))
    if schedule == "pipedream":
        assert gap == 0  # rerunning at the stashed version is PipeDream exactly
    else:
        assert gap > 1e-4  # the semantic difference is visible here


# -- memory ------------------------------------------------------------------------------------


def held_by_one_forward(module, x, keeps_input, loss=None):
    """Bytes a stage keeps for one microbatch's backward, measured with a plain forward:
    the storages autograd saves (parameters excluded), the input leaf if the stage returns
    its gradient, and the output."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def add(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = x.detach().requires_grad_(keeps_input)
    with torch.autograd.graph.saved_tensors_hooks(add, lambda t: t):
        out = module(x) if loss is None else loss(module(x))
    for t in ([x] if keeps_input else []) + [out]:
        add(t)
    return sum(seen.values())


@pytest.mark.parametrize("schedule", ["async", "pipemare"])
def test_stage_i_holds_p_minus_i_microbatches_or_only_their_inputs(schedule):
    stages, rows, width = 4, 6, 8

    def run(recompute):
        torch.manual_seed(0)
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(stages)]
        )
        pipe = Pipeline(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            mse,
            stages=stages,
            schedule=schedule,
            recompute=recompute,
            measure_saved=True,
        )
        data = batches(8, rows, width, width)
        for batch in data:
            pipe.step(batch)
        assert [s.in_flight for s in pipe.stages] == [3, 2, 1, 0]
        pipe.drain()
        assert [s.saved_bytes for s in pipe.stages] == [0] * stages
        return pipe, model, data[0][1]

    default, model, target = run(recompute=False)
    recomputed, _, _ = run(recompute=True)
    x = torch.randn(rows, width)
    input_bytes = x.numel() * x.element_size()
    for i, (plain, rerun) in enumerate(zip(default.stages, recomputed.stages, strict=True)):
        assert plain.peak_in_flight == rerun.peak_in_flight == stages - i
        last = i == stages - 1
        one = held_by_one_forward(
            model[i], x, keeps_input=i > 0, loss=(lambda y: mse(y, target)) if last else None
        )
        assert plain.peak_saved_bytes == (stages - i) * one
        if last:  # the last stage never reruns
            assert not rerun.recompute
            assert rerun.peak_saved_bytes == plain.peak_saved_bytes
        else:
            assert rerun.recompute
            assert rerun.peak_saved_bytes == (stages - i) * input_bytes
            assert one > input_bytes  # so recomputation holds less


def test_flushing_stage_measures_only_when_asked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    pipe = Pipeline(
        model, torch.optim.SGD(model.parameters(), lr=0.1), mse, stages=3, schedule="gpipe"
    )
    assert [s.measure_saved for s in pipe.stages] == [False] * 3  # no hook on gpipe's path
    for s in pipe.stages:
        s.measure_saved = True
    pipe.step((torch.randn(4, 4), torch.randn(4, 1)))
    # one microbatch at a time, as a single forward keeps it
    one = held_by_one_forward(model[0], torch.randn(4, 4), keeps_input=False)
    assert pipe.stages[0].peak_saved_bytes == one > 0
    assert all(s.saved_bytes == 0 for s in pipe.stages)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_recompute_must_be_a_bool(value):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with pytest.raises(ValueError, match="recompute must be True or False, got"):
        Pipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, recompute=value)


# -- CUDA --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_dropout_masks_replay_on_cuda():
    def run(recompute):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 2)).cuda()
        pipe = sgd_pipeline(
            model,
            mse,
            lr=0.1,
            stages=2,
            microbatches=2,
            schedule="1f1b",
            balance=[2, 1],
            recompute=recompute,
        )
        for x, t in batches(4, 8, 6, 2):
            pipe.step((x.cuda(), t.cuda()))
        pipe.drain()
        return [p.detach().cpu() for p in model.parameters()]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
