"""Real models, cut into segments (pipemare.model.segments), through the engine: a resnet18
as torchvision writes it and a nanoGPT with its blocks in a ModuleList. gpipe reproduces
training on one device; the asynchronous schedule trains. A tie across stages (the GPT's
embedding = its head) is refused until ties are trained across stages (issue 23)."""

from __future__ import annotations

import copy

import pytest
import torch
from _real_models import GPT, GPTConfig, resnet18
from torch import nn

from pipemare import Pipeline
from pipemare.model.segments import segment_module

STEPS = 20


def _plain_losses(model: nn.Module, batch, loss_fn, lr: float, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*batch[0]), batch[1])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _piped_losses(model, batch, loss_fn, lr, steps, **options) -> list[float]:
    segments = segment_module(model, batch[0])
    pipe = Pipeline(segments, torch.optim.SGD(segments.parameters(), lr=lr), loss_fn, **options)
    losses = [float(pipe.step(batch)) for _ in range(steps)]
    pipe.drain()
    return losses


def _untied_gpt(dropout: float = 0.0) -> GPT:
    gpt = GPT(GPTConfig(dropout=dropout))
    gpt.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())
    return gpt


def _gpt_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, GPTConfig.vocab_size, (8, GPTConfig.block_size), generator=gen)
    return (idx, idx.roll(-1, dims=1)), None  # the model computes its own loss from targets


def _own_loss(out, _):
    return out[1]


@pytest.mark.parametrize("stages", [2, 4])
def test_a_resnet18_cut_at_its_blocks_trains_through_gpipe_as_on_one_device(stages):
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    gen = torch.Generator().manual_seed(1)
    batch = ((torch.randn(8, 3, 16, 16, generator=gen),), torch.randint(0, 10, (8,), generator=gen))
    ce = nn.functional.cross_entropy
    # N = 1: BatchNorm normalises over what it is given, so microbatches would change it
    want = _plain_losses(copy.deepcopy(model), batch, ce, 0.05, STEPS)
    got = _piped_losses(model, batch, ce, 0.05, STEPS, stages=stages, schedule="gpipe")
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert want[-1] < 0.5 * want[0]  # it trained


@pytest.mark.parametrize("stages", [2, 4])
def test_a_gpt_with_a_modulelist_of_blocks_trains_through_gpipe_as_on_one_device(stages):
    """Integer ids and the targets cross every cut (the loss is the model's own, computed on
    the last stage); 4 microbatches average to the whole batch's gradient."""
    torch.manual_seed(0)
    model = _untied_gpt()
    batch = _gpt_batch()
    want = _plain_losses(copy.deepcopy(model), batch, _own_loss, 0.5, STEPS)
    got = _piped_losses(
        model, batch, _own_loss, 0.5, STEPS, stages=stages, microbatches=4, schedule="gpipe"
    )
    assert got == pytest.approx(want, rel=1e-5)
    assert want[-1] < 0.8 * want[0]


def test_the_asynchronous_schedule_trains_a_gpt_cut_at_its_blocks():
    torch.manual_seed(0)
    model = _untied_gpt(dropout=0.1)
    batch = _gpt_batch()
    losses = _piped_losses(
        model, batch, _own_loss, 0.5, 2 * STEPS, stages=4, microbatches=4, schedule="pipemare"
    )
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_a_tie_across_stages_is_refused_until_ties_are_trained():
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0))  # its head's weight is its token embedding
    segments = segment_module(model, _gpt_batch()[0])
    assert segments.tied == [("transformer.wte.weight", [0, len(segments) - 1])]
    opt = torch.optim.SGD(segments.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"share the parameter .* tied weights"):
        Pipeline(segments, opt, _own_loss, stages=2, schedule="gpipe")


def test_the_planner_and_timed_balance_cut_a_segmented_resnet18():
    """Both choose a cut from measured times (so which cut varies with the machine's load);
    whatever they choose is a valid cut of the segments, and gpipe over it still trains as
    one device does."""
    from pipemare.model.partition import balance_by_time
    from pipemare.planner import auto_balance

    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    gen = torch.Generator().manual_seed(1)
    batch = ((torch.randn(8, 3, 16, 16, generator=gen),), torch.randint(0, 10, (8,), generator=gen))
    segments = segment_module(copy.deepcopy(model), batch[0])
    inputs = segments.flatten_inputs(*batch[0])
    timed = balance_by_time(segments, inputs, 4)
    planned = auto_balance(segments, inputs, stages=4, microbatches=2, repeats=2)
    for cut in (timed, planned):
        assert len(cut) == 4 and sum(cut) == len(segments) and min(cut) >= 1
    ce = nn.functional.cross_entropy
    want = _plain_losses(copy.deepcopy(model), batch, ce, 0.05, 5)
    got = _piped_losses(model, batch, ce, 0.05, 5, stages=4, schedule="gpipe", balance=planned)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
