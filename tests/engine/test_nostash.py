"""No-stash semantics on a 2-stage model against hand-computed gradients.

Stage 0 is ``x -> tanh(W1 x + b1) -> W2 a + b2``; stage 1 is ``y -> W3 y + b3`` with a
mean-squared-error loss. With P=2, N=1 stage 0 runs ``F0 F1 B0 U0 F2 B1 U1``: the gradient of
its update 1 comes from a forward at version 0 and a backward at version 1.
"""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
from torch import nn

from pipemare import Pipeline, PipeMareConfig
from pipemare.optim import corrections


def mse(out, target):
    return ((out - target) ** 2).mean()


def build():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 2))


def record_grads(optimizer, log):
    def hook(opt, args, kwargs):
        log.append({id(p): p.grad.clone() for g in opt.param_groups for p in g["params"]})

    optimizer.register_step_pre_hook(hook)


@pytest.mark.parametrize("schedule", ["async", "pipedream", "pipemare"])
def test_delayed_gradient_mixes_forward_activations_and_backward_weights(schedule):
    model = build()
    *_, w3, b3 = (p.detach().clone() for p in model.parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.3)
    log, versions = [], []
    record_grads(sgd, log)
    cfg = (
        PipeMareConfig.t1_t2(lr_reschedule=False, discrepancy_decay=0.25)
        if schedule == "pipemare"
        else None
    )
    pipe = Pipeline(
        model, sgd, mse, stages=2, microbatches=1, schedule=schedule, balance=[3, 1], config=cfg
    )
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(5, 3, generator=gen), torch.randn(5, 2, generator=gen)) for _ in range(3)
    ]

    snap = lambda: [p.detach().clone() for p in model[:3].parameters()]  # noqa: E731
    versions.append(snap())
    stage0_updates = 0
    for batch in batches:
        pipe.step(batch)
        while stage0_updates < pipe.stages[0].version:
            versions.append(snap())
            stage0_updates += 1
    pipe.drain()

    # Updates alternate stage 1, stage 0, starting with stage 1: stage 0's update k is log[2k+1].
    got = log[2 * 1 + 1]
    assert set(got) == {id(p) for p in model[:3].parameters()}

    x, t = batches[1]
    fw1, fb1, fw2, fb2 = versions[0]  # forward of minibatch 1 ran with version 0
    _, _, bw2, _ = versions[1]  # its backward runs after update 0
    # stage 1 is never delayed: it saw version 1 of W3 in both passes
    w3_1 = w3 - 0.3 * log[0][id(model[3].weight)]
    b3_1 = b3 - 0.3 * log[0][id(model[3].bias)]
    h = x @ fw1.T + fb1
    a = torch.tanh(h)
    y = a @ fw2.T + fb2
    out = y @ w3_1.T + b3_1
    d_out = 2 * (out - t) / out.numel()
    g = d_out @ w3_1  # gradient arriving at stage 0's output

    if schedule == "pipedream":
        w2_bkwd = fw2  # the stashed forward version
    elif schedule == "async":
        w2_bkwd = bw2  # the live weights
    else:  # T2: live weights minus Δ times the velocity after update 0
        gamma = corrections.velocity_decay(1.0, 0.25)
        velocity = (1 - gamma) * (bw2 - fw2)
        w2_bkwd = bw2 - 1.0 * velocity
    d_a = g @ w2_bkwd
    d_h = d_a * (1 - a**2)  # activations from the forward pass
    expected = {
        id(model[0].weight): d_h.T @ x,
        id(model[0].bias): d_h.sum(0),
        id(model[2].weight): g.T @ a,
        id(model[2].bias): g.sum(0),
    }
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    # the three policies really differ on this example
    assert not torch.allclose(bw2, fw2)


def four_stages_after_six_steps(schedule):
    """The model cut into 4 stages of ``schedule``, not drained after six steps."""
    model = build()
    pipe = Pipeline(
        model, torch.optim.SGD(model.parameters(), lr=0.1), mse, stages=4, schedule=schedule
    )
    for _ in range(6):
        pipe.step((torch.randn(4, 3), torch.randn(4, 2)))
    return pipe


def test_no_weight_copies_without_stashing():
    pipe = four_stages_after_six_steps("async")
    assert [s.peak_stashed_versions for s in pipe.stages] == [0, 0, 0, 0]
    assert [s.in_flight for s in pipe.stages] == [3, 2, 1, 0]  # stays full between steps


def test_pipedream_stashes_one_copy_per_version_in_flight():
    pipe = four_stages_after_six_steps("pipedream")
    # stage i keeps s = 3 - i older versions alive while their microbatches are in flight
    assert [s.peak_stashed_versions for s in pipe.stages] == [3, 2, 1, 0]
    pipe.drain()
    assert [s.stashed_versions for s in pipe.stages] == [0, 0, 0, 0]


def descend_on_delayed_weights(model, batches, lr, microbatches, delay):
    """SGD where the gradient of microbatch ``r`` of minibatch ``k`` is taken at stage ``i``'s
    weights ``delay(i, r)`` updates old (clamped to version 0): the model of a pipeline."""
    history = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for k, (x, t) in enumerate(batches):
        grads = {n: torch.zeros_like(w) for n, w in history[0].items()}
        for r, (xr, tr) in enumerate(
            zip(x.chunk(microbatches), t.chunk(microbatches), strict=True)
        ):
            weights = {
                n: history[max(0, k - delay(int(n.split(".")[0]), r))][n].clone().requires_grad_()
                for n in history[0]
            }
            out = torch.func.functional_call(model, weights, (xr,))
            for n, g in zip(
                weights, torch.autograd.grad(mse(out, tr), list(weights.values())), strict=True
            ):
                grads[n] += g / microbatches
        history.append({n: history[k][n] - lr * grads[n] for n in grads})
    return history[-1]


@pytest.mark.parametrize(("stages", "microbatches"), [(4, 1), (8, 1), (8, 2), (5, 3)])
def test_pipedream_equals_gradient_descent_on_delayed_weights(stages, microbatches):
    """Over many stages and steps, fill included, PipeDream (exact stale gradients) takes the
    steps a direct computation takes: microbatch ``r`` sees stage ``i``'s weights
    ``ceil((P-1-i-r)/N)`` updates old (version 0 while the pipeline fills)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(stages)])
    model = model.double()
    reference = copy.deepcopy(model)
    lr, rows = 0.2, 4 * microbatches
    gen = torch.Generator().manual_seed(1)
    batches = [
        tuple(torch.randn(rows, 6, generator=gen, dtype=torch.float64) for _ in range(2))
        for _ in range(12)
    ]
    pipe = Pipeline(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        mse,
        stages=stages,
        microbatches=microbatches,
        schedule="pipedream",
    )
    for batch in batches:
        pipe.step(batch)
    pipe.drain()

    def delay(i, r):
        return max(0, math.ceil((stages - 1 - i - r) / microbatches))

    expected = descend_on_delayed_weights(reference, batches, lr, microbatches, delay)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-10, atol=1e-12)
    # the delays mattered: synchronous descent ends elsewhere
    synchronous = descend_on_delayed_weights(reference, batches, lr, microbatches, lambda i, r: 0)
    init = dict(reference.named_parameters())
    moved = sum(((synchronous[n] - init[n]) ** 2).sum() for n in init) ** 0.5
    gap = sum(((p - synchronous[n]) ** 2).sum() for n, p in model.named_parameters()) ** 0.5
    assert gap > 0.01 * moved


@pytest.mark.parametrize("op", [torch.exp, torch.tanh, torch.sigmoid])
def test_a_graph_never_run_backward_is_freed(op):
    """Ops that save their own output (exp, tanh, sigmoid) under the stage's hooks: a graph
    nobody runs backward (a metric's step value) must die with its last reference, not live
    on in a cycle through autograd that the collector cannot see."""
    from pipemare.engine.memory import Held
    from pipemare.engine.nostash import SavedTensors

    layer = nn.Linear(3, 3)
    params = {id(p): p for p in layer.parameters()}
    saved = SavedTensors(params, {}, lambda p, version: p.detach())
    for held in (None, Held()):
        with saved.hooks(version=0, track=True, held=held):
            out = op(layer(torch.randn(4, 3)))
        alive = weakref.ref(out)
        del out
        gc.collect()
        assert alive() is None


def _four_stages(schedule, measure_saved, steps=8):
    """Four stages under Adam (so ``pipemare``'s default predicts weights), not drained."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)], nn.Linear(6, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pipe = Pipeline(
        model, opt, mse, stages=4, microbatches=2, schedule=schedule, measure_saved=measure_saved
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        pipe.step((torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)))
    return pipe, model


@pytest.mark.parametrize("schedule", ["async", "pipemare"])
def test_live_weight_stages_train_without_hooks_exactly_as_with_them(schedule):
    """Where the backward takes the live weights, autograd saves the parameters itself and the
    engine keeps their versions across its own writes (the update; weight prediction's move
    and undo): the weights come out bit for bit as under the saved-tensor hooks."""
    hooked, want = _four_stages(schedule, measure_saved=True)
    bare, got = _four_stages(schedule, measure_saved=None)
    hooked.drain()
    bare.drain()
    assert [s.by_version for s in bare.stages] == [True] * 4
    assert bare.settings.predicts == (schedule == "pipemare")
    assert all(s.peak_saved_bytes > 0 for s in hooked.stages)
    assert all(s.peak_saved_bytes == 0 for s in bare.stages)  # no hook ran to count
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_stray_in_place_write_to_a_saved_weight_is_still_refused():
    """Only the engine's own writes keep the versions: anything else that changes a weight a
    microbatch in flight saved meets autograd's own error at that microbatch's backward."""
    pipe, model = _four_stages("pipemare", measure_saved=None, steps=2)
    assert pipe.balance[0] == 2 and pipe.stages[0].in_flight > 0
    with torch.no_grad():  # stage 0's second layer: the first saves no weight (its input is data)
        model[1][0].weight.mul_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pipe.step((torch.randn(8, 6), torch.randn(8, 2)))


def test_stages_that_stash_or_correct_the_backward_keep_the_hooks():
    """T2's backward weights and pipedream's stashed versions are not the live ones: those
    stages save parameters through the hooks, which count the bytes held as they go."""
    model = build()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    t2 = Pipeline(model, sgd, mse, stages=2, schedule="pipemare", config=PipeMareConfig.t1_t2())
    other = copy.deepcopy(model)
    stash = Pipeline(
        other, torch.optim.SGD(other.parameters(), lr=0.1), mse, stages=2, schedule="pipedream"
    )
    for pipe in (t2, stash):
        assert [(s.by_version, s.measure_saved) for s in pipe.stages] == [(False, True)] * 2
