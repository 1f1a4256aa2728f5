"""Named suites of runs: which configs, with which overrides, make up a study."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["SUITES", "RunSpec", "schedule_variants"]

STRATEGY = "trainer.strategy.init_args"
LR = "model.init_args.optimizer.init_args.lr"
#: the synchronous, the asynchronous and the PipeMare pipeline: what most suites compare
BASELINES = ["gpipe", "async", "pipemare"]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a study: a packaged config, dotted-key overrides, the metric that ranks it."""

    name: str
    config: str
    overrides: dict[str, Any]
    monitor: str
    mode: str
    budget_of: str | None = None
    """The run of the same study whose pipeline time is this run's budget: the study runs it
    first, gives this one room for more steps and stops it when the time is spent
    (:class:`pipemare.callbacks.PipelineTimeBudget`)."""


# The task of each packaged config: the metric that ranks runs, and T3's warm-up length
# (about a tenth of the run).
TASKS: dict[str, tuple[str, str, int]] = {
    "mnist": ("val_acc", "max", 30),
    "char_lm": ("val_loss", "min", 60),
}


def schedule_variants(warmup: int) -> dict[str, dict[str, Any]]:
    """The schedules compared by a study: the baselines, PipeMare's own T1+T2 (+T3), and the
    ``pipemare`` default (for Adam at N = 1: T1 over half the run, delay-aware momentum, spike
    compensation, weight prediction and the stability guard)."""
    t1t2 = {
        "lr_reschedule": True,
        "reschedule_steps": 500,
        "discrepancy_correction": True,
        "weight_prediction": False,
        "spike_compensation": False,
        "delay_momentum": None,
        "stability_guard": False,
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


def _sweep(
    key: str, values: tuple[float, ...], tag: str, variants: list[str] = BASELINES
) -> list[RunSpec]:
    """Both tasks' ``variants`` once per value of the dotted ``key``, named ``-{tag}{value}``."""
    runs = []
    for value in values:
        runs += _grid(["mnist", "char_lm"], variants, {key: value}, f"-{tag}{value:g}")
    return runs


def stages() -> list[RunSpec]:
    """2, 4 and 8 stages (one microbatch): how staleness grows with the pipeline's depth."""
    return _sweep(f"{STRATEGY}.stages", (2, 4, 8), "P")


def learning_rates() -> list[RunSpec]:
    """Three learning rates for the synchronous, asynchronous and PipeMare pipelines."""
    return _sweep(LR, (1e-3, 3e-3, 1e-2), "lr")


def microbatches() -> list[RunSpec]:
    """N = 1, 2, 4 microbatches per minibatch: the delays shrink as 1/N."""
    return _sweep(f"{STRATEGY}.microbatches", (1, 2, 4), "N")


def quick() -> list[RunSpec]:
    """A few steps of three schedules per task: checks the whole path (tests use it)."""
    short = {
        "trainer.max_epochs": 1,
        "trainer.max_steps": 8,
        "trainer.limit_train_batches": 8,
        "trainer.limit_val_batches": 1,
        "trainer.val_check_interval": 4,
        "trainer.log_every_n_steps": 2,
    }
    runs = _grid(["mnist", "char_lm"], BASELINES, short)
    return [  # each with gpipe's pipeline time
        r if r.name.endswith("-gpipe") else dataclasses.replace(r, budget_of=_gpipe(r.name))
        for r in runs
    ]


def _gpipe(name: str) -> str:
    return name.split("-", 1)[0] + "-gpipe"


SUITES: dict[str, Callable[[], list[RunSpec]]] = {
    "stages": stages,
    "learning_rates": learning_rates,
    "microbatches": microbatches,
    "quick": quick,
}
