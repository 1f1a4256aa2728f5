"""Bad input, tried as a new user would: each case refused before training with what to do,
or handled correctly. The table in docs/bad-input.md lists every case and its test; cases
tested elsewhere are named there, not tested again here."""

from __future__ import annotations

import copy
import datetime
import math
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins import MixedPrecision
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from pipemare import Pipeline, PipeMareConfig, PipeMareStrategy
from support.models import quiet_trainer, three_class_points

ROOT = Path(__file__).resolve().parents[2]


def trainer(strategy, **kwargs):
    return quiet_trainer(strategy, **{"max_steps": 2, **kwargs})


class Tiny(pl.LightningModule):
    """Five layers written for one device; ``net`` may be replaced before training."""

    def __init__(self, net=None, optimizer=None):
        super().__init__()
        self.net = net if net is not None else layers()
        self.optimizer = optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return self.optimizer(self.parameters())


def layers():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def deep():
    """Seven layers; layers 2 and 4 have the same shape, so a test may tie them."""
    return nn.Sequential(
        nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
        nn.Linear(8, 3),
    )  # fmt: skip


def tie(net, first, second):
    """``net`` with layer ``second`` holding layer ``first``'s weight (tied weights)."""
    net[second].weight = net[first].weight
    return net


def reused():
    """One layer object in two places (0 and 2)."""
    lin = nn.Linear(5, 5)
    return nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(5, 3))


def data(n=48, batch=12):
    return three_class_points(n, batch)


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


class Batches(pl.Callback):
    """Counts the training batches started: 0 means refused before training began."""

    def __init__(self):
        self.started = 0

    def on_train_batch_start(self, *args):
        self.started += 1


def refuse(match, strategy, model=None, error=ValueError, batches=0, **kwargs):
    """Fit, expecting ``error``; assert no update ran and ``batches`` batches had started."""
    model = model if model is not None else Tiny()
    before, spy = weights(model), Batches()
    with pytest.raises(error, match=match):
        trainer(strategy, callbacks=[spy], **kwargs).fit(model, data())
    assert spy.started == batches
    for a, b in zip(before, weights(model), strict=True):
        assert torch.equal(a, b)


# -- the strategy's arguments: refused when it is built -------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        *[
            (dict(microbatches=bad), ValueError, "microbatches must be an integer >= 1")
            for bad in (-1, 2.5, True, "4")
        ],
        *[
            (dict(stages=bad), ValueError, "stages must be a positive integer")
            for bad in (0, 2.0, True)
        ],
        *[
            (dict(balance=bad), ValueError, r"a list of layer counts \(a whole number >= 1 per")
            for bad in ([2.5, 2.5], [0, 5], 3, [])
        ],
        (
            dict(config={"warmup_steps": 2}),
            TypeError,
            r"config must be a pipemare.PipeMareConfig, got dict; e.g. PipeMareConfig\(",
        ),
        (
            dict(schedule="pipedream", config=PipeMareConfig(weight_prediction=True)),
            ValueError,
            "weight_prediction cannot run with 'pipedream'.*use schedule='async' or 'pipemare'",
        ),
        (dict(start_method="thread"), ValueError, "start_method must be one of popen, spawn"),
        (dict(sequential=3), ValueError, "sequential must name the attribute to pipeline as a"),
        (dict(timeout=60), ValueError, r"must be a datetime.timedelta, e.g. datetime.timedelta"),
        *[
            (dict(stall_timeout=bad), ValueError, "stall_timeout must be a positive, finite number")
            for bad in (0, -5, "5", math.nan, math.inf)
        ],
        *[
            (
                dict(heartbeat_timeout=bad),
                ValueError,
                r"heartbeat_timeout must be a positive, finite number of seconds or None \(no",
            )
            for bad in (0, -1.0, "30", True, math.nan, math.inf)
        ],
        *[(dict(advise=bad), ValueError, "advise must be True or False") for bad in (1, "yes")],
        *[
            (dict(measure_activations=bad), ValueError, "measure_activations must be True or False")
            for bad in (1, "yes")
        ],
    ],
)
def test_bad_strategy_arguments_are_refused_when_it_is_built(kwargs, error, message):
    with pytest.raises(error, match=message):
        PipeMareStrategy(**kwargs)


def test_good_strategy_arguments_pass():
    s = PipeMareStrategy(stages=2, balance=(3, 2), timeout=datetime.timedelta(seconds=5))
    o = s.options  # the arguments as given; s.balance is the cut, once made
    assert o.balance == [3, 2] and o.stall_timeout == 300.0 and o.heartbeat_timeout == 30.0
    assert s.balance is None
    assert PipeMareStrategy(heartbeat_timeout=None).options.heartbeat_timeout is None
    assert s.options.advise and not PipeMareStrategy(advise=False).options.advise


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(warmup_steps="10"), "warmup_steps must be a whole number of steps, got '10'"),
        (dict(warmup_steps=2.5), "warmup_steps must be a whole number of steps"),
        (dict(warmup_steps=-1), "warmup_steps must be >= 0"),
        (dict(reschedule_steps=1.5), "reschedule_steps must be a whole number of steps"),
        (dict(lr_reschedule="yes"), "lr_reschedule must be True or False"),
        (dict(discrepancy_correction=1), "discrepancy_correction must be True or False"),
        (
            dict(reschedule_fraction="0.1"),
            "reschedule_fraction must be a finite number in .0, 1. or .auto.",
        ),
        (dict(prediction_scale=math.nan), "prediction_scale must be a finite number"),
        (dict(weight_prediction=1), "weight_prediction must be True, False or 'auto'"),
        (dict(delay_momentum=True), "delay_momentum must lie in"),
    ],
)
def test_a_config_value_of_the_wrong_type_or_range_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipeMareConfig(**kwargs)


# -- the model, the cut and the optimiser: refused at setup, before the first batch ------------


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = layers()


class Nested(Tiny):
    def __init__(self):
        super().__init__()
        del self.net
        self.body = Body()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.body.layers(x), y)


class TwoOptimisers(Tiny):
    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net[:2].parameters(), lr=0.1),
            torch.optim.SGD(self.net[2:].parameters(), lr=0.1),
        ]


RMSPROP = lambda ps: torch.optim.RMSprop(ps, lr=0.01)  # noqa: E731


@pytest.mark.parametrize(
    ("strategy", "model", "message"),
    [
        (
            PipeMareStrategy(),
            Tiny(nn.Sequential(), lambda ps: torch.optim.SGD([nn.Parameter(torch.ones(1))], 0.1)),
            r"Tiny.net is an empty nn.Sequential: there are no layers to cut into stages; put the",
        ),
        (
            PipeMareStrategy(stages=2, sequential="body"),
            Tiny(),
            "Tiny has no submodule 'body' to pipeline; pass the attribute that holds your",
        ),
        (
            PipeMareStrategy(stages=2, module="net.0"),
            Tiny(),
            r"Tiny has trainable parameters outside net.0 \(net.2.weight, net.2.bias, ",
        ),
        (
            PipeMareStrategy(stages=2, split_points=["net.2"]),
            Tiny(),
            r"Tiny.net is an nn.Sequential, which is cut between its children by balance=",
        ),
        (
            PipeMareStrategy(stages=2, split_points=["body.layers.9"]),
            Nested(),
            r"split point 'layers.9' names no module of Nested.body; name the modules to cut",
        ),
        (
            PipeMareStrategy(stages=2, balance=[2, 2, 1]),
            Tiny(),
            r"balance \[2, 2, 1\] lists 3 stages but the run has 2 \(stages=2\); give one layer "
            r"count per stage, or pass stages=3",
        ),
        (
            PipeMareStrategy(balance=[2, 3]),
            Tiny(),
            r"lists 2 stages but the run has 5 \(one per layer of Tiny.net, the default with "
            r"devices=1\); .* or pass stages=2",
        ),
        (
            PipeMareStrategy(stages=2, balance=[2, 2]),
            Tiny(),
            r"balance \[2, 2\] covers 4 layers but Tiny.net has 5; list how many consecutive "
            r"layers each stage takes, summing to 5 \(e.g. \[3, 2\]\)",
        ),
        (
            PipeMareStrategy(stages=2),
            TwoOptimisers(),
            r"pipemare steps one optimiser, stage by stage; configure_optimizers returned several"
            r".* Return one optimiser, with a parameter group for each part.*"
            r"pipemare.optim.MuonAdamW\(muon_param_groups\(model\)\).*"
            r"self.automatic_optimization = False and step both in training_step",
        ),
        (
            PipeMareStrategy(stages=2, config=PipeMareConfig(spike_compensation=True)),
            Tiny(optimizer=RMSPROP),
            r"spike compensation supports SGD, Adam and AdamW, not RMSprop; or switch it off",
        ),
        (
            PipeMareStrategy(stages=2, config=PipeMareConfig(delay_momentum=0.95)),
            Tiny(optimizer=lambda ps: torch.optim.Adagrad(ps, lr=0.1)),
            r"delay_momentum needs an optimiser with momentum .* or switch it off",
        ),
    ],
    ids=[
        "empty-sequential",
        "sequential-missing",
        "module-leaves-parameters-out",
        "split-points-of-a-sequential",
        "split-point-not-a-module",
        "balance-length-vs-stages",
        "balance-without-stages",
        "balance-sum",
        "two-optimisers",
        "correction-cannot-serve-optimiser",
        "delay-momentum-without-momentum",
    ],
)
def test_refused_at_setup_before_the_first_batch(strategy, model, message):
    refuse(message, strategy, model)


def test_lbfgs_is_refused_at_setup():
    model = Tiny(optimizer=lambda ps: torch.optim.LBFGS(ps))
    refuse(
        "LBFGS re-evaluates the loss inside step()", PipeMareStrategy(stages=2), model, TypeError
    )


def test_a_negative_clipping_threshold_is_refused_at_setup():
    refuse(
        r"gradient_clip_val=-1.0: a clipping threshold must be a positive number; pass one, or 0 "
        "or None",
        PipeMareStrategy(stages=2),
        gradient_clip_val=-1.0,
    )


# -- refused when the Trainer is built (Lightning's checks and the strategy's) ----------------


def test_float16_is_refused_and_16_mixed_on_cpu_runs_as_bf16():
    with pytest.raises(ValueError, match=r"not '16-mixed' .* use precision='bf16-mixed'"):
        trainer(PipeMareStrategy(stages=2), plugins=[MixedPrecision("16-mixed", "cpu")])
    t = trainer(PipeMareStrategy(stages=2), precision="16-mixed")  # Lightning: bf16 on CPU
    assert t.precision_plugin.precision == "bf16-mixed"


def test_lightning_refuses_an_unknown_clipping_algorithm_and_strategy_name():
    with pytest.raises(MisconfigurationException, match="`gradient_clip_algorithm` max is"):
        trainer(PipeMareStrategy(stages=2), gradient_clip_val=1.0, gradient_clip_algorithm="max")
    with pytest.raises(ValueError, match="invalid strategy name: `strategy='pipemare_gpip'`"):
        pl.Trainer(strategy="pipemare_gpip", accelerator="cpu", devices=1)


# -- what only the first batch shows: refused before any update ------------------------------


class Indexes(Tiny):
    def training_step(self, batch, batch_idx):
        x, y = batch
        for layer in self.net:
            x = layer(x)
        return F.cross_entropy(x, y)


class CallsTwice(Tiny):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x) + self.net(x), y)


class Bypasses(Tiny):
    def training_step(self, batch, batch_idx):
        return torch.zeros((), requires_grad=True)


class ReturnsNothing(Tiny):
    def training_step(self, batch, batch_idx):
        x, y = batch
        F.cross_entropy(self.net(x), y)


@pytest.mark.parametrize(
    ("model", "error", "message"),
    [
        (
            Indexes(),
            RuntimeError,
            r"Indexes.net was indexed, iterated or measured in the step .* must pass its input "
            r"through it in one call, y = self.net\(x\)",
        ),
        (CallsTwice(), RuntimeError, "CallsTwice.net was called twice in one step; .* Call it"),
        (Bypasses(), RuntimeError, "training_step returned without calling net; pipemare needs"),
        (ReturnsNothing(), TypeError, "training_step returned NoneType; with pipemare it must"),
    ],
    ids=["indexes-the-sequential", "calls-it-twice", "never-calls-it", "returns-no-loss"],
)
def test_a_step_the_pipeline_cannot_split_is_refused_at_the_first_batch(model, error, message):
    refuse(message, PipeMareStrategy(stages=2, balance="even"), model, error, batches=1)


def test_a_batch_smaller_than_the_microbatches_is_refused_at_the_first_batch():
    refuse(
        "a batch of 12 samples cannot be split into 16 microbatches; use a batch size >= 16 or "
        "fewer microbatches",
        PipeMareStrategy(stages=2, microbatches=16),
        batches=1,
    )


def test_an_iterable_dataset_s_short_last_batch_trains():
    # Without a length the last batch is unknown at setup; its one sample runs where it comes,
    # the N - 1 microbatches left filled with weightless copies.
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from zip(torch.randn(25, 5), torch.arange(25) % 3, strict=True)

    epoch = dict(max_steps=-1, max_epochs=1)
    t, model = trainer(PipeMareStrategy(stages=2, microbatches=4), **epoch), Tiny()
    t.fit(model, DataLoader(Stream(), batch_size=12))
    assert t.global_step == 3
    assert all(torch.isfinite(w).all() for w in weights(model))
    t = trainer(PipeMareStrategy(stages=2, microbatches=4), **epoch)
    t.fit(Tiny(), DataLoader(Stream(), batch_size=12, drop_last=True))
    assert t.global_step == 2


# -- handled ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "strategy"),
    [
        (lambda: Tiny(reused()), dict(stages=2, balance=[3, 2])),  # inside one stage
        (lambda: Tiny(reused()), dict(stages=2, balance=[2, 3])),  # a layer used on two stages
        (lambda: Tiny(tie(deep(), 2, 4)), dict(stages=2, balance=[3, 4])),
        (lambda: Tiny(tie(deep(), 2, 4)), dict(microbatches=2)),  # one stage per layer
        (lambda: Tiny(tie(deep(), 2, 4)), dict(stages=3, balance="params")),
    ],
    ids=["one-stage", "reused-across", "tied-across", "tied-per-layer", "tied-params"],
)
def test_tied_weights_train_as_on_one_device_wherever_the_cut_falls(model, strategy):
    """The tie's gradient is the sum over the stages holding it, applied once (gpipe)."""
    base = model()
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    trainer("auto").fit(plain, data())
    t = trainer(PipeMareStrategy(schedule="gpipe", **strategy))
    t.fit(piped, data())
    assert t.global_step == 2
    for a, b in zip(weights(piped), weights(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    ties = [(n, p) for n, p in piped.named_parameters(remove_duplicate=False)]
    assert len({id(p) for _, p in ties}) < len(ties)  # the user's module is still tied


def test_no_optimiser_runs_as_lightning_does_without_updates():
    class NoOptimiser(Tiny):
        def configure_optimizers(self):
            return None

    model = NoOptimiser()
    before = weights(model)
    with pytest.warns(UserWarning, match="this fit will run with no optimizer"):
        t = trainer(PipeMareStrategy(stages=2, schedule="gpipe"))
        t.fit(model, data())
    assert t.global_step == 2
    assert all(torch.equal(a, b) for a, b in zip(before, weights(model), strict=True))


def test_frozen_parameters_outside_the_sequential_are_fine():
    model = Tiny()
    model.scale = nn.Parameter(torch.ones(()), requires_grad=False)
    t = trainer(PipeMareStrategy(stages=2))
    t.fit(model, data())
    assert t.global_step == 2


def test_clipping_by_value_matches_one_device():
    pl.seed_everything(0)
    base = Tiny()
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    clip = dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")
    trainer("auto", **clip).fit(plain, data())
    trainer(PipeMareStrategy(stages=2, schedule="1f1b", microbatches=2), **clip).fit(piped, data())
    for a, b in zip(weights(piped), weights(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.equal(weights(piped)[0], weights(base)[0])


# -- the engine: the same checks ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        (nn.Sequential(), {}, "the model is an empty nn.Sequential"),
        (layers(), dict(stages=2, balance=[2.5, 2.5]), r"a list of layer counts \(a whole"),
    ],
    ids=["empty", "fractional-balance"],
)
def test_the_engine_refuses_the_same_models(model, kwargs, message):
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1)), *model.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=message):
        Pipeline(model, opt, F.cross_entropy, **kwargs)


# -- the command line and config files ---------------------------------------------------------


CPU = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"]


def cli(tmp_path, monkeypatch, *args):
    from pipemare.cli.lightning_cli import PipeMareCLI

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        PipeMareCLI(args=["--config", str(ROOT / "configs" / "mnist.yaml"), *CPU, *args], run=False)
    return exit_.value.code


def test_a_value_a_class_refuses_in_a_config_gets_its_message_not_a_traceback(
    tmp_path, monkeypatch, capsys
):
    assert cli(tmp_path, monkeypatch, "--trainer.strategy.init_args.schedule=pipemre") == 2
    assert (
        "error: the config could not be built: unknown schedule 'pipemre'; did you mean "
        "'pipemare'?" in capsys.readouterr().err
    )
    assert cli(tmp_path, monkeypatch, "--trainer.strategy.init_args.config.warmup_steps=-3") == 2
    assert "could not be built: warmup_steps must be >= 0, got -3" in capsys.readouterr().err


def test_an_unknown_key_in_a_config_file_is_refused_by_name(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "trainer:\n  strategy:\n    class_path: pipemare.PipeMareStrategy\n    init_args:\n"
        "      microbatch: 4\n"
    )
    assert cli(tmp_path, monkeypatch, "--config", str(bad)) == 2
    err = capsys.readouterr().err
    assert "Option 'microbatch' is not accepted" in err and "--help" in err


def test_the_command_line_suggests_a_command(capsys):
    from pipemare.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["fitt"])
    assert exit_.value.code == 2
    assert "unknown command 'fitt'; did you mean 'fit'?" in capsys.readouterr().err


def test_an_engine_optimiser_over_other_parameters_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    other = copy.deepcopy(model)
    with pytest.raises(ValueError, match="holds none of the pipelined model's parameters"):
        Pipeline(model, torch.optim.SGD(other.parameters(), lr=0.1), F.cross_entropy)
    with pytest.raises(ValueError, match="stages must be a positive integer"):
        Pipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, stages=2.5)
