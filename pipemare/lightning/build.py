"""Building the pipeline at the first batch (timing the layers needs one): the cut, the user's
optimiser, the transport between stages, where results are published, the telemetry asked for.

The functions take the strategy (a ``PipeMareStrategy``) and read its settings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipemare.engine.lagged import DistributedResults, LocalResults, Results
from pipemare.engine.microbatch import scatter
from pipemare.engine.pipeline import Pipeline
from pipemare.engine.telemetry import Probe
from pipemare.engine.transport import DistributedTransport
from pipemare.lightning import launching
from pipemare.lightning.manual import steps_per_batch
from pipemare.lightning.steps import check_last_batch, merge_published
from pipemare.model import cuts, partition
from pipemare.optim.chain import ChainedOptimizer, copies_of

__all__ = [
    "ProbeRequests",
    "balance_for",
    "check_cut",
    "pipeline",
    "prepare_model",
    "results",
    "stepped",
    "user_optimizer",
]


class ProbeRequests:
    """The telemetry pipemare's monitors ask for (:class:`pipemare.engine.telemetry.Probe`),
    merged over the monitors and attached to the pipeline once it exists."""

    def __init__(self) -> None:
        self.settings: dict[str, Any] = {}

    def request(self, **settings: Any) -> None:
        """Switches are or-ed, intervals take the shortest asked for."""
        for key, value in settings.items():
            old = self.settings.get(key)
            if isinstance(value, bool):
                self.settings[key] = bool(old) or value
            elif value:
                self.settings[key] = min(old, value) if old else value

    def attach(self, pipe: Pipeline) -> None:
        if not self.settings:
            return
        if pipe.probe is None:
            pipe.probe = Probe()
        assert pipe.probe is not None
        pipe.probe.merge(**self.settings)


def stepped(optimizers: Sequence[Any]) -> Any:
    """What the pipeline steps of ``optimizers`` (one or more): the one, or all chained."""
    return optimizers[0] if len(optimizers) == 1 else ChainedOptimizer(optimizers)


def user_optimizer(optimizers: Sequence[Any], seq: nn.Sequential) -> torch.optim.Optimizer:
    """The optimiser ``configure_optimizers`` returned (several, under manual optimisation:
    chained, :class:`~pipemare.optim.chain.ChainedOptimizer`), or a stand-in that never steps."""
    # Lightning's stand-in when configure_optimizers returns None is not the user's
    if optimizers and type(optimizers[0]).__name__ != "_MockOptimizer":
        return stepped(optimizers)
    return torch.optim.SGD(seq.parameters(), lr=0.0)  # never stepped with a real rate


def check_cut(strategy: Any) -> int | None:
    """P, after refusing a cut that cannot be made; None while the pipelined module waits to
    be cut into segments (at the first batch)."""
    adapter = strategy._adapter
    if adapter.sequential is None:
        return None
    return cuts.check_cut(
        adapter.what,
        adapter.sequential,
        strategy.balance,
        strategy.stages,
        strategy.num_stages,
        strategy.distributed,
    )


def prepare_model(strategy: Any, batch: Any, step: str, args: tuple) -> None:
    """At the first batch: refuse a last batch too small to split; cut a pipelined module that
    is not a Sequential into segments, from what the step passes it, and check the cut."""
    if strategy._fitting:
        check_last_batch(strategy._module.trainer, strategy.microbatches)
    adapter = strategy._adapter
    if adapter.sequential is None:
        with strategy._steps_of().discarding_logs(), torch.random.fork_rng(devices=[]):
            adapter.prepare(step, batch, *args)
        check_cut(strategy)


def balance_for(strategy: Any, sample: Any, step: str, args: tuple) -> list[int]:
    """Layers per stage: as the run a resume continues cut them, given, or chosen now."""
    seq = strategy._adapter.sequential
    stages = strategy.num_stages or len(seq)
    saved = (strategy._pending_state or {}).get("layout")
    if isinstance(strategy.balance, str) and saved and saved["stages"] == stages:
        return list(saved["balance"])  # a resume cuts as the run it continues did
    return _choose_balance(strategy, seq, stages, sample, step, args)


def _choose_balance(
    strategy: Any, seq: nn.Sequential, stages: int, sample: Any, step: str, args: tuple
) -> list[int]:
    if not isinstance(strategy.balance, str):
        return list(strategy.balance)
    if strategy.balance == "even" or stages == len(seq):
        return partition.even_balance(len(seq), stages)
    if strategy.balance == "params":
        return partition.balance_by_params(seq, stages)
    balance = None
    if strategy.global_rank == 0:  # time on one process, so every process cuts alike
        adapter = strategy._adapter
        with strategy._steps_of().discarding_logs(), torch.random.fork_rng(devices=[]):
            x = adapter.capture_input(step, scatter(sample, strategy.microbatches)[0], *args)
            if strategy.balance == "auto":
                balance = _plan_balance(strategy, seq, x, stages)
            else:
                with strategy.precision_plugin.forward_context():  # time what will run
                    balance = partition.balance_by_time(seq, x, stages)
    return strategy.broadcast(balance, src=0)


def _plan_balance(strategy: Any, seq: nn.Sequential, x: Any, stages: int) -> list[int]:
    """``balance="auto"``: the planner's cut for this P and N (:mod:`pipemare.planner`),
    from a profile of the layers with the run's optimiser type and corrections."""
    from pipemare.planner import auto_balance

    opt = user_optimizer(strategy.optimizers, seq)
    return auto_balance(
        seq,
        x,
        stages,
        strategy.microbatches,
        strategy.schedule,
        optimizer=copies_of(opt, seq.parameters()),  # its groups and kinds of state
        config=strategy.config,
        forward_context=strategy.precision_plugin.forward_context,
    )


def _run_length(trainer: Any, fitting: bool) -> dict[str, Any]:
    """The run's optimiser steps and steps per epoch, for T1's horizon, where known."""
    if not fitting:
        return {}
    out = {}
    total = trainer.estimated_stepping_batches
    per_batch = steps_per_batch(trainer)  # several optimisers: max_steps counts each one
    if per_batch > 1 and trainer.max_steps != -1:
        total = min(total, math.ceil(trainer.max_steps / per_batch))
    if isinstance(total, (int, float)) and math.isfinite(total):
        out["total_steps"] = int(total)
    per_epoch = trainer.num_training_batches
    if isinstance(per_epoch, (int, float)) and math.isfinite(per_epoch):
        out["steps_per_epoch"] = int(per_epoch)
    return out


def _clipping(trainer: Any, fitting: bool) -> dict[str, Any]:
    """The Trainer's gradient clipping as the pipeline's keyword (none outside fit)."""
    clip_val = trainer.gradient_clip_val if fitting else None
    algorithm = trainer.gradient_clip_algorithm or "norm"
    if not clip_val:
        return {}
    return {"clip_grad_norm" if algorithm == "norm" else "clip_grad_value": float(clip_val)}


def pipeline(strategy: Any) -> Pipeline:
    """The strategy's Pipeline over the Sequential, cut by ``strategy.balance``; announced."""
    seq = strategy._adapter.sequential
    stages = strategy.num_stages or len(seq)
    steps = strategy._steps_of()
    trainer = strategy._module.trainer
    fitting = strategy._fitting
    pipe = Pipeline(
        seq,
        user_optimizer(strategy.optimizers, seq),
        steps.loss,
        stages=stages,
        microbatches=strategy.microbatches,
        schedule=strategy.schedule,
        balance=strategy.balance,
        config=strategy.config,
        transport=_transport(strategy),
        device=strategy.root_device,
        input_fn=steps.input,
        target_fn=lambda mb: mb,
        forward_context=strategy.precision_plugin.forward_context,
        recompute=strategy.recompute,
        **_clipping(trainer, fitting),
        **_run_length(trainer, fitting),
    )
    return pipe


def announce(strategy: Any, pipe: Pipeline) -> None:
    """One line on the run's layout: stages, cut, schedule and the corrections with their
    settings; outside fit, those of the run that trained the loaded checkpoint (evaluation
    applies none)."""
    api = strategy._lightning
    if strategy.distributed:
        api.rank_zero_info(strategy.rank_layout.describe())
    run = f"schedule {strategy.schedule!r}, N={strategy.microbatches}"
    if strategy._fitting:
        run += f", corrections: {pipe.optimizer.describe() or 'none'}"
    elif strategy._trained is not None:
        trained = strategy._trained
        described = trained.get("described")
        if described is None:  # written before the settings were saved: the names only
            described = ", ".join(trained.get("corrections", []))
        run = (
            f"evaluating a checkpoint trained with schedule {trained['schedule']!r}, "
            f"N={trained['microbatches']}, corrections: {described or 'none'}"
        )
    else:
        run += " (evaluation applies no corrections)"
    api.rank_zero_info(
        f"pipemare: {pipe.num_stages} stages "
        f"({'one per process' if strategy.distributed else 'in one process'}), "
        f"layers per stage {list(pipe.balance)}, {run}"
    )


def _transport(strategy: Any) -> Any:
    if not strategy.distributed:
        return "inprocess"
    transport = DistributedTransport(
        strategy.num_stages,
        strategy.root_device,
        stall_timeout=strategy.stall_timeout,
        layout=strategy.rank_layout,
        heartbeat_timeout=strategy.heartbeat_timeout,
    )
    # a process ended by its heartbeat thread first ends those it launched, as after an error
    transport.watchdog.reporter.on_fatal(lambda: launching.end_launched_processes(strategy))
    return transport


def results(strategy: Any, start: int) -> Results:
    """Where the last stage publishes results for every process (see pipemare.engine.lagged)."""
    if not strategy.distributed:
        return LocalResults(start)
    transport = strategy.pipeline.transport
    assert isinstance(transport, DistributedTransport)
    last = transport.rank_of(transport.num_stages - 1)
    layout = strategy.rank_layout
    merge_group = None
    if layout.replicas > 1:  # the copies' last stages combine their results first
        group = dist.new_group(list(layout.stage_groups[-1]), backend="gloo")  # on every rank
        merge_group = group if strategy.global_rank == last else None
    return DistributedResults(
        last,
        start,
        watchdog=transport.watchdog,
        ranks=layout.pipelines[transport.replica],
        merge_group=merge_group,
        merge=merge_published,
        lag=strategy.lag,
    )
