"""Named suites of runs: which configs, with which overrides, make up a study."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["SUITES", "RunSpec", "schedule_variants"]

STRATEGY = "trainer.strategy.init_args"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a study: a packaged config, dotted-key overrides, the metric that ranks it."""

    name: str
    config: str
    overrides: dict[str, Any]
    monitor: str
    mode: str


# The task of each packaged config: the metric that ranks runs, and T3's warm-up length
# (about a tenth of the run).
TASKS: dict[str, tuple[str, str, int]] = {
    "mnist": ("val_acc", "max", 30),
    "char_lm": ("val_loss", "min", 60),
}


def schedule_variants(warmup: int) -> dict[str, dict[str, Any]]:
    """The schedules compared by a study: the baselines, PipeMare's own T1+T2 (+T3), and the
    ``pipemare`` default (T1 over 13% of the run, delay-aware momentum, spike compensation and
    weight prediction)."""
    t1t2 = {
        "lr_reschedule": True,
        "reschedule_steps": 500,
        "discrepancy_correction": True,
        "weight_prediction": False,
        "spike_compensation": False,
        "delay_momentum": None,
    }
    return {
        "gpipe": {f"{STRATEGY}.schedule": "gpipe"},
        "1f1b": {f"{STRATEGY}.schedule": "1f1b"},
        "pipedream": {f"{STRATEGY}.schedule": "pipedream"},
        "async": {f"{STRATEGY}.schedule": "async"},
        "pipemare": {f"{STRATEGY}.schedule": "pipemare"},
        "pipemare-T1T2": {
            f"{STRATEGY}.schedule": "pipemare",
            f"{STRATEGY}.config": {**t1t2, "warmup_steps": 0},
        },
        "pipemare-T1T2T3": {
            f"{STRATEGY}.schedule": "pipemare",
            f"{STRATEGY}.config": {**t1t2, "warmup_steps": warmup},
        },
    }


def _grid(
    tasks: list[str],
    variants: list[str] | None = None,
    extra: dict[str, Any] | None = None,
    tag: str = "",
) -> list[RunSpec]:
    runs = []
    for task in tasks:
        monitor, mode, warmup = TASKS[task]
        for name, overrides in schedule_variants(warmup).items():
            if variants is None or name in variants:
                runs.append(
                    RunSpec(
                        f"{task}{tag}-{name}",
                        f"{task}.yaml",
                        {**overrides, **(extra or {})},
                        monitor,
                        mode,
                    )
                )
    return runs


def default() -> list[RunSpec]:
    """8 fine-grained stages, N=1, one learning rate: every schedule through Lightning."""
    return _grid(["mnist", "char_lm"])


def stages() -> list[RunSpec]:
    """2, 4 and 8 stages (one microbatch): how staleness grows with the pipeline's depth."""
    runs = []
    for p in (2, 4, 8):
        runs += _grid(
            ["mnist", "char_lm"],
            ["gpipe", "async", "pipemare"],
            {f"{STRATEGY}.stages": p},
            f"-P{p}",
        )
    return runs


def learning_rates() -> list[RunSpec]:
    """Three learning rates for the synchronous, asynchronous and PipeMare pipelines."""
    runs = []
    for lr in (1e-3, 3e-3, 1e-2):
        extra = {"model.init_args.optimizer.init_args.lr": lr}
        runs += _grid(["mnist", "char_lm"], ["gpipe", "async", "pipemare"], extra, f"-lr{lr:g}")
    return runs


def microbatches() -> list[RunSpec]:
    """N = 1, 2, 4 microbatches per minibatch: the delays shrink as 1/N."""
    runs = []
    for n in (1, 2, 4):
        runs += _grid(
            ["mnist", "char_lm"],
            ["gpipe", "async", "pipemare"],
            {f"{STRATEGY}.microbatches": n},
            f"-N{n}",
        )
    return runs


def quick() -> list[RunSpec]:
    """A few steps of three schedules per task: checks the whole path (tests use it)."""
    short = {
        "trainer.max_epochs": 1,
        "trainer.max_steps": 12,
        "trainer.limit_train_batches": 12,
        "trainer.limit_val_batches": 2,
        "trainer.val_check_interval": 6,
        "trainer.log_every_n_steps": 2,
    }
    return _grid(["mnist", "char_lm"], ["gpipe", "async", "pipemare"], short)


SUITES: dict[str, Callable[[], list[RunSpec]]] = {
    "default": default,
    "stages": stages,
    "learning_rates": learning_rates,
    "microbatches": microbatches,
    "quick": quick,
}
