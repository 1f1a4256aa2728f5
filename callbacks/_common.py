"""What the monitors share: their base class, finding the pipeline, gathering per-stage values,
logging."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import pytorch_lightning as pl
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from pipemare.engine.pipeline import Pipeline
from pipemare.engine.telemetry import Probe
from pipemare.lightning.strategy import PipeMareStrategyMixin
from pipemare.lines import text
from pipemare.optim.config import PipeMareConfig

PREFIX = "pipemare"

#: The pipeline and its telemetry probe, or None before pipemare's strategy built both.
Watched = tuple[Pipeline, Probe] | None


class PipelinedStrategy(Protocol):
    """What the monitors read of pipemare's strategy (either Lightning package's)."""

    @property
    def schedule(self) -> str: ...

    @property
    def distributed(self) -> bool: ...

    @property
    def microbatches(self) -> int | None: ...

    @property
    def asked_config(self) -> PipeMareConfig | None: ...

    @property
    def pipeline(self) -> Pipeline | None: ...

    @property
    def reported_step(self) -> int | None: ...

    def request_probe(self, **settings: Any) -> None: ...

    def delegate_divergence(self) -> None: ...

    def set_run_length(self, total_steps: int) -> int | None: ...


def strategy_of(trainer: pl.Trainer) -> PipelinedStrategy | None:
    """The trainer's pipemare strategy; None under another strategy."""
    strategy = trainer.strategy
    return strategy if isinstance(strategy, PipeMareStrategyMixin) else None


def pipemare_strategy(trainer: pl.Trainer, who: str) -> PipelinedStrategy | None:
    """The trainer's pipemare strategy, or None (with a warning) when another strategy runs."""
    strategy = strategy_of(trainer)
    if strategy is None:
        rank_zero_warn(
            text("monitor.other_strategy", monitor=who, strategy=type(trainer.strategy).__name__)
        )
    return strategy


def pipeline(trainer: pl.Trainer) -> Pipeline | None:
    """The running pipeline; None before pipemare's strategy built it, or under another."""
    strategy = strategy_of(trainer)
    return None if strategy is None else strategy.pipeline


def probed(trainer: pl.Trainer) -> Watched:
    """The pipeline and its telemetry probe, once pipemare's strategy built one with a probe."""
    pipe = pipeline(trainer)
    if pipe is None or pipe.probe is None:
        return None
    return pipe, pipe.probe


def gather(trainer: pl.Trainer, local: Any) -> list[Any]:
    """``local`` from every process, on every process (a collective when there are several)."""
    strategy = strategy_of(trainer)
    if not (strategy is not None and strategy.distributed and dist.is_initialized()):
        return [local]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return parts


def merge_stages(parts: list[dict[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    merged: dict[int, dict[str, float]] = {}
    for part in parts:
        for stage, values in part.items():
            merged.setdefault(stage, {}).update(values)
    return merged


def stage_metrics(stats: dict[int, dict[str, float]]) -> dict[str, float]:
    """``{stage: {name: value}}`` as flat metric names ``pipemare/stage{i}/{name}``."""
    return {
        f"{PREFIX}/stage{i}/{name}": float(v)
        for i, values in sorted(stats.items())
        for name, v in values.items()
    }


def log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Through Lightning's logger interface (loggers write from rank 0), at the global step."""
    if not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def gather_stages(
    trainer: pl.Trainer, local: dict[int, dict[str, float]]
) -> dict[int, dict[str, float]]:
    """This process's ``{stage: {name: value}}`` merged with every other process's."""
    return merge_stages(gather(trainer, local))


def interval(trainer: pl.Trainer, every: int | None) -> int:
    default = getattr(trainer, "log_every_n_steps", 50)  # a Trainer attribute mypy cannot see
    return every if every is not None else max(int(default), 1)


def pipeline_config(trainer: pl.Trainer) -> dict[str, Any]:
    """The pipeline's whole configuration, for loggers' hyperparameters (the W&B run config)."""
    strategy = strategy_of(trainer)
    if strategy is None:
        return {}
    pipe = strategy.pipeline
    asked = strategy.asked_config
    config: dict[str, Any] = {
        "schedule": strategy.schedule,
        "microbatches": strategy.microbatches,
        "mode": "distributed" if strategy.distributed else "simulated",
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        # as the user asked (None: the schedule's default); what runs and why: "settings"
        "asked_config": None if asked is None else dataclasses.asdict(asked),
    }
    if pipe is not None:
        config.update(
            stages=pipe.num_stages,
            balance=list(pipe.balance),
            tau_fwd=[d.forward for d in pipe.delays],
            tau_bkwd=[d.backward for d in pipe.delays],
            clip=None
            if pipe.clip is None
            else {"algorithm": pipe.clip.algorithm, "value": pipe.clip.value},
            settings=pipe.settings.to_dict(),  # what runs and why (RunSettings)
        )
    return config


def log_config(trainer: pl.Trainer) -> None:
    config = {PREFIX: pipeline_config(trainer)}
    for logger in trainer.loggers:
        logger.log_hyperparams(config)


class Monitor(Callback):
    """A pipemare monitor: at setup it finds pipemare's strategy and asks it for telemetry
    (:meth:`_watch`); after each training batch it gets the pipeline and its probe, once there
    are both (:meth:`_after_batch`).

    Args:
        log_every_n_steps: logging interval (default: the Trainer's).
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        self.log_every_n_steps = log_every_n_steps
        self._strategy: PipelinedStrategy | None = None
        #: the latest per-stage values this monitor logged: stage -> name -> value
        self.stage_stats: dict[int, dict[str, float]] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy = pipemare_strategy(trainer, type(self).__name__)
        if self._strategy is not None:
            self._watch(trainer, self._strategy)

    def _watch(self, trainer: pl.Trainer, strategy: PipelinedStrategy) -> None:
        """Ask ``strategy`` for the telemetry this monitor reads (``request_probe``)."""

    def _due(self, trainer: pl.Trainer) -> bool:
        """Whether the step that just ran is one to log at."""
        return trainer.global_step % interval(trainer, self.log_every_n_steps) == 0

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._after_batch(trainer, outputs, batch, probed(trainer))

    def _after_batch(self, trainer: pl.Trainer, outputs: Any, batch: Any, watched: Watched) -> None:
        """After a training batch, with what :func:`probed` found."""

    def _log_stages(
        self,
        trainer: pl.Trainer,
        stats: dict[int, dict[str, float]],
        extra: dict[str, float] | None = None,
    ) -> None:
        """Keep ``stats`` for the per-stage table and log them, then ``extra``, as metrics."""
        for stage, values in stats.items():
            self.stage_stats.setdefault(stage, {}).update(values)
        log(trainer, {**stage_metrics(stats), **(extra or {})})


def stage_table(trainer: pl.Trainer) -> dict[int, dict[str, float]]:
    """The latest per-stage values every pipemare monitor of ``trainer`` logged, merged."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by the Trainer at run time
    return merge_stages([cb.stage_stats for cb in callbacks if isinstance(cb, Monitor)])
