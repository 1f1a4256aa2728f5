"""Frozen parameters (``requires_grad=False`` when the pipeline is built: a LoRA model's base,
BitFit's weights) are not training state: no optimiser state, no correction buffer, no weight
prediction, no stash or snapshot copy and no gradient, on every stage; activation gradients
still flow back through them. Everything here is read off the tensors the run holds."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pipemare import Pipeline, PipeMareConfig
from pipemare.engine.snapshot import Snapshot
from pipemare.experiments.studies.summary import memory_report

STAGES, WIDTH, STEPS = 4, 16, 6


def bitfit_model() -> nn.Sequential:
    """Four stages, each a Linear whose weight is frozen and whose bias trains (BitFit), and
    an embedding tied to the head across the first and last stage, frozen too."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, WIDTH)
    head = nn.Linear(WIDTH, 10, bias=False)
    head.weight = emb.weight
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(STAGES - 1)]
    model = nn.Sequential(emb, *layers, head)  # stage 3: the head alone, nothing to train
    for m in model.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            m.weight.requires_grad_(False)
    return model


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def batches():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 10, (STEPS, 8, 5), generator=gen)
    return [(xi, (xi + 1) % 10) for xi in x]


def frozen_and_trained(model):
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trained = [p for p in model.parameters() if p.requires_grad]
    return frozen, trained


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def run(schedule, config=None):
    model = bitfit_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # as users write it: AdamW over every parameter, the frozen ones included
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    pipe = Pipeline(
        model, opt, loss_fn, stages=STAGES, microbatches=2, schedule=schedule,
        balance=[2, 1, 1, 1], config=config,
    )  # fmt: skip
    data = batches()
    for batch in data[:-1]:
        pipe.step(batch)
    snap = Snapshot(pipe)
    pipe.step(data[-1])
    return model, before, pipe, snap


@pytest.mark.parametrize("schedule", ["pipemare", "pipedream", "async", "1f1b"])
def test_a_frozen_parameter_on_every_stage_holds_no_training_state(schedule):
    config = PipeMareConfig(weight_prediction=True) if schedule == "pipemare" else None
    model, before, pipe, snap = run(schedule, config)
    stages = pipe.stages
    assert all(any(not p.requires_grad for p in s.module.parameters()) for s in stages)
    # while the pipeline is running: weight prediction and snapshots leave frozen weights be
    for stage in stages:
        predicted = stage.predicted_weights(STEPS * 2)
        if predicted is not None:
            for p, q in zip(stage.module.parameters(), predicted, strict=True):
                assert (q.data_ptr() == p.data_ptr()) == (not p.requires_grad)
    pipe.drain()
    assert snap.complete
    for i, state in snap.module_state().items():
        live = dict(pipe.stage_modules[i].named_parameters())
        for key, value in state.items():
            p = live[key]
            assert (value.data_ptr() == p.data_ptr()) == (not p.requires_grad), key

    frozen, _ = frozen_and_trained(model)
    # frozen (every weight): unchanged bit for bit (AdamW's weight decay would move them),
    # and no gradient
    for key, value in model.state_dict().items():
        if key.endswith("weight"):
            torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)
    for stage in stages:
        assert all(p.grad is None for p in stage.module.parameters() if not p.requires_grad)
    # trained: every bias moved
    moved = [not torch.equal(p, before[k]) for k, p in model.named_parameters() if p.requires_grad]
    assert all(moved)
    # the optimiser's and the corrections' state: the trained parameters' only
    ids = {id(p) for p in frozen}
    assert not ids & {id(p) for p in pipe.optimizer.optimizer.state}
    for c in pipe.optimizer.corrections:
        assert not ids & {id(p) for p in c.buffers()}, c.name
    report = memory_report(SimpleNamespace(strategy=SimpleNamespace(pipeline=pipe)))
    mb = 2**-20
    for stage, row in zip(stages, report["stages"], strict=True):
        own = [p for p in stage.module.parameters() if p.requires_grad]
        assert row["trainable_mb"] == pytest.approx(nbytes(own) * mb)
        assert row["trainable_mb"] < row["weights_mb"]  # a frozen tensor on every stage
        # AdamW: two moments per trained number, and a step count per tensor
        assert row["optimizer_state_mb"] == pytest.approx((2 * nbytes(own) + 4 * len(own)) * mb)
        for name, size in row["corrections_mb"].items():  # per-weight buffers: sized by own
            assert size <= 2 * nbytes(own) * mb, name
        if schedule == "pipedream" and stage.index < STAGES - 1:  # of trained weights only
            assert 0 < row["stash_mb"] <= (STAGES + 1) * nbytes(own) * mb
            assert row["stash_mb"] / (nbytes(own) * mb) == stage.peak_stashed_versions
        else:
            assert row["stash_mb"] == 0


def test_gpipe_with_frozen_parameters_equals_one_device():
    """Activation gradients flow back through frozen stages: gpipe ends where one device does,
    the tied frozen embedding and head included."""
    model, _, pipe, _ = run("gpipe")
    pipe.drain()
    plain = bitfit_model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches():
        opt.zero_grad()
        loss_fn(plain(x), y).backward()
        opt.step()
    for (k, got), want in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=k)


def test_the_default_trains_the_biases_as_well_as_gpipe():
    """Frozen weights do not break the corrections: the default schedule's loss after the run
    is within a few percent of gpipe's."""
    losses = {}
    for schedule in ("gpipe", "pipemare"):
        model, _, pipe, _ = run(schedule)
        pipe.drain()
        x, y = batches()[0]
        with torch.no_grad():
            losses[schedule] = loss_fn(copy.deepcopy(model)(x), y).item()
    assert losses["pipemare"] <= 1.05 * losses["gpipe"]
