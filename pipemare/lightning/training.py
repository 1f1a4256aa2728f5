"""What Lightning's step hooks do with the pipeline: a training step's lagged report and its
non-finite checks, the gradients kept across Lightning's zeroing, pipelined evaluation.

A training step reports what every process already has: the loss and logs of minibatch
``k - L``, ``L`` the pipeline's depth in steps (:func:`~pipemare.engine.lagged.result_lag`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipemare.engine.errors import NonFiniteGradientError, NonFiniteLossError
from pipemare.engine.lagged import Results
from pipemare.engine.microbatch import batch_size, combine, scatter
from pipemare.engine.pipeline import Pipeline
from pipemare.engine.transport import DistributedTransport
from pipemare.lightning.steps import UserSteps, closes_epoch, closes_loader

__all__ = ["Evaluation", "GradStash", "TrainingReports", "where"]


def where(pipe: Pipeline, stage: int) -> str:
    """The text ", rank r" for ``stage`` (-1: the last) with a process per stage, else ""."""
    if not isinstance(pipe.transport, DistributedTransport):
        return ""
    return f", rank {pipe.transport.rank_of(stage % pipe.num_stages)}"


class TrainingReports:
    """The training steps' lagged reports: the loss each step returns and the non-finite
    losses and gradients met on the way, raised on the step that reports them."""

    def __init__(self) -> None:
        #: where the last stage publishes each minibatch's loss and logs
        self.results: Results | None = None
        self.path = ""  # the Sequential's attribute path, naming parameters in errors
        self.last_loss = math.nan  # the latest minibatch loss reported
        self.returned = 0  # the step whose loss the latest training step returned
        # minibatch -> (stage, parameter names): updates skipped for non-finite gradients
        self.bad_grads: dict[int, tuple[int, list[str]]] = {}
        self.diverged = False  # a monitored run met a non-finite loss

    def start(self, results: Results, path: str) -> None:
        """A new pipeline publishes into ``results``."""
        self.results, self.path = results, path

    def step(
        self,
        pipe: Pipeline,
        steps: UserSteps,
        batch: Any,
        args: tuple,
        *,
        trainer: Any,
        lag: int,
        device: torch.device,
        monitored: bool,
    ) -> float:
        """Feed ``batch`` to the pipeline and return the latest loss reported (see the module).

        Args:
            monitored: a ConvergenceMonitor diagnoses a non-finite loss instead of the strategy.
        """
        steps.begin("training_step", batch, args)
        assert self.results is not None
        steps.results = self.results
        k = pipe.minibatches_fed
        pipe.step(batch)
        # Report what every process already has: minibatch k - L. Wait for more only at a
        # run's first step (Lightning needs a loss from every rank) and at an epoch's last
        # (so epoch aggregates cover exactly this epoch's minibatches).
        first = self.results.next == self.results.start
        upto = k if first or closes_epoch(trainer) else k - lag
        losses = steps.replay_through(upto, device)
        if losses:
            # the latest loss, or the first non-finite one caught up with (monitors see it)
            j = next((j for j, v in enumerate(losses) if not math.isfinite(v)), len(losses) - 1)
            self.last_loss = losses[j]
            self.returned = self.results.next - len(losses) + j + 1
            self._check_finite(pipe, losses, monitored)
        return self.last_loss

    def _check_finite(self, pipe: Pipeline, losses: list[float], monitored: bool) -> None:
        """Stop at a non-finite loss, on every process at the same step (the losses are the
        same everywhere); a ConvergenceMonitor, when attached, diagnoses it instead. Stop at
        non-finite gradients where the loss was finite, on the process that met them."""
        assert self.results is not None
        first = self.results.next - len(losses)  # the minibatch of losses[0]
        for k, loss in enumerate(losses, start=first):
            if not math.isfinite(loss):
                if not monitored:
                    raise NonFiniteLossError(k + 1, pipe.num_stages - 1, loss, where(pipe, -1))
                self.bad_grads.clear()  # the run diverged: the monitor decides from here on
                self.diverged = True
            bad = self.bad_grads.pop(k, None)
            if bad is not None and math.isfinite(loss):
                raise NonFiniteGradientError(k + 1, bad[0], bad[1], where(pipe, bad[0]))

    def record_nonfinite(self, stage: int, minibatch: int, names: list[str]) -> None:
        """The executor's ``on_nonfinite``: ``stage`` skipped ``minibatch``'s update."""
        # Raise when the minibatch's results arrive: a non-finite loss then stops every
        # process alike; a finite one means the backward itself overflowed.
        if self.diverged:
            return
        names = [f"{self.path}.{n}" for n in names]
        self.bad_grads.setdefault(minibatch, (stage, names))

    def check_unreported(self, pipe: Pipeline | None) -> None:
        """At the end of training: skipped updates of minibatches whose results never came."""
        if self.bad_grads:
            assert pipe is not None
            k, (stage, names) = min(self.bad_grads.items())
            raise NonFiniteGradientError(k + 1, stage, names, where(pipe, stage))


class GradStash:
    """Gradients kept aside while Lightning zeroes them after ``training_step``: a
    non-flushing pipeline carries partial gradients of in-flight minibatches across steps."""

    def __init__(self) -> None:
        self._kept: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    def stash(self, pipe: Pipeline) -> None:
        self._kept = []
        for i in pipe.local_stages:
            for p in pipe.optimizer.stage_parameters(i):
                self._kept.append((p, p.grad))
                p.grad = None

    def restore(self) -> None:
        for p, g in self._kept:
            p.grad = g
        self._kept = []


class Evaluation:
    """Pipelined validation, test and predict steps, numbered across every loop alike."""

    def __init__(self) -> None:
        self.results: Results | None = None
        self.index = 0  # evaluation batches run so far

    def step(
        self,
        pipe: Pipeline,
        steps: UserSteps,
        name: str,
        batch: Any,
        batch_idx: int,
        args: tuple,
        *,
        results: Callable[[int], Results],
        microbatches: int,
        ahead: int,
        trainer: Any,
        device: torch.device,
    ) -> Any:
        """Run ``batch`` through the pipeline and return the latest step output reported.

        Args:
            results: makes the results that evaluation publishes into, from a minibatch index.
            ahead: batches by which stage 0 runs ahead of the last stage (P - 1 with a process
                per stage, else 0).
        """
        steps.begin(name, batch, (batch_idx, *args))
        if self.results is None:
            self.results = results(0)
        steps.results = self.results
        j, self.index = self.index, self.index + 1
        n = min(microbatches, batch_size(batch))
        outputs = pipe.evaluate(batch, input_fn=steps.input, head=steps.head, microbatches=n)
        if outputs is not None:  # the last stage
            sizes = [batch_size(c) for c in scatter(batch, n)]
            steps.publish(j, combine(outputs, sizes))
        # With a process per stage, stage 0 runs up to P - 1 batches ahead of the last stage;
        # predictions are collected per batch, so predict reports each batch's own.
        lag = ahead if name != "predict_step" else 0
        upto = j if closes_loader(trainer, batch_idx, args) else j - lag
        values = steps.replay_through(upto, device)
        return values[-1] if values else None
