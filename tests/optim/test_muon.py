"""Muon + AdamW as one optimiser: each kind steps as torch's own optimiser does, the groups split
a model as the speedrun recipe does, bad groups are refused, and the corrections read both
kinds' momentum as an average."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from pipemare import PipeMareConfig, PipeMareOptimizer, derive_delays
from pipemare.optim import MuonAdamW, muon_param_groups
from pipemare.optim.muon import orthogonalize


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 12), nn.Linear(12, 3))


def grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_the_groups_give_muon_the_hidden_matrices_and_adamw_the_rest():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

    model = net()
    muon, rest = muon_param_groups(model, weight_decay=0.1)
    assert muon["use_muon"] and not rest["use_muon"] and muon["weight_decay"] == 0.1
    assert [id(p) for p in muon["params"]] == [id(model[0].weight), id(model[2].weight)]
    assert len(rest["params"]) == 6  # biases, the norm, the head
    tied = Tied()
    muon, rest = muon_param_groups(tied)
    assert [id(p) for p in muon["params"]] == [id(tied.body.weight)]  # not the tied head
    muon, _ = muon_param_groups(model, exclude=["0.weight"])
    assert [id(p) for p in muon["params"]] == [id(model[2].weight)]


def test_adamw_groups_step_exactly_as_torch_adamw():
    a, b = net(), net()
    ours = MuonAdamW([{"params": a.parameters(), "use_muon": False}], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    for k in range(4):
        grads(a, k), grads(b, k)
        ours.step(), ref.step()
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_muon_groups_step_as_torch_muon_up_to_its_bfloat16_orthogonalisation():
    a, b = net(), net()
    mats = [0, 2, 3]
    ours = MuonAdamW(
        [{"params": [a[i].weight for i in mats], "use_muon": True}],
        lr=1e-2,
        weight_decay=0.1,
        adjust_lr="original",
    )
    ref = torch.optim.Muon([b[i].weight for i in mats], lr=1e-2, weight_decay=0.1)
    start = [b[i].weight.detach().clone() for i in mats]
    for k in range(3):
        grads(a, k), grads(b, k)
        ours.step(), ref.step()
    for i, w0 in zip(mats, start, strict=True):
        moved = (b[i].weight.detach() - w0).abs().max()
        assert moved > 1e-2
        # torch orthogonalises in bfloat16 (8 bits of mantissa), we in float32
        torch.testing.assert_close(a[i].weight, b[i].weight, rtol=0, atol=0.05 * float(moved))


def test_orthogonalisation_flattens_the_spectrum_and_the_rms_matches_adamw():
    g = torch.randn(64, 16) @ torch.diag(torch.logspace(-0.5, 1, 16))  # condition ~30
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.min() > 0.5 and s.max() < 1.3
    model = nn.Linear(16, 64, bias=False)
    w0 = model.weight.detach().clone()
    opt = MuonAdamW([{"params": [model.weight], "use_muon": True}], lr=1e-3)
    model.weight.grad = g
    opt.step()
    rms = float((model.weight.detach() - w0).pow(2).mean().sqrt())
    assert 0.1e-3 < rms < 0.35e-3  # Moonlight's scaling: about 0.2 lr, AdamW's typical RMS


def test_groups_that_do_not_say_their_kind_or_give_muon_a_vector_are_refused():
    model = net()
    with pytest.raises(ValueError, match="muon_param_groups"):
        MuonAdamW(model.parameters())
    with pytest.raises(ValueError, match=r"2-D weight matrices only.*\(8,\)"):
        MuonAdamW([{"params": [model[0].weight, model[0].bias], "use_muon": True}])
    with pytest.raises(ValueError, match="adjust_lr"):
        MuonAdamW([{"params": [model[0].weight], "use_muon": True}], adjust_lr="rms")


def test_the_default_corrections_read_both_kinds_momentum_as_an_average():
    model = net()
    stages = {0: list(model[:2].parameters()), 1: list(model[2:].parameters())}
    delays = derive_delays("pipemare", 2, 1)
    with warnings.catch_warnings():  # "auto" stands aside quietly, saying why
        warnings.simplefilter("error")
        default = PipeMareOptimizer(MuonAdamW(muon_param_groups(model), lr=1e-2), stages, delays)
    names = {c.name: c for c in default.corrections}
    # the default keeps Muon's momentum (measured better) and predicts its weights
    assert "delay_momentum" not in names and "weight_prediction" in names
    assert "spike_compensation" not in names
    assert "delay_momentum" not in default.describe()
    decided = {d.subject: d for d in default.settings.decisions}
    assert "Muon" in decided["delay_momentum"].reason
    assert "MuonAdamW" in decided["spike_compensation"].reason
    # asked for by value, delay-aware momentum raises both kinds as the averages they are
    opt = MuonAdamW(muon_param_groups(model), lr=1e-2)
    share = PipeMareConfig(delay_momentum=0.99, delay_momentum_rise="share")
    wrapped = PipeMareOptimizer(opt, stages, delays, share)
    # an average keeps its step size: no rate scaling, only the momenta rise with the delay
    assert wrapped.lr_factor(0, 10_000) == pytest.approx(1.0)
    assert wrapped.momentum(0, 10_000, group=0) == pytest.approx(0.99)  # Muon: 0.95 -> 0.99
    assert wrapped.momentum(0, 10_000, group=1) == pytest.approx(0.99)  # AdamW: β1 0.9 -> 0.99
    assert wrapped.momentum(1, 10_000, group=0) == pytest.approx(0.95)  # no delay: the user's
    ref = copy.deepcopy(model)
    for k in range(3):
        wrapped.record(k)
        for stage in (1, 0):
            grads(model, 10 * k + stage)
            wrapped.step(stage, k)
    pairs = zip(model.parameters(), ref.parameters(), strict=True)
    assert all(not torch.equal(p, q) for p, q in pairs)
    assert opt.param_groups[0]["momentum"] == 0.95  # the user's settings are put back
