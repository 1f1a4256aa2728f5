"""Lightning's gradient hooks under the strategy: once per stage update, with that stage's
gradients (non-flushing schedules); once per step with the whole model's, as a plain one-device
Trainer runs them (gpipe and 1f1b in one process); ``configure_gradient_clipping`` replacing the
engine's clipping; their logs reach Lightning. Real Trainers in one process (simulated
stages); two processes in test_gradient_hooks_distributed.py."""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F

from pipemare import PipeMareStrategy
from pipemare.engine.lagged import snapshot_lag
from support.models import quiet_trainer, three_class_points

STEPS, BATCH = 6, 12


class Tiny(pl.LightningModule):
    """Three Linear layers; a copy of each gradient hook's view is kept for the test."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        )
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Watching(Tiny):
    """Records what each gradient hook sees: the update, the gradients present, the loss."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.after_backward: list[tuple[tuple[int, int], dict[str, torch.Tensor]]] = []
        self.before_step: list[tuple[int, int]] = []
        self.losses: list[float] = []

    def _grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}

    def on_before_backward(self, loss):
        self.losses.append(float(loss.detach()))

    def on_after_backward(self):
        self.after_backward.append((self.trainer.strategy.update, self._grads()))

    def on_before_optimizer_step(self, optimizer):
        assert optimizer is self.trainer.optimizers[0]
        self.before_step.append(self.trainer.strategy.update)


class CountingCallback(pl.Callback):
    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[int, int] | None]] = {}

    def _count(self, name, trainer):
        self.calls.setdefault(name, []).append(trainer.strategy.update)

    def on_before_backward(self, trainer, pl_module, loss):
        self._count("on_before_backward", trainer)

    def on_after_backward(self, trainer, pl_module):
        self._count("on_after_backward", trainer)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._count("on_before_optimizer_step", trainer)


def data():
    return three_class_points(STEPS * BATCH, BATCH)


def plain_gradients(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """The gradient of each batch of :func:`data` at ``model``'s weights, on one device."""
    out = []
    for x, y in data():
        model.zero_grad()
        F.cross_entropy(model.net(x), y).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


def test_hooks_fire_once_per_stage_update_with_that_stages_gradients():
    # lr = 0: every minibatch's gradient is the plain model's gradient of that batch, whatever
    # the staleness, so each stage's view can be checked exactly.
    pl.seed_everything(0)
    model, callback = Watching(lr=0.0), CountingCallback()
    reference = plain_gradients(copy.deepcopy(model))
    strategy = PipeMareStrategy(stages=3, microbatches=2, schedule="pipemare", balance=[2, 2, 1])
    quiet_trainer(strategy, max_steps=STEPS, callbacks=[callback]).fit(model, data())

    # stage i's Linear; the other stages hold partial gradients of minibatches in flight
    stages = {i: {f"net.{2 * i}.weight", f"net.{2 * i}.bias"} for i in range(3)}
    updates = [u for u, _ in model.after_backward]
    assert sorted(updates) == [(i, k) for i in range(3) for k in range(STEPS)]  # the drain too
    assert model.before_step == updates
    for (stage, k), grads in model.after_backward:
        assert set(grads) == stages[stage]
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[k][name], rtol=1e-5, atol=1e-7)
    assert len(model.losses) == 2 * STEPS  # once per microbatch, on the last stage
    assert callback.calls["on_after_backward"] == updates
    assert callback.calls["on_before_optimizer_step"] == updates
    assert callback.calls["on_before_backward"] == [None] * (2 * STEPS)  # not within an update
    assert model.trainer.strategy.update is None


class LikeOneDevice(Tiny):
    """Logs ``grad_norm`` from ``on_before_optimizer_step`` and records what every gradient
    hook sees; clips by norm in ``configure_gradient_clipping``."""

    CLIP = 0.3

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        self.seen: dict[str, list] = {}

    def _record(self, hook: str, value: object) -> None:
        self.seen.setdefault(hook, []).append(value)

    def on_before_backward(self, loss):
        self._record("loss", (float(loss.detach()), loss.requires_grad))

    def on_after_backward(self):
        grads = {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}
        self._record("after_backward", grads)

    def on_before_optimizer_step(self, optimizer):
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]))
        self._record("grad_norm", norm)
        self.log("grad_norm", norm)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val, gradient_clip_algorithm):
        self.clip_gradients(optimizer, self.CLIP, "norm")


class LikeOneDeviceCallback(pl.Callback):
    """The same from a callback: ``callback/grad_norm`` logged, the hooks' views recorded."""

    def __init__(self) -> None:
        self.seen: dict[str, list] = {}

    def _record(self, hook: str, value: object) -> None:
        self.seen.setdefault(hook, []).append(value)

    def on_before_backward(self, trainer, pl_module, loss):
        self._record("loss", float(loss.detach()))

    def on_after_backward(self, trainer, pl_module):
        present = sorted(n for n, p in pl_module.named_parameters() if p.grad is not None)
        self._record("after_backward", present)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()]))
        self._record("grad_norm", norm)
        pl_module.log("callback/grad_norm", norm)


def _run_like_one_device(base, strategy):
    model, callback, snap = LikeOneDevice(), LikeOneDeviceCallback(), Snapshot()
    model.load_state_dict(base.state_dict())
    quiet_trainer(strategy, max_steps=STEPS, callbacks=[callback, snap]).fit(model, data())
    return model, callback, snap.logged


@pytest.mark.parametrize(("schedule", "microbatches"), [("gpipe", 2), ("1f1b", 3)])
def test_in_one_process_a_flushing_schedule_runs_the_hooks_as_one_device(schedule, microbatches):
    pl.seed_everything(0)
    base = LikeOneDevice()
    one, one_callback, one_logged = _run_like_one_device(base, "auto")  # a plain Trainer
    strategy = PipeMareStrategy(
        stages=2, microbatches=microbatches, schedule=schedule, balance=[2, 3]
    )
    piped, piped_callback, piped_logged = _run_like_one_device(base, strategy)

    names = {n for n, _ in base.named_parameters()}
    for model, callback in ((one, one_callback), (piped, piped_callback)):
        for hook in ("loss", "after_backward", "grad_norm"):  # once per step, module and callback
            assert len(model.seen[hook]) == len(callback.seen[hook]) == STEPS
        assert all(set(grads) == names for grads in model.seen["after_backward"])
        assert all(set(present) == names for present in callback.seen["after_backward"])
        assert all(requires_grad for _, requires_grad in model.seen["loss"])
    assert max(one.seen["grad_norm"]) > LikeOneDevice.CLIP  # the override clipped some steps

    for mine, theirs in zip(piped.seen["after_backward"], one.seen["after_backward"], strict=True):
        for name in names:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-7)
    for hook in ("loss", "grad_norm"):
        assert [v[0] if hook == "loss" else v for v in piped.seen[hook]] == pytest.approx(
            [v[0] if hook == "loss" else v for v in one.seen[hook]], rel=1e-5
        )
        assert piped_callback.seen[hook] == pytest.approx(one_callback.seen[hook], rel=1e-5)
    # logged at the step itself, as on one device
    assert len(piped_logged) == len(one_logged) == STEPS
    for mine, theirs in zip(piped_logged, one_logged, strict=True):
        assert set(mine) >= {"grad_norm", "callback/grad_norm"}
        for key in ("grad_norm", "callback/grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5)
    for a, b in zip(weights(piped), weights(one), strict=True):  # clipped as on one device
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert piped.trainer.strategy.update is None


class Tied(LikeOneDevice):
    """One Linear used on both stages (a tied weight across the cut)."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(16, 16)
        self.net = nn.Sequential(nn.Linear(5, 16), shared, nn.Tanh(), shared, nn.Linear(16, 3))


def test_in_one_process_a_tied_weights_gradient_is_whole_in_the_hooks():
    pl.seed_everything(0)
    base = Tied()
    runs = []
    for strategy in ("auto", PipeMareStrategy(stages=2, schedule="gpipe", balance=[2, 3])):
        model = Tied()
        model.load_state_dict(base.state_dict())
        quiet_trainer(strategy, max_steps=STEPS).fit(model, data())
        runs.append(model)
    piped, one = runs[1], runs[0]
    assert len(piped.seen["after_backward"]) == STEPS
    for mine, theirs in zip(piped.seen["after_backward"], one.seen["after_backward"], strict=True):
        assert set(mine) == set(theirs)
        for name in theirs:  # net.1.weight: both stages' contributions summed
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-7)
    for a, b in zip(weights(piped), weights(one), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class ClipsItself(Tiny):
    def __init__(self, value=None, algorithm=None) -> None:
        super().__init__()
        self.value, self.algorithm = value, algorithm

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        if self.value is not None:
            self.clip_gradients(optimizer, self.value, self.algorithm)


def _train(model, schedule, **trainer_options):
    strategy = PipeMareStrategy(stages=3, microbatches=2, schedule=schedule, balance=[2, 2, 1])
    quiet_trainer(strategy, max_steps=STEPS, **trainer_options).fit(model, data())
    return weights(model)


@pytest.mark.parametrize(
    ("schedule", "algorithm"), [("pipemare", "norm"), ("gpipe", "value"), ("async", "value")]
)
def test_configure_gradient_clipping_clips_as_the_trainers_setting_does(schedule, algorithm):
    pl.seed_everything(0)
    base = Tiny()
    value = 0.3 if algorithm == "norm" else 0.02
    by_trainer = _train(
        copy.deepcopy(base), schedule, gradient_clip_val=value, gradient_clip_algorithm=algorithm
    )
    own = ClipsItself(value, algorithm)
    own.load_state_dict(base.state_dict())
    by_hook = _train(own, schedule)
    unclipped = _train(copy.deepcopy(base), schedule)
    for a, b in zip(by_hook, by_trainer, strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(by_hook, unclipped, strict=True))


def test_an_override_that_does_not_clip_replaces_the_trainers_clipping():
    pl.seed_everything(0)
    base = Tiny()
    own = ClipsItself()  # clips nothing
    own.load_state_dict(base.state_dict())
    ignored = _train(own, "pipemare", gradient_clip_val=0.3)
    unclipped = _train(copy.deepcopy(base), "pipemare")
    clipped = _train(copy.deepcopy(base), "pipemare", gradient_clip_val=0.3)
    for a, b in zip(ignored, unclipped, strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(ignored, clipped, strict=True))


def test_watching_hooks_leave_training_bit_identical():
    pl.seed_everything(0)
    base = Tiny()
    watched = Watching()
    watched.load_state_dict(base.state_dict())
    hooked = _train(watched, "pipemare", gradient_clip_val=0.3)
    plain = _train(copy.deepcopy(base), "pipemare", gradient_clip_val=0.3)
    assert watched.after_backward  # the hooks ran
    for a, b in zip(hooked, plain, strict=True):
        assert torch.equal(a, b)


class LogsNorms(Tiny):
    """Logs each parameter's gradient norm and the update's minibatch, as many modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: dict[int, dict[str, float]] = {}

    def on_before_optimizer_step(self, optimizer):
        _, k = self.trainer.strategy.update
        for name, p in self.named_parameters():
            if p.grad is not None:
                norm = float(p.grad.norm())
                self.norms.setdefault(k, {})[f"grad/{name}"] = norm
                self.log(f"grad/{name}", norm)
        self.log("updated", float(k), reduce_fx="max")


class Snapshot(pl.Callback):
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append({k: float(v) for k, v in trainer.logged_metrics.items()})


def test_values_logged_in_the_hooks_reach_lightning_per_minibatch_at_a_fixed_lag():
    pl.seed_everything(0)
    model, snap = LogsNorms(), Snapshot()
    strategy = PipeMareStrategy(stages=3, microbatches=2, schedule="pipemare", balance=[2, 2, 1])
    quiet_trainer(strategy, max_steps=STEPS, callbacks=[snap]).fit(model, data())
    lag = snapshot_lag("pipemare", 3, 2) + 1
    names = {f"grad/{n}" for n, _ in model.named_parameters()}
    for t, logged in enumerate(snap.logged):
        k = t - lag
        if k < 0:
            assert "updated" not in logged
            continue
        assert logged["updated"] == k
        assert {n for n in logged if n.startswith("grad/")} == names
        for name in names:
            assert logged[name] == pytest.approx(model.norms[k][name], rel=1e-6)


def test_nothing_is_installed_where_no_hook_is_overridden():
    pl.seed_everything(0)
    strategy = PipeMareStrategy(stages=2, microbatches=2, balance=[2, 3])
    quiet_trainer(strategy, max_steps=2, gradient_clip_val=0.3).fit(Tiny(), data())
    executor = strategy.pipeline.executor
    assert strategy._runner.hooks is None
    assert executor.on_update is None and executor.on_loss is None
    assert executor.clip is not None and executor.clip.value == 0.3  # the Trainer's clipping


class TwoOptimisers(Watching):
    """Manual optimisation with two optimisers: weights and biases apart."""

    def __init__(self) -> None:
        super().__init__(lr=0.0)
        self.automatic_optimization = False
        self.optimisers_seen: list[object] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.optimisers_seen.append(optimizer)

    def configure_optimizers(self):
        named = list(self.named_parameters())
        return [
            torch.optim.SGD([p for n, p in named if n.endswith("weight")], lr=0.0),
            torch.optim.SGD([p for n, p in named if n.endswith("bias")], lr=0.0),
        ]


def test_manual_optimisation_gets_one_on_before_optimizer_step_per_optimiser():
    pl.seed_everything(0)
    model = TwoOptimisers()
    reference = plain_gradients(copy.deepcopy(model))
    strategy = PipeMareStrategy(stages=2, microbatches=2, balance=[2, 3])
    quiet_trainer(strategy, max_steps=2 * STEPS).fit(model, data())  # two steps per batch
    updates = [u for u, _ in model.after_backward]
    assert sorted(updates) == [(i, k) for i in (0, 1) for k in range(STEPS)]
    assert model.optimisers_seen == model.trainer.optimizers * len(updates)
    for (_, k), grads in model.after_backward:
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[k][name], rtol=1e-5, atol=1e-7)


# -- what a pipeline cannot honour is refused; what it can, it honours ---------------------------


class OwnBackward(Tiny):
    def backward(self, loss, *args, **kwargs):
        loss.backward(retain_graph=True)


class OwnZeroGrad(Tiny):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if batch_idx % 2 == 0:  # accumulate over two batches
            optimizer.zero_grad()


class OwnManualBackward(TwoOptimisers):
    def manual_backward(self, loss, *args, **kwargs):
        super().manual_backward(loss * 0.5, *args, **kwargs)


class ClosureOutsideStep(Tiny):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer_closure()  # e.g. to step only every other batch
        if batch_idx % 2 == 0:
            optimizer.step()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            OwnBackward,
            r"OwnBackward overrides backward, but pipemare runs each microbatch's backward "
            r"pass itself, stage by stage, so Lightning never calls it. Remove the override",
        ),
        (
            OwnZeroGrad,
            r"OwnZeroGrad overrides optimizer_zero_grad, but pipemare zeroes each stage's "
            r"gradients itself, right after that stage's update .* Remove it; to accumulate "
            r"over more samples, raise PipeMareStrategy\(microbatches=N\)",
        ),
        (
            OwnManualBackward,
            r"OwnManualBackward overrides manual_backward, but pipemare takes the loss passed "
            r"to self.manual_backward .* Remove it; to scale the loss, scale it before",
        ),
        (
            ClosureOutsideStep,
            r"ClosureOutsideStep.optimizer_step ran training_step by calling the closure "
            r"itself, not through optimizer.step\(closure=optimizer_closure\); .* cannot skip "
            r"or defer them. Call optimizer.step\(closure=optimizer_closure\) once in it",
        ),
    ],
    ids=["backward", "optimizer_zero_grad", "manual_backward", "closure-outside-step"],
)
def test_an_override_the_pipeline_cannot_honour_is_refused_before_any_update(model, message):
    pl.seed_everything(0)
    module = model()
    before = weights(module)
    strategy = PipeMareStrategy(stages=2, microbatches=2, schedule="gpipe", balance=[2, 3])
    with pytest.raises(ValueError, match=message):
        quiet_trainer(strategy, max_steps=STEPS).fit(module, data())
    for a, b in zip(weights(module), before, strict=True):
        assert torch.equal(a, b)


class WarmsUp(Tiny):
    """A learning-rate warm-up in optimizer_step, as Lightning's docs show it."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        for group in optimizer.param_groups:
            group["lr"] = self.lr * min(1.0, (self.trainer.global_step + 1) / 4)
        optimizer.step(closure=optimizer_closure)


class ClipsByValue(Tiny):
    def clip_gradients(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().clip_gradients(optimizer, 0.02, "value")


@pytest.mark.parametrize("model", [WarmsUp, ClipsByValue])
def test_an_override_of_optimizer_step_or_clip_gradients_runs_as_on_one_device(model):
    pl.seed_everything(0)
    base = model()
    trained = []
    for strategy in ("auto", PipeMareStrategy(stages=2, schedule="gpipe", balance=[2, 3])):
        module = model()
        module.load_state_dict(base.state_dict())
        quiet_trainer(strategy, max_steps=STEPS).fit(module, data())
        trained.append(weights(module))
    for a, b in zip(trained[1], trained[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    plain = Tiny()  # without the override, one device ends elsewhere: the override did act
    plain.load_state_dict(base.state_dict())
    quiet_trainer("auto", max_steps=STEPS).fit(plain, data())
    assert not all(torch.allclose(a, b) for a, b in zip(weights(plain), trained[0], strict=True))
