"""Compiled stages: ``PipeMareStrategy(compile=...)``, or the user's own ``torch.compile``.

Each stage's forward is compiled (AOTAutograd below the backend, as inductor has it); the
no-stash backward must hold under the compiled graph: the parameters it saves are still saved
by reference, so the asynchronous schedules keep one weight version. The ``aot_eager`` backend
runs the same operators as eager mode, so its runs must match eager ones to the last bit of
float32 rounding; inductor (the default) runs on the GPT-2 of the zoo step.
"""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F

from pipemare import PipeMareStrategy
from support.models import quiet_trainer, three_class_points


class Net(pl.LightningModule):
    """A module written for one device, with a LayerNorm (its weight is saved for the
    backward) and a GELU."""

    def __init__(self, compile_net: str | None = None):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(5, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(),
            nn.Linear(32, 3),
        )  # fmt: skip
        if compile_net == "torch.compile":  # as users write it
            self.net = torch.compile(self.net, backend="aot_eager")
        elif compile_net == "in place":
            self.net.compile(backend="aot_eager")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


class Counting:
    """A torch.compile backend: AOTAutograd with eager kernels, counting the graphs it gets."""

    def __init__(self):
        self.graphs = 0
        self._aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self._aot_eager(gm, example_inputs)


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


def fit(module, schedule, steps=12, **options):
    strategy = PipeMareStrategy(
        stages=3, microbatches=3, schedule=schedule, balance=[2, 2, 2], **options
    )
    trainer = quiet_trainer(strategy, max_steps=steps)
    trainer.fit(module, three_class_points(96, 12))
    return strategy


@pytest.mark.parametrize("schedule", ["gpipe", "pipemare", "async", "pipedream"])
def test_compiled_stages_train_as_eager_ones_and_keep_one_weight_version(schedule, caplog):
    pl.seed_everything(0)
    base = Net()
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    plain = fit(eager, schedule, measure_activations=True)
    torch._dynamo.reset()  # no graph cached by an earlier test: each stage compiles here
    backend = Counting()
    strategy = fit(compiled, schedule, compile={"backend": backend}, measure_activations=True)
    assert backend.graphs >= 3  # a graph per stage at least: the stages ran compiled
    for a, b in zip(weights(compiled), weights(eager), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    stages, before = strategy.pipeline.stages, plain.pipeline.stages
    # the activations the compiled graphs save are the eager ones; the weights are not copied
    assert [s.peak_saved_bytes for s in stages] == [s.peak_saved_bytes for s in before]
    copies = [s.peak_stashed_versions for s in stages]
    assert copies == [s.peak_stashed_versions for s in before]
    if schedule != "pipedream":  # only PipeDream stashes (copy on write)
        assert copies == [0, 0, 0]
    assert "compile: each stage's forward, torch.compile with backend=" in caplog.text


@pytest.mark.parametrize(
    ("how", "said"),
    [("torch.compile", "torch.compile(...)"), ("in place", "Net.net.compile()")],
)
def test_a_module_the_user_compiled_is_compiled_stage_by_stage(how, said, caplog):
    """``self.net = torch.compile(net)`` or ``self.net.compile()``: a compiled whole cannot be
    cut, so each stage is compiled instead (the wrapper removed), said at setup, and it trains
    as the uncompiled module under gpipe."""
    pl.seed_everything(0)
    base = Net()
    eager, compiled = copy.deepcopy(base), Net(compile_net=how)
    inner = getattr(compiled.net, "_orig_mod", compiled.net)
    inner.load_state_dict(base.net.state_dict())
    fit(eager, "gpipe")
    strategy = fit(compiled, "gpipe")
    assert isinstance(compiled.net, nn.Sequential)  # unwrapped: its state dict has plain names
    assert set(compiled.state_dict()) == set(eager.state_dict())
    for a, b in zip(weights(compiled), weights(eager), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(s._call is not s.module for s in strategy.pipeline.stages)
    assert f"Net.net was passed through {said}; a compiled whole cannot be cut" in caplog.text
    assert "compile: each stage's forward, torch.compile with its defaults" in caplog.text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("yes", r"compile must be True, False or a dict of torch.compile's options \(backend, "),
        ({"backend": "eager", "graphs": 2}, r"'graphs' is not one of them"),
    ],
)
def test_a_bad_compile_value_is_refused_at_construction(value, message):
    with pytest.raises(ValueError, match=message):
        PipeMareStrategy(compile=value)


@pytest.fixture
def inductor_in_process():
    """Inductor compiles its C++ in this process, not in a pool of compile workers: on CI's
    two cores, beside the other pytest worker, the pool's processes (each importing torch)
    only add their start to the compile's time; the kernels are the same."""
    import torch._inductor.config

    with torch._inductor.config.patch(compile_threads=1):
        yield


@pytest.mark.zoo
def test_a_gpt2_cut_into_segments_compiles_with_inductor(inductor_in_process):
    """torch.compile's defaults (inductor) on the exported segments of a Hugging Face GPT-2:
    gpipe ends with one device's held-out loss, and the default schedule where its eager run
    ends, saving no more than it and making no weight copies."""
    pytest.importorskip("transformers")
    from support.real_runs import val_loss
    from support.zoo import ZooModule, data

    def fit(module, strategy):
        quiet_trainer(strategy, max_steps=10).fit(module, data(module.kind))
        return strategy

    def val(module):
        return val_loss(module, data(module.kind, n=64, seed=1))

    base = ZooModule("gpt2")
    one, gpipe = copy.deepcopy(base), copy.deepcopy(base)
    fit(one, "auto")
    # the cut and N of the default's runs below (an even cut: no timing pass before it)
    even = dict(stages=2, microbatches=2, balance="even", compile=True)
    fit(gpipe, PipeMareStrategy(schedule="gpipe", **even))
    assert val(gpipe) == pytest.approx(val(one), rel=1e-4)
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    plain = fit(eager, PipeMareStrategy(stages=2, balance="even", measure_activations=True))
    strategy = fit(compiled, PipeMareStrategy(stages=2, balance="even", compile=True))
    assert val(compiled) == pytest.approx(val(eager), rel=1e-4)
    stages, before = strategy.pipeline.stages, plain.pipeline.stages
    assert [s.peak_stashed_versions for s in stages] == [0, 0]
    # inductor's partitioner saves less than eager autograd (it recomputes cheap operators);
    # a weight saved by value would be counted here, parameters saved by reference are not
    for s, e in zip(stages, before, strict=True):
        assert 0 < s.peak_saved_bytes <= e.peak_saved_bytes


@pytest.mark.zoo
@pytest.mark.distributed
def test_a_gpt2_the_user_compiled_trains_on_two_processes_as_one_device(tmp_path):
    """``model.model = torch.compile(model.model)`` as on one device, then
    ``Trainer(strategy="pipemare_gpipe", devices=2)``: each process compiles its stage
    (inductor) and both end with the uncompiled one device's held-out loss. Two blocks, one a
    stage: inductor's time grows with the graph it compiles, and the zoo's budget is short."""
    pytest.importorskip("transformers")
    from support.real_runs import two_process_workflow, val_loss
    from support.zoo import GPT2Module, data

    steps = 10
    args = ["--task", "gpt2", "--strategy", "pipemare_gpipe", "--no-dropout", "--compile"]
    reports = two_process_workflow(tmp_path, *args, "--layers", "2", "--steps", str(steps))
    plain = GPT2Module(dropout=False, layers=2)
    quiet_trainer("auto", max_steps=steps).fit(plain, data("causal", n=8 * steps))
    want = val_loss(plain, data("causal", n=64, seed=1))
    for report in reports:
        assert report["val_loss"] == pytest.approx(want, rel=1e-4)
        assert report["global_step"] == steps
