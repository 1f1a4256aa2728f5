"""StalenessMonitor: how stale each stage's gradients are, derived and as measured."""

from __future__ import annotations

import statistics
from typing import Any

import pytorch_lightning as pl

from pipemare.callbacks import _common as common


class StalenessMonitor(common.Monitor):
    """Logs, per stage: the delays the schedule implies and the ones measured from the weight
    versions the passes actually used; the forward/backward weight discrepancy
    ``||w_fwd - w_bkwd|| / ||w||`` with T2's correction (what the backward used) and without it
    (the live weights); the effective learning rate (every correction's factor on it); the
    microbatches in flight; and on a stage that holds a copy of a weight tied to an earlier stage
    (:mod:`pipemare.engine.ties`), the delay of the weights that copy ran on: the owner's forward
    delay.

    Metric names: ``pipemare/stage{i}/{tau_fwd, tau_bkwd, tau_fwd_measured, tau_bkwd_measured,
    discrepancy, discrepancy_uncorrected, lr, in_flight}``, ``guard`` (the stability guard's
    factor on the stage's rate and corrections, 1 while calm) where the guard runs, and
    ``tau_tied``, ``tau_tied_measured`` on a stage holding a tied weight's copy. A logging window
    that contains a pipeline (re)fill, after a drain for validation, measures smaller delays than
    the steady state.

    The discrepancy is sampled on every ``discrepancy_every_n_steps``-th minibatch, starting
    with the first, and logged by the first logging step after the sample's backward: so every
    stage has it from early on (0 while no update has come between a sample's passes: on the
    last stage always, on the others during the fill), then about every
    ``discrepancy_every_n_steps`` steps; a window without a sample logs none.

    Args:
        log_every_n_steps: logging interval (default: the Trainer's ``log_every_n_steps``).
        discrepancy_every_n_steps: how often a stage copies its weights at a forward to measure
            the discrepancy at the backward (0: never; each sample costs one weight copy).
    """

    def __init__(
        self, log_every_n_steps: int | None = None, discrepancy_every_n_steps: int = 50
    ) -> None:
        super().__init__(log_every_n_steps)
        self.discrepancy_every_n_steps = discrepancy_every_n_steps
        self._discrepancy: list[Any] = []

    def _watch(self, trainer: pl.Trainer, strategy: common.PipelinedStrategy) -> None:
        strategy.request_probe(delays=True, discrepancy_every=self.discrepancy_every_n_steps)

    def _after_batch(
        self, trainer: pl.Trainer, outputs: Any, batch: Any, watched: common.Watched
    ) -> None:
        if watched is None:
            return
        pipe, probe = watched
        self._discrepancy += probe.take_discrepancy()
        if not self._due(trainer):
            return
        local: dict[int, dict[str, float]] = {}
        for i, fwd, bkwd in _mean_delays(probe.take_delays()):
            local.setdefault(i, {}).update(tau_fwd_measured=fwd, tau_bkwd_measured=bkwd)
        for i, (corrected, uncorrected) in _mean_discrepancy(self._discrepancy).items():
            local.setdefault(i, {}).update(
                discrepancy=corrected, discrepancy_uncorrected=uncorrected
            )
        self._discrepancy = []
        last = max(pipe.minibatches_fed - 1, 0)
        user_lr = float(pipe.optimizer.param_groups[0]["lr"])
        guard = pipe.optimizer.guard
        for stage in pipe.stages:  # the rate and the guard's state live with the stage
            mine = local.setdefault(stage.index, {})
            mine["in_flight"] = float(stage.in_flight)
            mine["lr"] = user_lr * pipe.optimizer.lr_factor(stage.index, last)
            if guard is not None:
                mine["guard"] = guard.factor(stage.index)
        for tie in pipe.ties.ties:  # a tied weight's copy runs on the owner's earlier weights
            for i in set(tie.copies) & set(pipe.local_stages):
                local.setdefault(i, {})["tau_tied_measured"] = pipe.ties.delay(tie, i)
        stats = common.gather_stages(trainer, local)
        for i, d in enumerate(pipe.delays):
            stats.setdefault(i, {}).update(tau_fwd=d.forward, tau_bkwd=d.backward)
        for tie in pipe.ties.ties:  # derived: the owner's forward delay
            for i in tie.copies:
                stats.setdefault(i, {})["tau_tied"] = pipe.delays[tie.owner].forward
        self._log_stages(trainer, stats)


def _mean_delays(delays: list[tuple[int, int, int, int]]) -> list[tuple[int, float, float]]:
    per_stage: dict[int, list[tuple[int, int]]] = {}
    for stage, _, fwd, bkwd in delays:
        per_stage.setdefault(stage, []).append((fwd, bkwd))
    return [
        (i, statistics.fmean(f for f, _ in v), statistics.fmean(b for _, b in v))
        for i, v in sorted(per_stage.items())
    ]


def _mean_discrepancy(samples: list[Any]) -> dict[int, tuple[float, float]]:
    per_stage: dict[int, list[Any]] = {}
    for s in samples:  # with no update between the passes (delay 0) it measures 0, as it is
        per_stage.setdefault(s.stage, []).append(s)
    return {
        i: (statistics.fmean(s.corrected for s in v), statistics.fmean(s.uncorrected for s in v))
        for i, v in per_stage.items()
    }
