"""A module cut again reuses an earlier cut's graphs where nothing the trace bakes in differs
(pipemare/model/traces.py), and computes with its own tensors; anything that changes the graph
gets a trace of its own; the kept graphs keep no model alive."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from typing import ClassVar

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from pipemare import PipeMareStrategy
from pipemare.model.segments import UncuttableModelError, segment_module
from pipemare.model.traces import TRACES, TraceStore
from support.models import quiet_trainer


class Net(nn.Module):
    """Blocks in a ModuleList, a Python float and a dropout rate the trace bakes in."""

    def __init__(self, width: int = 8, scale: float = 0.5, p: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.drop = nn.Dropout(p)
        self.scale = scale

    def forward(self, x: torch.Tensor, shift: int = 0) -> torch.Tensor:
        for block in self.blocks:
            x = self.drop(torch.tanh(block(x))) * self.scale + shift
        return x


def run(segments, *args, **kwargs):
    return segments(segments.flatten_inputs(*args, **kwargs))


@pytest.fixture(autouse=True)
def fresh():
    TRACES.clear()
    yield
    TRACES.clear()


def _same_as_eager(model: nn.Module, segments: nn.Module, x: torch.Tensor, **kwargs) -> None:
    for mode in (True, False):
        model.train(mode), segments.train(mode)
        want = model(x, **kwargs)
        got = run(segments, x, **kwargs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        (gw,) = torch.autograd.grad(want.sum(), model.blocks[0].weight)
        (gg,) = torch.autograd.grad(got.sum(), model.blocks[0].weight)
        torch.testing.assert_close(gg, gw, rtol=0, atol=0)


def test_a_copy_reuses_the_cut_and_computes_with_its_own_weights():
    torch.manual_seed(0)
    first = Net()
    x = torch.randn(4, 8)
    cut = segment_module(first, (x,))
    assert (TRACES.hits, TRACES.misses, len(TRACES)) == (0, 1, 1)

    second = copy.deepcopy(first)
    with torch.no_grad():
        for p in second.parameters():
            p.add_(torch.randn_like(p))
    again = segment_module(second, (torch.randn(6, 8),))  # another batch: the batch varies
    assert (TRACES.hits, TRACES.misses) == (1, 1)
    assert again[0]._programs is not cut[0]._programs
    assert again[0]._programs[True] is cut[0]._programs[True]  # the graphs, not traced again
    assert {id(p) for p in again.parameters()} == {id(p) for p in second.parameters()}
    _same_as_eager(second, again, torch.randn(5, 8))
    _same_as_eager(first, cut, torch.randn(5, 8))  # each reads its own module's weights

    # the kept graphs hold none of the traced module's tensors
    gone = weakref.ref(first.blocks[0].weight)
    del first, cut
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize(
    "change",
    [
        "a float attribute",
        "a dropout rate",
        "a width",
        "a dtype",
        "a baked argument",
        "a cut",
        "a tie",
    ],
)
def test_anything_the_trace_bakes_in_gets_a_trace_of_its_own(change):
    torch.manual_seed(0)
    base, x, kwargs, cuts = Net(), torch.randn(4, 8), {}, None
    if change == "a tie":  # traced as one input: the tied graphs would compute an untied copy
        base.blocks[2].weight = base.blocks[0].weight  # with block 0's weight in block 2
    segment_module(base, (x,))
    other = copy.deepcopy(base)
    if change == "a float attribute":
        other.scale = 2.0
    elif change == "a dropout rate":
        other.drop.p = 0.5
    elif change == "a width":
        other, x = Net(width=6), torch.randn(4, 6)
    elif change == "a dtype":
        other, x = other.double(), x.double()
    elif change == "a baked argument":
        kwargs = {"shift": 1}
    elif change == "a tie":
        other.blocks[2].weight = nn.Parameter(torch.randn_like(other.blocks[0].weight))
    else:
        cuts = ["blocks.2"]
    cut = segment_module(other, (x,), kwargs, split_points=cuts)
    assert (TRACES.hits, TRACES.misses) == (0, 2)
    if change != "a dropout rate":  # a rate above 0 draws its own mask in each
        _same_as_eager(other, cut, x, **kwargs)
    else:
        other.eval(), cut.eval()
        torch.testing.assert_close(run(cut, x), other(x), rtol=0, atol=0)


def test_a_module_with_a_hook_is_traced_each_time():
    """A hook can change what the forward computes: such a module is never keyed."""
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    net.blocks[1].register_forward_hook(lambda module, args, out: out * 3)
    segment_module(net, (x,))
    other = copy.deepcopy(net)
    cut = segment_module(other, (x,))
    assert (TRACES.hits, TRACES.misses, len(TRACES)) == (0, 0, 0)
    _same_as_eager(other, cut, x)


class FixedBatch(nn.Module):
    """A forward that fixes the batch size: its trace is static."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).reshape(4, 2, 2).sum(-1)


def test_a_static_trace_is_reused_only_for_its_sizes_and_warns_each_time():
    torch.manual_seed(0)
    net = FixedBatch()
    with pytest.warns(UserWarning, match="traced for the example batch's sizes only"):
        segment_module(net, (torch.randn(4, 4),))
    with pytest.warns(UserWarning, match="traced for the example batch's sizes only"):
        segment_module(copy.deepcopy(net), (torch.randn(4, 4),))  # reused: it warns again
    assert (TRACES.hits, TRACES.misses) == (1, 1)
    with warnings.catch_warnings(), pytest.raises(Exception):  # noqa: B017 - traced again
        warnings.simplefilter("ignore")
        segment_module(copy.deepcopy(net), (torch.randn(3, 4),))  # the forward's own error
    assert TRACES.hits == 1


def test_the_store_keeps_the_latest_traces():
    store = TraceStore(size=2)
    for key in "abc":
        store.put(key, key.upper())
    assert len(store) == 2 and store.get("a") is None and store.get("c") == "C"
    store.get("b")  # now the latest: "c" goes first
    store.put("d", "D")
    assert store.get("c") is None and store.get("b") == "B"


class GradBranch(Net):
    """A forward that computes otherwise without grad (as some check ``is_grad_enabled``)."""

    def forward(self, x: torch.Tensor, shift: int = 0) -> torch.Tensor:
        return super().forward(x, shift) * (2.0 if torch.is_grad_enabled() else 1.0)


class Tiny(pl.LightningModule):
    def __init__(self, net: type[Net] = Net) -> None:
        super().__init__()
        self.net = net(scale=1.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=gen), torch.zeros(32, 8))
    return torch.utils.data.DataLoader(data, batch_size=8)


def test_fit_then_validate_cuts_the_model_once_and_validates_the_trained_weights():
    """Each trainer call sets the strategy up again; the second reuses the first's cut."""
    torch.manual_seed(0)
    module = Tiny()
    strategy = PipeMareStrategy(stages=2, schedule="gpipe")
    trainer = quiet_trainer(strategy, max_steps=8)
    trainer.fit(module, _loader())
    assert (TRACES.hits, TRACES.misses) == (0, 1)
    (result,) = trainer.validate(module, _loader(), verbose=False)
    assert (TRACES.hits, TRACES.misses) == (1, 1)
    with torch.no_grad():
        want = torch.stack([nn.functional.mse_loss(module.net(x), y) for x, y in _loader()])
    assert result["val_loss"] == pytest.approx(want.mean().item(), rel=1e-5)


@pytest.mark.parametrize("net", [Net, GradBranch])
def test_validate_then_fit_trains_on_the_kept_cut_as_on_a_fresh_one(net):
    """A baseline validated before training: the cut made under validation's inference mode is
    the one fit reuses, and trains as a fresh cut does (gpipe: the same weights, bit for bit),
    also for a forward that branches on grad mode: a cut is always traced with grad on."""
    torch.manual_seed(0)
    first = Tiny(net)
    fresh = copy.deepcopy(first)
    strategy = PipeMareStrategy(stages=2, schedule="gpipe")
    trainer = quiet_trainer(strategy, max_steps=8)
    trainer.validate(first, _loader(), verbose=False)
    trainer.fit(first, _loader())
    assert (TRACES.hits, TRACES.misses) == (1, 1)

    TRACES.clear()
    quiet_trainer(PipeMareStrategy(stages=2, schedule="gpipe"), max_steps=8).fit(fresh, _loader())
    assert (TRACES.hits, TRACES.misses) == (0, 1)
    for (name, got), want in zip(first.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_a_model_built_on_meta_is_traced_once_whatever_of_it_is_real():
    """A model built on the meta device is traced there, every tensor on meta: a cut of it
    again (a stage process's validate after fit, its own stage now real) takes the same
    graphs, kept for the device the inputs came on, and computes with its real weights; the
    same architecture built with real weights has a trace of its own."""
    x = torch.randn(4, 8)
    with torch.device("meta"):
        built = Net()
    segment_module(built, (x,))
    assert (TRACES.hits, TRACES.misses) == (0, 1)

    torch.manual_seed(0)
    real = Net()
    for name in ("weight", "bias"):  # the first block made real, as its stage's process does
        setattr(built.blocks[0], name, getattr(real.blocks[0], name))
    cut = segment_module(built, (x,))
    assert (TRACES.hits, TRACES.misses) == (1, 1)
    # its first segment computes with the real block, as the stage's process runs it
    y = torch.randn(5, 8)
    (first,) = cut.flatten_inputs(y)
    (out,) = cut[0]((first,))
    torch.testing.assert_close(out, torch.tanh(real.blocks[0](y)) * real.scale)

    segment_module(real, (x,))  # built with real weights: a trace of its own
    assert (TRACES.hits, TRACES.misses) == (1, 2)


def _exports(monkeypatch) -> list[tuple[bool, int]]:
    """Each ``torch.export`` a cut makes from now on: its mode (True: train) and how many
    training batches had started by then (``_exports.batches``)."""
    from pipemare.model import segments

    made: list[tuple[bool, int]] = []
    real = segments.export_module

    def counted(module, args, kwargs=None, *, training=True, **options):
        made.append((training, len(_Batches.seen)))
        return real(module, args, kwargs, training=training, **options)

    monkeypatch.setattr(segments, "export_module", counted)
    _Batches.seen.clear()
    return made


class _Batches(pl.Callback):
    seen: ClassVar[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(batch_idx)


class EvalOnly(Net):
    """Reads a buffer in eval mode only: what the train graph does not read."""

    def __init__(self, scale: float = 0.5) -> None:
        super().__init__(scale=scale)
        self.register_buffer("offset", torch.full((8,), 0.25))

    def forward(self, x: torch.Tensor, shift: int = 0) -> torch.Tensor:
        x = super().forward(x, shift)
        return x if self.training else x + self.offset


def test_a_cut_for_training_only_traces_eval_mode_when_asked_and_keeps_it(monkeypatch):
    """``eval_graph=False`` exports the train graph alone; eval mode then refuses with what to
    do, and ``trace_eval`` traces it once: a copy made before shares the graph, a buffer only
    eval mode reads is registered, and a later cut of the module takes both from the kept
    trace, with no export."""
    made = _exports(monkeypatch)
    torch.manual_seed(0)
    net, x = EvalOnly(), torch.randn(4, 8)
    segments = segment_module(net, (x,), eval_graph=False)
    assert made == [(True, 0)] and not segments.has_eval_graph
    twin = copy.deepcopy(segments)
    segments.eval()
    with pytest.raises(RuntimeError, match=r"traced for training only .*\.trace_eval\(\)"):
        run(segments, x)
    segments.trace_eval()
    assert made == [(True, 0), (False, 0)] and segments.has_eval_graph
    net.eval()
    torch.testing.assert_close(run(segments, x), net(x), rtol=0, atol=0)
    segments.trace_eval()  # nothing left to trace
    again = segment_module(net, (x,))
    assert made == [(True, 0), (False, 0)] and (TRACES.hits, TRACES.misses) == (1, 1)
    again.eval()
    torch.testing.assert_close(run(again, x), net(x), rtol=0, atol=0)
    # the copy shares the eval graph, but holds no copy of the buffer only it reads
    twin.eval()
    with pytest.raises(RuntimeError, match=r"copied before its eval graph .* offset"):
        run(twin, x)


@pytest.mark.parametrize("validation", [False, True])
def test_a_fit_in_one_process_traces_eval_mode_at_the_cut_only_if_it_validates(
    validation, monkeypatch
):
    """The eval export costs about as much as the train one. A fit without validation skips
    it, and validate after the fit traces it before its first batch, and validates the trained
    weights; a fit that validates traces both at the cut (its first training batch), even with
    no sanity check: an eval graph that cannot be cut fails there, not an epoch later."""
    made = _exports(monkeypatch)
    torch.manual_seed(0)
    module = Tiny(EvalOnly)
    plain = copy.deepcopy(module)
    strategy = PipeMareStrategy(stages=2, schedule="gpipe")
    trainer = quiet_trainer(strategy, max_steps=8, num_sanity_val_steps=0, callbacks=[_Batches()])
    trainer.fit(module, _loader(), _loader() if validation else None)
    # the cut is made at the first training batch (the pipeline is built from it)
    assert made == ([(True, 1), (False, 1)] if validation else [(True, 1)])
    said = {d.subject: d for d in strategy.settings.decisions}["segments"].reason
    assert ("eval mode is traced when something first evaluates" in said) is not validation
    (result,) = trainer.validate(module, _loader(), verbose=False)
    assert made[-1] == (False, 1 if validation else 8) and len(made) == 2
    quiet_trainer("auto", max_steps=8).fit(plain, _loader())
    (want,) = quiet_trainer("auto").validate(plain, _loader(), verbose=False)
    assert result["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)


class SkipsInEval(Net):
    """Runs its middle block in train mode only: eval mode cannot be cut where train mode is."""

    def forward(self, x: torch.Tensor, shift: int = 0) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if self.training or i != 1:
                x = torch.tanh(block(x))
        return x


def test_an_eval_graph_that_cannot_be_cut_is_refused_when_it_is_traced():
    """Traced with the train graph, the refusal comes at the cut; deferred, the train graph
    trains and the refusal comes from trace_eval, before anything runs in eval mode."""
    net, x = SkipsInEval(), torch.randn(4, 8)
    with pytest.raises(UncuttableModelError, match=r"in eval mode: split point .blocks.1."):
        segment_module(net, (x,))
    TRACES.clear()
    segments = segment_module(net, (x,), eval_graph=False)
    run(segments, x).sum().backward()
    assert net.blocks[1].weight.grad is not None
    with pytest.raises(UncuttableModelError, match=r"in eval mode: split point .blocks.1."):
        segments.trace_eval()
    assert not segments.has_eval_graph
