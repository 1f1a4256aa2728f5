"""Non-finite gradients never reach the weights: a stage's update with NaN/Inf gradients is
skipped and training stops naming the stage and step; the checkpoints before stay finite."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from pipemare import NonFiniteGradientError, NonFiniteLossError, Pipeline, PipeMareStrategy
from support.models import quiet_trainer

MARK = 1e6  # a sample whose first feature is this makes the backward overflow


class _Overflow(torch.autograd.Function):
    """Identity whose backward turns to Inf for rows whose input is huge (a marked sample):
    the loss stays finite (tanh saturates), the gradients of the layers before do not."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.abs().amax(dim=1, keepdim=True) > 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (marked,) = ctx.saved_tensors
        return torch.where(marked, torch.full_like(grad, math.inf), grad)


class Overflow(nn.Module):
    def forward(self, x):
        return _Overflow.apply(x)


def layers():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 16), Overflow(), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def data(marked_batch: int | None, n=96, batch=12, nan=False):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    if marked_batch is not None:
        x[marked_batch * batch + 3, 0] = math.nan if nan else MARK
    return x, y


def test_engine_skips_the_update_and_raises_naming_stage_and_step():
    model = layers()
    pipe = Pipeline(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        F.cross_entropy,
        stages=3,
        balance=[2, 2, 2],
        microbatches=2,
        schedule="gpipe",
    )
    x, y = data(marked_batch=2)
    for k in range(2):
        pipe.step((x[k * 12 : (k + 1) * 12], y[k * 12 : (k + 1) * 12]))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteGradientError) as err:
        pipe.step((x[24:36], y[24:36]))
    assert err.value.step == 3 and err.value.stage == 0
    assert err.value.names == ["0.weight", "0.bias"]  # the Linear before the overflow
    assert "step 3 on stage 0" in str(err.value)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # stage 0 did not update; the stages after it did (their gradients were finite)
    assert torch.equal(before[0], model[0].weight)


def _fit(tmp_path, x, y, monitor=None, steps=20):
    model = Module()
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)]
    trainer = quiet_trainer(
        PipeMareStrategy(stages=3, microbatches=2, balance=[2, 2, 2]),
        max_steps=steps,
        enable_checkpointing=True,
        callbacks=callbacks + ([monitor] if monitor else []),
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=12)
    return model, trainer, lambda: trainer.fit(model, loader)


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = layers()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _last_checkpoint(tmp_path):
    files = sorted(tmp_path.glob("*.ckpt"), key=lambda p: torch.load(p)["global_step"])
    return torch.load(files[-1], weights_only=False)


def test_strategy_stops_at_a_gradient_overflow_naming_stage_and_step(tmp_path):
    model, trainer, fit = _fit(tmp_path, *data(marked_batch=6))
    with pytest.raises(NonFiniteGradientError) as err:
        fit()
    assert (err.value.step, err.value.stage) == (7, 0)
    assert err.value.names == ["net.0.weight", "net.0.bias"]
    # raised when step 7's results arrived (lag 1 with 3 stages and N = 2)
    assert trainer.global_step <= 7 + trainer.strategy.lag
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ckpt = _last_checkpoint(tmp_path)
    assert ckpt["global_step"] <= 6  # checkpoints of the bad step or later were not written
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())


def test_a_nan_in_the_data_gives_the_loss_error_and_the_weights_stay_finite(tmp_path):
    model, _, fit = _fit(tmp_path, *data(marked_batch=6, nan=True))
    with pytest.raises(NonFiniteLossError, match="the loss of step 7 is nan"):
        fit()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the updates were skipped
    assert all(torch.isfinite(v).all() for v in _last_checkpoint(tmp_path)["state_dict"].values())


def test_with_a_monitor_that_warns_the_run_goes_on_past_a_nan_without_applying_it(tmp_path):
    from pipemare.callbacks import ConvergenceMonitor

    monitor = ConvergenceMonitor(on_divergence="warn")
    model, trainer, fit = _fit(tmp_path, *data(marked_batch=6, nan=True), monitor=monitor)
    with pytest.warns(UserWarning):
        fit()
    assert trainer.global_step == 20
    assert all(torch.isfinite(p).all() for p in model.parameters())
