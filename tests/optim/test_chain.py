"""Several optimisers stepped as one (what a module under manual optimisation returns): the
chain's groups are the optimisers' own, stage steps touch only what a stage owns, its state
round-trips in torch's format, bad chains are refused, and the corrections read each group's
family from the optimiser that owns it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipemare import Pipeline, PipeMareConfig, PipeMareOptimizer, derive_delays
from pipemare.optim import ChainedOptimizer


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 3))


def muon_adamw(model):
    """torch's Muon on the first two matrices, AdamW on the rest: two optimisers."""
    hidden = [model[0].weight, model[2].weight]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=0.02)
    adamw = torch.optim.AdamW(rest, lr=1e-2)
    return muon, adamw


def data(steps=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))] * steps


def test_its_groups_are_the_optimisers_own_so_their_schedulers_drive_it():
    model = net()
    muon, adamw = muon_adamw(model)
    chain = ChainedOptimizer([muon, adamw])
    assert chain.param_groups[0] is muon.param_groups[0]
    assert chain.param_groups[1] is adamw.param_groups[0]
    torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5).step()
    assert chain.param_groups[1]["lr"] == pytest.approx(5e-3)
    assert chain.owner(chain.param_groups[0]) is muon
    assert chain.span(muon) == (0, 2) and chain.span(adamw) == (2, 4)


def test_a_gpipe_pipeline_steps_both_as_a_plain_loop_does():
    """Stage by stage, each optimiser steps only the parameters of that stage; after the
    minibatch every parameter has had exactly one update, as in a loop calling both steps."""
    model = net()
    ref = copy.deepcopy(model)
    pipe = Pipeline(
        model,
        ChainedOptimizer(muon_adamw(model)),
        nn.functional.cross_entropy,
        stages=3,
        schedule="gpipe",
    )
    plain = muon_adamw(ref)
    for x, y in data():
        pipe.step((x, y))
        for opt in plain:
            opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        for opt in plain:
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_its_state_round_trips_in_torchs_format():
    model = net()
    chain = ChainedOptimizer(muon_adamw(model))
    pipe = Pipeline(model, chain, nn.functional.cross_entropy, stages=3, schedule="gpipe")
    for batch in data(3):
        pipe.step(batch)
    assert pipe.optimizer.optimizer is chain
    saved = chain.state_dict()
    assert sorted(saved["state"]) == list(range(6))
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2, 3, 4, 5]]
    assert "momentum_buffer" in saved["state"][0] and "exp_avg" in saved["state"][2]
    fresh = ChainedOptimizer(muon_adamw(copy.deepcopy(model)))
    fresh.load_state_dict(saved)
    for mine, theirs in zip(fresh.optimizers, chain.optimizers, strict=True):
        a, b = mine.state_dict(), theirs.state_dict()
        assert a["param_groups"] == b["param_groups"]
        for i, state in b["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(a["state"][i][key], value)


def test_bad_chains_are_refused():
    model = net()
    muon, adamw = muon_adamw(model)
    with pytest.raises(ValueError, match="chains two optimisers or more, not 1"):
        ChainedOptimizer([muon])
    with pytest.raises(TypeError, match=r"chains torch\.optim optimisers, not Linear"):
        ChainedOptimizer([muon, model[0]])
    twice = torch.optim.SGD(model[4].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimisers 1 and 2 both hold a parameter of shape"):
        ChainedOptimizer([muon, adamw, twice])
    with pytest.raises(TypeError, match="add it to that optimiser"):
        ChainedOptimizer([muon, adamw]).add_param_group({"params": []})


def _corrections(optimizers, config):
    model = net()
    chain = ChainedOptimizer(optimizers(model))
    stages = {0: list(model[:2].parameters()), 1: list(model[2:].parameters())}
    wrapped = PipeMareOptimizer(chain, stages, derive_delays("pipemare", 2, 1), config)
    return {c.name: c for c in wrapped.corrections}, wrapped


def test_the_corrections_read_each_groups_family_from_its_own_optimiser():
    # the default keeps Muon's momentum (and the AdamW beside it), as for MuonAdamW
    names, _ = _corrections(muon_adamw, PipeMareConfig())
    assert "delay_momentum" not in names and "weight_prediction" in names
    # torch's Muon says "momentum" like SGD, but its buffer is an average: read from its type
    share = PipeMareConfig(delay_momentum=0.99, delay_momentum_rise="share")
    names, wrapped = _corrections(muon_adamw, share)
    assert names["delay_momentum"].adam_family
    assert wrapped.lr_factor(0, 10_000) == pytest.approx(1.0)
    assert wrapped.momentum(0, 10_000, group=0) == pytest.approx(0.99)  # Muon 0.95 -> 0.99
    assert wrapped.momentum(0, 10_000, group=1) == pytest.approx(0.99)  # AdamW 0.9 -> 0.99
    assert "spike_compensation" not in names  # it knows neither chain nor Muon

    def sgd_adamw(model):
        first = torch.optim.SGD(model[:2].parameters(), lr=0.1, momentum=0.9)
        return first, torch.optim.AdamW(model[2:].parameters(), lr=1e-3)

    # summed and averaged momentum in one run: the default stands aside, an explicit one refuses
    names, wrapped = _corrections(sgd_adamw, PipeMareConfig())
    assert "delay_momentum" not in names
    assert wrapped.momentum(0, 10_000, group=0) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="these optimisers mix both: switch it off"):
        _corrections(sgd_adamw, PipeMareConfig(delay_momentum=0.99))


# -- the same optimiser over a copy of the model (what the planner profiles) --------------------


def _muon_adamw_one(model):
    from pipemare.optim import MuonAdamW, muon_param_groups

    return MuonAdamW(muon_param_groups(model), lr=0.02)


@pytest.mark.parametrize(
    "build",
    [
        lambda m: ChainedOptimizer(muon_adamw(m)),
        _muon_adamw_one,
        lambda m: torch.optim.SGD(
            [{"params": m[0].parameters(), "lr": 0.05}, {"params": m[2:].parameters()}],
            lr=0.1,
            momentum=0.9,
        ),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.95)),
    ],
    ids=["chain", "muon-adamw", "sgd-groups", "adamw"],
)
def test_rebuild_makes_a_fresh_optimiser_that_steps_a_copy_as_the_original_steps_the_model(build):
    from pipemare.optim.chain import rebuild

    model = net()
    original = build(model)
    twin = copy.deepcopy(model)
    fresh = rebuild(original, list(model.parameters()), list(twin.parameters()))
    assert type(fresh) is type(original) and not fresh.state
    for x, y in data(3):
        for m, opt in ((model, original), (twin, fresh)):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_planner_profiles_a_chain_with_its_own_state():
    """Before rebuild, the planner profiled a chain with SGD(lr=0): no optimiser state at all."""
    from pipemare.optim.chain import copies_of
    from pipemare.planner import profile

    model = net()
    chain = ChainedOptimizer(muon_adamw(model))
    prof = profile(
        model,
        torch.randn(4, 6),
        optimizer=copies_of(chain, model.parameters()),  # as the strategy's planner does
        schedule="gpipe",  # no correction buffers: the state is the optimisers'
        repeats=1,
        rounds=1,
    )
    first = prof.layers[0][0]  # Linear(6, 8): Muon on its weight, AdamW on its bias
    muon, adamw = 8 * 6 * 4, 2 * 8 * 4  # a momentum buffer; exp_avg and exp_avg_sq
    assert muon + adamw <= first.state_bytes <= muon + adamw + 16  # + AdamW's step counter
    last = prof.layers[0][4]  # Linear(12, 3): AdamW on both
    assert 2 * (12 * 3 + 3) * 4 <= last.state_bytes <= 2 * (12 * 3 + 3) * 4 + 32
