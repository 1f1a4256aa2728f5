"""The Lightning strategy in one process (simulated stages): transparency, checkpoints, errors."""

from __future__ import annotations

import copy
import logging
import time

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F

import pipemare
from pipemare import PipeMareConfig, PipeMareStrategy
from support.data import DigitsDataModule
from support.models import QUIET_CPU_TRAINER, DigitsCNN, three_class_points
from support.models import quiet_trainer as trainer


class Tiny(pl.LightningModule):
    """A module written for one device: nothing in it knows about pipelines."""

    def __init__(self, lr=0.05, scheduler=None):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        )
        self.lr, self.scheduler = lr, scheduler

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.scheduler is None:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": self.scheduler(opt), "interval": "step"},
        }


def tiny_data(n=96, batch=12):
    return three_class_points(n, batch)


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sync_schedule_reproduces_single_device_lightning(schedule):
    pl.seed_everything(0)
    base = Tiny()
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    trainer("auto", max_steps=7, gradient_clip_val=0.5).fit(plain, tiny_data())
    strategy = PipeMareStrategy(stages=3, microbatches=4, schedule=schedule, balance=[2, 2, 1])
    t = trainer(strategy, max_steps=7, gradient_clip_val=0.5)
    t.fit(piped, tiny_data())
    assert t.global_step == 7
    for a, b in zip(weights(piped), weights(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert weights(piped)[0].abs().sum() != weights(base)[0].abs().sum()


def test_updates_use_the_lr_of_the_step_that_fed_them():
    # The LR drops to 0 from step 5 on. With an 8-stage asynchronous pipeline the updates of
    # minibatches 3 and 4 happen during later steps; they must still use the LR of steps 3 and 4.
    def zero_after_five(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 if k < 5 else 0.0)

    pl.seed_everything(0)
    base = Tiny(scheduler=zero_after_five)
    cfg = PipeMareConfig.t1_t2(discrepancy_correction=False, reschedule_steps=3)
    runs = {}
    for steps in (5, 8):
        m = copy.deepcopy(base)
        trainer(PipeMareStrategy(stages=5, schedule="async", config=cfg), max_steps=steps).fit(
            m, tiny_data()
        )
        runs[steps] = weights(m)
    for a, b in zip(runs[5], runs[8], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(runs[5][0], weights(base)[0])


def test_eight_simulated_stages_train_the_cnn_close_to_one_device():
    results = {}
    for name, strategy in [
        ("single", "auto"),
        ("pipemare-8", PipeMareStrategy(stages=8, microbatches=2, balance="params")),
    ]:
        pl.seed_everything(0)
        model = DigitsCNN(lr=2e-3)
        t = trainer(strategy, max_epochs=6)
        t.fit(model, DigitsDataModule(batch_size=32))
        results[name] = float(t.callback_metrics["val_acc"])
    print(
        f"\nval_acc after 6 epochs: single device {results['single']:.3f}, "
        f"8 simulated stages {results['pipemare-8']:.3f}"
    )
    assert results["single"] > 0.9
    assert results["pipemare-8"] > results["single"] - 0.06


def test_checkpoint_loads_into_a_plain_module_with_identical_predictions(tmp_path):
    pl.seed_everything(0)
    model = DigitsCNN()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = trainer(
        PipeMareStrategy(stages=4, microbatches=2),
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[ckpt],
    )
    data = DigitsDataModule()
    t.fit(model, data)
    piped = torch.cat(t.predict(model, data))
    plain = DigitsCNN.load_from_checkpoint(ckpt.last_model_path)
    plain.eval()
    data.setup()
    with torch.no_grad():
        direct = plain(data.val_set.tensors[0]).argmax(1)
    assert torch.equal(piped, direct)
    state = torch.load(ckpt.last_model_path, weights_only=False)["optimizer_states"][0]
    assert len(state["state"]) == len(list(model.parameters()))  # every stage's Adam moments
    assert state["pipemare"]["pipeline"]["minibatches"] == t.global_step
    buffers = state["pipemare"]["optimizer"]["buffers"]
    assert len(buffers["weight_prediction"]) > 0  # the corrections' buffers travel too


@pytest.mark.parametrize("schedule", ["pipemare", "1f1b"])
def test_resume_continues_as_the_uninterrupted_run(tmp_path, schedule):
    def data():
        return DigitsDataModule(batch_size=32, shuffle=False)

    def strategy():
        return PipeMareStrategy(
            stages=5,
            microbatches=2,
            schedule=schedule,
            balance="params",  # a cut from measured times may differ between the two runs
            config=PipeMareConfig.t1_t2(reschedule_steps=60) if schedule == "pipemare" else None,
        )

    pl.seed_everything(0)
    base = DigitsCNN(lr=2e-3)
    full = copy.deepcopy(base)
    ckpt_full = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "full", save_top_k=-1, every_n_epochs=1
    )
    trainer(strategy(), max_epochs=3, enable_checkpointing=True, callbacks=[ckpt_full]).fit(
        full, data()
    )

    first = copy.deepcopy(base)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "part", save_last=True)
    trainer(strategy(), max_epochs=2, enable_checkpointing=True, callbacks=[ckpt]).fit(
        first, data()
    )
    resumed = copy.deepcopy(base)
    t = trainer(
        strategy(),
        max_epochs=3,
        enable_checkpointing=True,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "part2", every_n_epochs=1)],
    )
    t.fit(resumed, data(), ckpt_path=ckpt.last_model_path)
    assert t.global_step == 3 * 46
    for a, b in zip(weights(resumed), weights(full), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_bf16_mixed_runs_stages_under_autocast():
    pl.seed_everything(0)
    model = Tiny(lr=0.1)
    seen = []
    model.net[2].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    t = trainer(PipeMareStrategy(stages=3, microbatches=2), precision="bf16-mixed", max_epochs=3)
    t.fit(model, tiny_data())
    assert seen and all(d == torch.bfloat16 for d in seen)
    assert model.net[0].weight.dtype == torch.float32
    assert torch.isfinite(t.callback_metrics["train_loss"])


def test_loop_controls_and_entry_points():
    pl.seed_everything(0)
    model = DigitsCNN()
    data = DigitsDataModule()
    strategy = PipeMareStrategy(stages=4, microbatches=2)
    t = trainer(
        strategy, max_epochs=2, limit_train_batches=10, limit_val_batches=2, val_check_interval=5
    )
    t.fit(model, data)
    assert t.global_step == 20
    assert "val_acc" in t.callback_metrics and "train_loss" in t.callback_metrics
    assert [round(d.forward, 2) for d in strategy.delays] == [1.5, 1.0, 0.5, 0.0]
    assert len(trainer(PipeMareStrategy(stages=4)).validate(model, data)) == 1
    tested = trainer(PipeMareStrategy(stages=4)).test(model, data)[0]["test_acc"]
    x, y = data.val_set.tensors
    with torch.no_grad():
        direct = float((model(x).argmax(1) == y).float().mean())
    assert tested == pytest.approx(direct, abs=1e-6)  # test_step ran through the pipeline
    fast = trainer(PipeMareStrategy(stages=3, microbatches=2), fast_dev_run=True)
    fast.fit(DigitsCNN(), data)
    assert fast.global_step == 1


def test_registered_in_both_lightning_packages():
    import lightning.pytorch as L

    from pipemare import LightningPipeMareStrategy

    t = L.Trainer(strategy="pipemare_1f1b", max_steps=2, **QUIET_CPU_TRAINER)
    assert isinstance(t.strategy, LightningPipeMareStrategy) and t.strategy.schedule == "1f1b"
    t = trainer("pipemare_gpipe")
    assert isinstance(t.strategy, PipeMareStrategy) and t.strategy.schedule == "gpipe"


# -- errors ----------------------------------------------------------------------------------


def test_stages_must_divide_the_devices():
    with pytest.raises(
        ValueError,
        match=r"stages=4\) with devices=2 and num_nodes=1: 2 processes cannot run whole copies "
        r"of a 4-stage pipeline; use stages=1 or 2",
    ):
        pl.Trainer(strategy=PipeMareStrategy(stages=4), accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"use stages=1 or 2 or 3 or 6"):
        pl.Trainer(strategy=PipeMareStrategy(stages=4), accelerator="cpu", devices=3, num_nodes=2)


class NoSequential(Tiny):
    def __init__(self):
        super().__init__()
        self.net = nn.ModuleList([nn.Linear(5, 3)])


class TwoSequentials(Tiny):
    def __init__(self):
        super().__init__()
        self.head = nn.Sequential(nn.Identity())


class TwoTrained(Tiny):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)


class OutsideParameters(Tiny):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x) * self.scale, y)


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (NoSequential, r"cannot cut ModuleList .* missing the required \"forward\" function"),
        (
            TwoTrained,
            r"several submodules with trainable parameters \(net, head\); .* name it with "
            r"PipeMareStrategy\(module='net'\)",
        ),
        (OutsideParameters, r"trainable parameters outside net \(scale\)"),
    ],
)
def test_modules_that_cannot_be_pipelined(module, message):
    with pytest.raises(ValueError, match=message):
        trainer(PipeMareStrategy(stages=2), max_steps=1).fit(module(), tiny_data())


def test_the_child_that_trains_is_pipelined_and_a_name_resolves_ambiguity():
    t = trainer(PipeMareStrategy(stages=2), max_steps=2)
    t.fit(TwoSequentials(), tiny_data())  # head holds no parameters: net is the one
    assert t.global_step == 2 and t.strategy._runner.adapter.path == "net"
    t = trainer(PipeMareStrategy(stages=2, sequential="net"), max_steps=2)
    t.fit(TwoSequentials(), tiny_data())
    assert t.global_step == 2


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"cannot cut Tiny.net \(5 layers\) into 6 stages"):
        trainer(PipeMareStrategy(stages=6), max_steps=1).fit(Tiny(), tiny_data())


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision(precision):
    with pytest.raises(
        ValueError, match=r"pipemare supports precision '32-true', 'bf16-mixed' and 'bf16-true'"
    ):
        pl.Trainer(
            strategy=PipeMareStrategy(stages=2), accelerator="cpu", devices=1, precision=precision
        )


def test_gradient_accumulation_is_refused():
    with pytest.raises(ValueError, match=r"use PipeMareStrategy\(microbatches=N\) instead"):
        trainer(PipeMareStrategy(stages=2), max_steps=1, accumulate_grad_batches=2).fit(
            Tiny(), tiny_data()
        )


class Manual(Tiny):
    """Tiny under manual optimisation; ``mistake`` is what its training step does wrong."""

    def __init__(self, mistake=None, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.mistake = mistake

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.mistake != "no backward":
            self.manual_backward(loss)
        if self.mistake == "two backwards":
            self.manual_backward(loss)
        if self.mistake == "clipping":
            self.clip_gradients(opt, gradient_clip_val=1.0)
        if self.mistake == "toggle":
            self.toggle_optimizer(opt)
        opt.step(closure=(lambda: loss) if self.mistake == "closure" else None)
        if self.mistake == "scheduler":
            self.lr_schedulers().step()
        self.log("train_loss", loss)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.mistake == "step in a hook":
            self.optimizers().step()
        elif self.scheduler is not None:
            self.lr_schedulers().step()


@pytest.mark.parametrize("schedule", ["gpipe", "pipemare"])
def test_manual_optimisation_trains_as_automatic(schedule):
    """One optimiser, stepped in training_step, with a scheduler stepped per batch in
    on_train_batch_end: the same run as Lightning's automatic optimisation with the scheduler
    at interval "step", for the synchronous and the asynchronous schedule."""
    step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # noqa: E731
    base = Tiny(scheduler=step_lr)
    manual, automatic = Manual(scheduler=step_lr), copy.deepcopy(base)
    manual.load_state_dict(base.state_dict())
    t = trainer(PipeMareStrategy(stages=3, microbatches=2, schedule=schedule), max_steps=16)
    t.fit(manual, tiny_data())
    trainer(PipeMareStrategy(stages=3, microbatches=2, schedule=schedule), max_steps=16).fit(
        automatic, tiny_data()
    )
    assert t.global_step == 16
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**5)
    for a, b in zip(weights(manual), weights(automatic), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(weights(manual)[0], weights(base)[0])  # it trained


def test_two_optimisers_count_a_step_each_and_t1_counts_batches():
    """With two optimisers, max_steps counts both (Lightning's manual loop does): 12 steps are
    6 batches, the run stops there, and T1's horizon derives from 6 updates, not 12."""

    class TwoManual(Manual):
        def training_step(self, batch, batch_idx):
            first, second = self.optimizers()
            x, y = batch
            self.manual_backward(F.cross_entropy(self.net(x), y))
            first.step()
            second.step()

        def configure_optimizers(self):
            return [
                torch.optim.SGD(self.net[:2].parameters(), lr=0.05, momentum=0.9),
                torch.optim.Adam(self.net[2:].parameters(), lr=1e-3),
            ]

    strategy = PipeMareStrategy(stages=3, microbatches=2)
    t = trainer(strategy, max_steps=12)
    t.fit(TwoManual(), tiny_data())
    assert t.global_step == 12 and strategy.pipeline.minibatches_fed == 6
    assert strategy.pipeline.optimizer.run_state()["total_steps"] == 6


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("no backward", r"called self.manual_backward 0 times in one step.*call it once"),
        ("two backwards", r"called self.manual_backward 2 times.*on the sum of your losses"),
        ("clipping", r"gradient clipping inside training_step is not supported.*gradient_clip_val"),
        ("closure", r"an optimiser step cannot take a closure"),
        ("toggle", r"toggle_optimizer.*not supported with pipemare.*requires_grad=False"),
        ("scheduler", r"a scheduler cannot step there \(StepLR.step\(\).*on_train_batch_end"),
        ("step in a hook", r"call opt.step\(\) only inside training_step"),
    ],
)
def test_manual_optimisation_refuses_what_a_pipeline_cannot_do(mistake, message):
    """Each refused with what to do instead; all but a step in a hook before any update."""
    step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3)  # noqa: E731
    model = Manual(mistake, scheduler=step_lr)
    before = weights(model)
    with pytest.raises(ValueError, match=message):
        trainer(PipeMareStrategy(stages=3, microbatches=2), max_steps=4).fit(model, tiny_data())
    if mistake != "step in a hook":
        for a, b in zip(weights(model), before, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_last_batch_smaller_than_n_trains_as_on_one_device(schedule, caplog):
    """98 samples in batches of 12 at N = 4: the last batch's 2 samples run a microbatch
    each, two weightless copies fill the schedule, and weights and logged loss are one
    device's over two epochs."""
    pl.seed_everything(0)
    base = Tiny()
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    one = trainer("auto", max_epochs=2)
    one.fit(plain, tiny_data(n=98))
    strategy = PipeMareStrategy(stages=3, microbatches=4, schedule=schedule, balance=[2, 2, 1])
    t = trainer(strategy, max_epochs=2)
    t.fit(piped, tiny_data(n=98))
    assert t.global_step == one.global_step == 18
    for a, b in zip(weights(piped), weights(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the last step logged is the short batch's: its loss, not the copies'
    torch.testing.assert_close(
        t.callback_metrics["train_loss"], one.callback_metrics["train_loss"], rtol=0, atol=1e-6
    )
    assert "last batch: 2 sample(s) < N=4 (98 samples in batches of 12" in caplog.text
    assert "drop_last=True skips it" in caplog.text


def test_default_microbatches_bound_the_delay_and_fit_the_last_batch(caplog):
    """With microbatches left out, a schedule that never flushes runs N = P, said with its
    reason; a batch size below P caps N, a last batch below P does not; gpipe keeps N = 1."""
    strategy = PipeMareStrategy(stages=4)
    # before the first batch, "auto" is not yet a number: nothing exposed is a guess
    assert strategy.microbatches is None and strategy.delays is None and strategy.lag is None
    assert strategy.balance is None
    trainer(strategy, max_steps=3, enable_progress_bar=False).fit(Tiny(), tiny_data(n=96))
    assert strategy.microbatches == strategy.pipeline.microbatches == 4
    assert max(d.forward_max for d in strategy.delays) == 1
    assert all(d.forward < 1 for d in strategy.delays)
    # the line says the bound in the engine's own delays
    assert "microbatches: N=4 (N = P: no microbatch more than one update stale" in caplog.text
    assert "updates old: at most 1, 0.75 on average at the first stage" in caplog.text
    caplog.clear()
    # 98 samples in batches of 12: the last holds 2, and N stays P (the copies fill it)
    short = PipeMareStrategy(stages=4)
    trainer(short, max_epochs=1).fit(Tiny(), tiny_data(n=98))
    assert short.microbatches == 4
    assert "last batch: 2 sample(s) < N=4" in caplog.text
    caplog.clear()
    # a batch size below P caps N, said with its reason
    small = PipeMareStrategy(stages=4)
    trainer(small, max_steps=2).fit(Tiny(), tiny_data(n=24, batch=3))
    assert small.microbatches == 3
    assert "microbatches: N=3 (as many as the smallest batch's 3 sample(s) allow" in caplog.text
    worst = max(d.forward_max for d in small.delays)
    assert f"updates old: at most {worst}, 1 on average at the first stage" in caplog.text
    # a flushing schedule takes the N whose replayed step was fastest on this machine: which
    # one depends on the timings, but it divides the batch and its reason is said
    caplog.clear()
    flushing = PipeMareStrategy(stages=4, schedule="1f1b")
    trainer(flushing, max_steps=1).fit(Tiny(), tiny_data())
    assert flushing.microbatches in (1, 2, 3, 4, 6, 12)
    said = f"microbatches: N={flushing.microbatches} (the fastest step of '1f1b' for a batch of 12"
    assert said in caplog.text and "N=1: " in caplog.text and "N=12: " in caplog.text
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1 or 'auto'"):
        PipeMareStrategy(microbatches="max")


class _Stream(torch.utils.data.IterableDataset):
    """The points of ``loader`` as a stream of unknown length (Lightning prefetches it)."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)


class _Fed(pl.Callback):
    def __init__(self) -> None:
        self.fed: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.fed.append((batch_idx, float(batch[0][0, 0])))


@pytest.mark.parametrize("stream", [False, True], ids=["sized", "stream"])
def test_the_plan_comes_from_the_first_training_batch_read_before_the_sanity_check(stream):
    """Validation batches of 3 rows, training batches of 12, P = 4: with a sanity check the
    plan is made from the first training batch (N = 4, where a validation batch allows 3), and
    training is fed the same batches and ends on the same weights as without one."""
    pl.seed_everything(0)
    base = Tiny()
    val = tiny_data(n=9, batch=3)
    runs = {}
    for sanity in (0, 2):
        model, fed = copy.deepcopy(base), _Fed()
        strategy = PipeMareStrategy(stages=4, balance=[2, 1, 1, 1])  # a cut timed may differ
        data = tiny_data(n=60)
        t = trainer(
            strategy,
            max_epochs=2,
            num_sanity_val_steps=sanity,
            callbacks=[fed],
            **({"limit_train_batches": 5} if stream else {}),
        )
        loader = torch.utils.data.DataLoader(_Stream(data), batch_size=None) if stream else data
        t.fit(model, loader, val)
        decisions = {d.subject: d for d in strategy.settings.decisions}
        assert decisions["planned from"].choice == "the first training batch"
        assert strategy.microbatches == 4
        runs[sanity] = (fed.fed, weights(model), t.global_step)
    assert runs[2][0] == runs[0][0] and len(runs[0][0]) == 10 and runs[0][2] == 10
    for a, b in zip(runs[2][1], runs[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_options():
    with pytest.raises(ValueError, match="unknown schedule 'zero_bubble'"):
        PipeMareStrategy(schedule="zero_bubble")
    with pytest.raises(ValueError, match="balance must be one of time, auto, params, even"):
        PipeMareStrategy(balance="flops")
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1"):
        PipeMareStrategy(microbatches=0)
    with pytest.raises(ValueError, match=r"does not exist.*save_pretrained directory"):
        PipeMareStrategy(weights="no/such/weights.safetensors")
    assert pipemare.PipeMareStrategy is PipeMareStrategy


class LookAtStages(pl.Callback):
    def __init__(self):
        self.flags = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.flags = [s.recompute for s in trainer.strategy.pipeline.stages]


@pytest.mark.parametrize("schedule", ["1f1b", "pipemare"])
def test_recompute_through_the_strategy(schedule):
    """recompute=True reaches every stage but the last; exact for a flushing schedule, a
    different (backward-time) computation for a non-flushing one."""
    pl.seed_everything(0)
    base = Tiny()
    runs = {}
    for recompute in (False, True):
        model = copy.deepcopy(base)
        strategy = PipeMareStrategy(
            stages=3, microbatches=2, schedule=schedule, balance=[2, 2, 1], recompute=recompute
        )
        look = LookAtStages()
        t = trainer(strategy, max_steps=8, callbacks=[look])
        t.fit(model, tiny_data())
        assert look.flags == [recompute, recompute, False]
        runs[recompute] = weights(model)
    diff = max((a - b).abs().max().item() for a, b in zip(runs[False], runs[True], strict=True))
    if schedule == "1f1b":
        assert diff < 1e-6
    else:
        assert diff > 1e-6  # activations rerun at backward-time weights


def test_recompute_must_be_true_or_false():
    with pytest.raises(ValueError, match="recompute must be True or False, got 'yes'"):
        PipeMareStrategy(recompute="yes")


def test_the_run_says_which_schedule_steps_sooner_on_its_own_model(caplog):
    """The advice is measured at the first batch on this model (its layers at every N 1F1B
    could run for the batch of 12), said in the run's first lines and kept in its settings;
    which schedule it names depends on this machine's timings, so only its form is checked
    here (tests/planner/test_decide.py checks the choice from given times)."""
    caplog.set_level(logging.INFO)
    strategy = PipeMareStrategy(stages=2)
    trainer(strategy, max_steps=2).fit(Tiny(), tiny_data())
    advice = strategy.advice
    assert advice is not None and advice.schedule == "pipemare" and advice.microbatches == 2
    assert sorted(advice.baseline_by_n) == [1, 2, 3, 4, 6, 12]
    assert advice.baseline_s == min(advice.baseline_by_n.values()) > 0 and advice.step_s > 0
    said = next(d for d in strategy.settings.decisions if d.subject == "advice")
    # SGD with momentum: no reference task measured its family, so only the step is compared
    assert advice.family == "sgdm" and advice.quality == ()
    assert (
        said.choice == advice.verdict == f"{advice.steps_sooner} steps sooner; quality not measured"
    )
    assert f"'1f1b' at its fastest N={advice.baseline_n}" in said.reason
    assert f"pipemare:   advice: {advice.verdict} (a step replayed" in caplog.text
    quiet = PipeMareStrategy(stages=2, advise=False)
    trainer(quiet, max_steps=2).fit(Tiny(), tiny_data())
    assert quiet.advice is None
    assert all(d.subject != "advice" for d in quiet.settings.decisions)
    # BatchNorm cannot train on one row: its advice times 1F1B at two rows a microbatch or more
    normed = Tiny()
    normed.net[1] = nn.BatchNorm1d(16)
    strategy = PipeMareStrategy(stages=2)
    trainer(strategy, max_steps=2).fit(normed, tiny_data())
    assert strategy.advice is not None and sorted(strategy.advice.baseline_by_n) == [1, 2, 3, 4, 6]


def _busy(seconds):
    """Spend ``seconds`` of this thread's CPU (any clock the timings read moves as much)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class CostlyStep(Tiny):
    """A training step with 10 ms of code before its model and a head of 20 ms after it, once
    per microbatch: its loss, a torchmetrics mean of it and its logs, and what Lightning's docs
    show for epoch-end hooks (each step's output kept in a list), a counter and a sum."""

    def __init__(self, before_s=0.01, head_s=0.02):
        super().__init__()
        from torchmetrics import MeanMetric

        self.mean_loss = MeanMetric()
        self.outputs, self.heads, self.total = [], 0, torch.zeros(())
        self.before_s, self.head_s = before_s, head_s

    def training_step(self, batch, batch_idx):
        x, y = batch
        _busy(self.before_s)
        out = self.net(x)
        _busy(self.head_s)
        loss = F.cross_entropy(out, y)
        self.mean_loss(loss)
        self.log("mean_loss", self.mean_loss, on_step=True, on_epoch=True)
        self.outputs.append(loss.detach())
        self.heads += 1
        self.total += loss.detach()
        type(self).runs_anywhere += 1  # outside the module's own state: not put back
        return loss

    runs_anywhere = 0


def test_the_step_code_around_the_model_is_charged_where_it_runs_and_its_timing_changes_nothing():
    """The advice replays the whole training step: the code before the model on the first
    stage and the head after it on the last, once per microbatch, so that a step of N
    microbatches takes N heads at least, for the run's schedule and for 1F1B at each N.
    Timing them at setup runs the user's step on the first batch; the run then trains, logs
    and counts its metric exactly as a run that did not time them (balance and N given)."""
    strategy = PipeMareStrategy(stages=2)
    trainer(strategy, max_steps=2).fit(CostlyStep(), tiny_data())
    advice = strategy.advice
    assert advice is not None and advice.microbatches == 2
    assert advice.step_s >= 2 * 0.02
    assert all(step >= n * 0.02 for n, step in advice.baseline_by_n.items())
    runs = {}
    for advise in (True, False):
        pl.seed_everything(0)
        model = CostlyStep()
        CostlyStep.runs_anywhere = 0
        strategy = PipeMareStrategy(stages=2, microbatches=2, balance=[3, 2], advise=advise)
        t = trainer(strategy, max_steps=3)
        t.fit(model, tiny_data())
        assert (strategy.advice is not None) == advise
        assert model.heads == len(model.outputs) == 3 * 2  # the run's own heads only
        # with N, the cut and the advice all fixed, nothing is timed: the step runs only in
        # the run (docs/troubleshooting.md says how to skip the timing)
        assert (CostlyStep.runs_anywhere > 3 * 2) == advise
        runs[advise] = (weights(model), dict(t.callback_metrics), model.outputs, model.total)
    (timed, timed_logs, timed_outs, timed_sum), (plain, plain_logs, plain_outs, plain_sum) = (
        runs[True],
        runs[False],
    )
    assert all(torch.equal(a, b) for a, b in zip(timed, plain, strict=True))
    assert timed_logs.keys() == plain_logs.keys() >= {"mean_loss_step", "mean_loss_epoch"}
    assert all(torch.equal(timed_logs[k], plain_logs[k]) for k in timed_logs)
    assert all(torch.equal(a, b) for a, b in zip(timed_outs, plain_outs, strict=True))
    assert torch.equal(timed_sum, plain_sum)


def test_balance_auto_profiles_the_training_steps_head_with_the_last_layer(monkeypatch):
    """The planner's profile (balance="auto") times the loss as the run computes it, the
    user's head included, on the last layer; the run keeps only its own heads' outputs."""
    from pipemare import planner

    profiles = []
    real = planner.profile

    def kept(*args, **kwargs):
        profiles.append(real(*args, **kwargs))
        return profiles[-1]

    monkeypatch.setattr(planner, "profile", kept)
    model = CostlyStep(before_s=0.0, head_s=0.005)
    strategy = PipeMareStrategy(stages=2, balance="auto")
    trainer(strategy, max_steps=2).fit(model, tiny_data())
    (profiled,) = profiles
    # a lower bound only: the profile reads the wall clock, which a busy machine lengthens
    assert profiled.layers[0][-1].forward_s >= 0.005
    assert model.heads == len(model.outputs) == 2 * strategy.microbatches


def test_the_engines_own_times_are_measured_once_per_process_for_each_kind_of_optimiser(
    monkeypatch,
):
    """The engine's seconds per action (a pipeline of trivial layers, not the model) are
    measured at a process's first run of each schedule, optimiser kind, corrections and
    device; the next run with another rate reuses them; another optimiser measures its own."""
    from pipemare import planner
    from pipemare.lightning import runner

    measured: list[str] = []
    real = planner.engine_overhead

    def counted(schedule, *args, **kwargs):
        measured.append(schedule)
        return real(schedule, *args, **kwargs)

    monkeypatch.setattr(planner, "engine_overhead", counted)
    monkeypatch.setattr(runner, "OVERHEADS", {})

    def advised(module):
        strategy = PipeMareStrategy(stages=2)
        trainer(strategy, max_steps=2).fit(module, tiny_data())
        assert strategy.advice is not None
        return strategy.advice

    first = advised(Tiny(lr=0.05))
    schedules = sorted(measured)
    assert schedules and len(set(schedules)) == len(schedules)  # one measurement a schedule
    again = advised(Tiny(lr=0.01))  # another rate: the same kind of optimiser
    assert sorted(measured) == schedules
    assert again.baseline_by_n.keys() == first.baseline_by_n.keys()

    class WithAdam(Tiny):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.lr)

    advised(WithAdam())
    assert sorted(measured) == sorted(schedules * 2)


def test_balance_auto_takes_the_planners_cut():
    """balance="auto" profiles the layers (time, memory, the engine's costs) and cuts where
    the planner says; the cut is used, logged and kept for later rebuilds."""
    from pipemare import planner

    pl.seed_everything(0)
    model = Tiny()
    strategy = PipeMareStrategy(stages=2, microbatches=2, balance="auto")
    t = trainer(strategy, max_steps=3)
    t.fit(model, tiny_data())
    cut = strategy.balance
    assert isinstance(cut, list) and sum(cut) == len(model.net) and len(cut) == 2
    assert min(cut) >= 1
    strategy._runner.pipeline = None  # as after a consolidation: the next run rebuilds it
    calls = []
    real = planner.profile  # the measurement the planner's cut is decided from
    planner.profile = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        t.validate(model, tiny_data())
        assert strategy.balance == cut and calls == []  # rebuilt with the same cut, not re-planned
        assert strategy.pipeline is not None and list(strategy.pipeline.balance) == cut
        strategy._runner.pipeline = strategy._runner.plan = None  # a first build measures
        t.validate(model, tiny_data())
        assert len(calls) == 1
    finally:
        planner.profile = real
    # A fresh measurement may cut elsewhere (the layers' times are this machine's, and noisy):
    # whatever it decided is what the pipeline runs.
    replanned = strategy.balance
    assert isinstance(replanned, list) and sum(replanned) == len(model.net)
    assert strategy.pipeline is not None and list(strategy.pipeline.balance) == replanned


def test_a_layer_the_user_keeps_in_eval_mode_stays_there():
    """E.g. a frozen BatchNorm put in eval mode at each epoch's start: the strategy leaves the
    modes of a Sequential's layers as the module sets them."""

    class KeepsOneInEval(Tiny):
        def on_train_epoch_start(self):
            self.net[1].eval()

    model = KeepsOneInEval()
    trainer(PipeMareStrategy(stages=2), max_steps=3).fit(model, tiny_data())
    assert not model.net[1].training and model.net[0].training
