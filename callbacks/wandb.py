"""Weights & Biases extras: an offline-safe logger, step axes, the per-stage table.

Only used when a ``WandbLogger`` is among the Trainer's loggers; the monitors log everything
through Lightning's logger interface, so any logger gets the metrics.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_only
from typing_extensions import override

from pipemare.callbacks._common import pipeline, stage_table
from pipemare.lines import text

__all__ = ["OfflineSafeWandbLogger", "define_metrics", "find", "log_stage_table", "wandb_logger"]


def has_api_key() -> bool:
    """Whether wandb can authenticate without asking: an API key in the environment or ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class OfflineSafeWandbLogger(pl.loggers.WandbLogger):
    """A ``WandbLogger`` that runs offline when no API key is configured, so it never prompts,
    hangs or fails for the lack of one (sync later with ``wandb sync``). ``group`` puts the
    runs of one experiment side by side in the W&B UI. Usable from YAML configs by class path.
    """

    def __init__(
        self,
        project: str = "pipemare",
        name: str | None = None,
        group: str | None = None,
        save_dir: str = ".",
        offline: bool | None = None,
        **kwargs: Any,
    ) -> None:
        mode = os.environ.get("WANDB_MODE")
        if offline is None:
            offline = mode in ("offline", "dryrun") or (mode != "disabled" and not has_api_key())
        if offline:
            os.environ["WANDB_MODE"] = "offline"
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(
            project=project,
            name=name,
            group=group,
            save_dir=str(save_dir),
            offline=offline,
            **kwargs,
        )
        if self._wandb_init.get("anonymous") is None:  # wandb >= 0.22 warns on any value
            self._wandb_init.pop("anonymous", None)

    @rank_zero_only
    @override
    def finalize(self, status: str) -> None:
        """Lightning's finalisation, then one line saying where the run is (W&B's own banner is
        silenced by the project's commands)."""
        super().finalize(status)
        run = self._experiment
        if run is None or not hasattr(run, "dir"):  # never started, or disabled
            return
        if self._offline:
            where = Path(run.dir).parent
            print(text("wandb.offline", where=where))
        elif getattr(run, "url", None):
            print(text("wandb.online", url=run.url))


def wandb_logger(**kwargs: Any) -> OfflineSafeWandbLogger:
    """An :class:`OfflineSafeWandbLogger` (same arguments)."""
    return OfflineSafeWandbLogger(**kwargs)


def find(trainer: pl.Trainer) -> pl.loggers.WandbLogger | None:
    for logger in trainer.loggers:
        if isinstance(logger, pl.loggers.WandbLogger):
            return logger
    return None


def define_metrics(trainer: pl.Trainer) -> None:
    """Put pipemare's metrics on the Trainer's step axis, with sensible summaries."""
    logger = find(trainer)
    if logger is None or trainer.global_rank != 0:
        return
    run = logger.experiment
    run.define_metric("trainer/global_step")
    run.define_metric("pipemare/*", step_metric="trainer/global_step")
    run.define_metric("pipemare/throughput", step_metric="trainer/global_step", summary="mean")
    run.define_metric("pipemare/utilization", step_metric="trainer/global_step", summary="mean")
    run.define_metric("pipemare/wall_time", step_metric="trainer/global_step", summary="max")
    run.define_metric("pipemare/pipeline_time", step_metric="trainer/global_step", summary="max")


def log_stage_table(trainer: pl.Trainer, key: str = "pipemare/stages") -> None:
    """Log the latest per-stage values of pipemare's monitors as one W&B table."""
    logger = find(trainer)
    stats = stage_table(trainer)
    pipe = pipeline(trainer)
    if logger is None or not stats or trainer.global_rank != 0:
        return
    names = sorted({n for values in stats.values() for n in values})
    columns = ["stage", "layers", "params", *names]
    data = []
    for i in sorted(stats):
        layers = pipe.balance[i] if pipe is not None else None
        params = (
            sum(p.numel() for p in pipe.stage_modules[i].parameters()) if pipe is not None else None
        )
        data.append([i, layers, params, *[stats[i].get(n) for n in names]])
    logger.log_table(key=key, columns=columns, data=data, step=trainer.global_step)
