"""Real models, cut into segments (pipemare.model.segments), through the engine: a resnet18
as torchvision writes it and a nanoGPT with its blocks in a ModuleList. gpipe reproduces
training on one device; the asynchronous schedule trains. A tie across stages (the GPT's
embedding = its head) trains as on one device (pipemare.engine.ties)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipemare import Pipeline
from pipemare.engine.ties import tied_parameters
from pipemare.model.segments import segment_module
from support.real_models import GPT, GPTConfig, resnet18

# one worker runs the module: its tests cut the same models, which the process's kept traces
# (pipemare.model.traces.TRACES) then trace once, not once per worker
pytestmark = pytest.mark.xdist_group("engine_real_models")

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
    # these pipelines only train: the cuts here skip the eval-mode trace (eval_graph=False)
    segments = segment_module(model, batch[0], eval_graph=False)
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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_a_tie_across_stages_trains_as_on_one_device(stages, schedule):
    """The GPT's embedding is its head: the first and the last stage hold it. Its gradient is
    the sum of both stages' contributions, one update is applied, and the last stage's copy
    equals the owner's weights after the run."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0))
    batch = _gpt_batch()
    plain = copy.deepcopy(model)
    want = _plain_losses(plain, batch, _own_loss, 0.5, STEPS)
    segments = segment_module(model, batch[0], eval_graph=False)
    ((param, where),) = tied_parameters(list(segments))
    assert param is model.transformer.wte.weight and list(where) == [0, len(segments) - 1]
    opt = torch.optim.SGD(segments.parameters(), lr=0.5)
    pipe = Pipeline(segments, opt, _own_loss, stages=stages, microbatches=4, schedule=schedule)
    got = [float(pipe.step(batch)) for _ in range(STEPS)]
    pipe.drain()
    assert got == pytest.approx(want, rel=1e-5)
    (tie,) = pipe.ties.ties
    assert tie.stages == [0, stages - 1]
    ((_, twin),) = tie.copies.values()
    assert twin is not tie.param and torch.equal(twin, tie.param)
    assert model.lm_head.weight is model.transformer.wte.weight  # the user's tie is kept
    torch.testing.assert_close(model.lm_head.weight, plain.lm_head.weight, rtol=1e-5, atol=1e-6)


def _tied_gpt_pipeline():
    """The GPT with its head tied to its embedding, cut into segments, at P = 4, N = 4."""
    torch.manual_seed(0)
    segments = segment_module(GPT(GPTConfig(dropout=0.0)), _gpt_batch()[0], eval_graph=False)
    opt = torch.optim.SGD(segments.parameters(), lr=0.5)
    pipe = Pipeline(segments, opt, _own_loss, stages=4, microbatches=4, schedule="pipemare")
    return pipe, _gpt_batch()


def test_a_tied_head_runs_on_the_weights_the_owner_forwarded_with():
    """Asynchronous: no stage waits for the tie; the last stage's copy runs on the weights the
    owner forwarded the same microbatch with (so its delay is the owner's forward delay, not
    the last stage's zero), and draining brings it level with the owner's."""
    pipe, batch = _tied_gpt_pipeline()
    losses = [float(pipe.step(batch)) for _ in range(2 * STEPS)]
    (tie,) = pipe.ties.ties
    ((_, twin),) = tie.copies.values()
    assert pipe.ties.delay(tie, 3) == pytest.approx(pipe.delays[0].forward) == 0.75
    assert pipe.delays[3].forward == 0
    pipe.drain()
    assert not pipe.ties.stale(tie, 3) and torch.equal(twin, tie.param)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_a_plain_sequential_may_cut_between_tied_layers():
    """Input and output layer tied, as in a language model written as one Sequential."""
    torch.manual_seed(0)
    first, last = nn.Linear(6, 6), nn.Linear(6, 6)
    last.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), last)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    mse = nn.functional.mse_loss
    want = _plain_losses(copy.deepcopy(model), ((x,), y), mse, 0.1, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe = Pipeline(model, opt, mse, stages=3, microbatches=2, schedule="gpipe")
    got = [float(pipe.step((x, y))) for _ in range(10)]
    pipe.drain()
    assert got == pytest.approx(want, rel=1e-5)
    assert model[4].weight is model[0].weight  # the user's layers are untouched
    (tie,) = pipe.ties.ties
    model.eval()  # the copied head follows its original into eval mode, and back
    pipe.evaluate(x)
    assert [twin.training for twin, _ in tie.layers] == [False]
    model.train()
    pipe.step((x, y))
    assert [twin.training for twin, _ in tie.layers] == [True]


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
    segments = segment_module(copy.deepcopy(model), batch[0], eval_graph=False)
    inputs = segments.flatten_inputs(*batch[0])
    timed = balance_by_time(segments, inputs, 4)
    planned = auto_balance(segments, inputs, stages=4, microbatches=2, repeats=2)
    for cut in (timed, planned):
        assert len(cut) == 4 and sum(cut) == len(segments) and min(cut) >= 1
    ce = nn.functional.cross_entropy
    want = _plain_losses(copy.deepcopy(model), batch, ce, 0.05, 5)
    got = _piped_losses(model, batch, ce, 0.05, 5, stages=4, schedule="gpipe", balance=planned)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_tied_pipeline_restarted_from_its_state_resends_the_owners_weights():
    """After load_state_dict (a resume: weights may have been loaded into the model), every
    holder gets the owner's weights again, and the copy's delay counts from the restart."""
    pipe, batch = _tied_gpt_pipeline()
    for _ in range(3):
        pipe.step(batch)
    state = pipe.state_dict()
    (tie,) = pipe.ties.ties
    ((_, twin),) = tie.copies.values()
    with torch.no_grad():
        tie.param.add_(1.0)  # as a checkpoint loaded into the model would change it
    pipe.load_state_dict(state)
    pipe.drain()  # nothing ran since: the drain alone brings the copy level
    assert torch.equal(twin, tie.param)
    for _ in range(4):
        pipe.step(batch)
    assert pipe.ties.delay(tie, 3) == pytest.approx(0.75)
    pipe.drain()
    assert torch.equal(twin, tie.param)
