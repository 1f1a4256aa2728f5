"""Where an update of the one-process run goes (issue 62): ``where.py 64 4 32 pipemare
--one-process`` with clocks (this thread's CPU time) around the update action's parts, kept
for the run's own stages only (more than 20 trained tensors; setup's calibration pipelines
have at most 16). Prints each part's median and mean per update. Run alone:

    python experiments/results/links/run_update_parts.py
"""

from __future__ import annotations

import atexit
import collections
import importlib
import inspect
import os
import pkgutil
import runpy
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pipemare.optim.corrections as corrections
from pipemare.engine import executor, stage
from pipemare.optim import optimizer
from pipemare.schedule.actions import Op

WHERE = Path(__file__).resolve().with_name("where.py")
_SECONDS: dict[str, list[float]] = collections.defaultdict(list)
_IN_RUN = {"now": False}  # inside an update of one of the run's stages


def _timed(call, label):
    def clocked(*args, **kwargs):
        start = time.thread_time()
        try:
            return call(*args, **kwargs)
        finally:
            if _IN_RUN["now"]:
                _SECONDS[label].append(time.thread_time() - start)

    return clocked


def _clock_updates() -> None:
    act = executor.Executor._act

    def clocked_act(self, worker, action):
        if action.op is not Op.UPDATE:
            return act(self, worker, action)
        index = worker.stage.index
        _IN_RUN["now"] = len(self.optimizer.stage_parameters(index)) > 20
        start = time.thread_time()
        try:
            return act(self, worker, action)
        finally:
            if _IN_RUN["now"]:
                _SECONDS[f"the update action (stage {index})"].append(time.thread_time() - start)
            _IN_RUN["now"] = False

    executor.Executor._act = clocked_act
    executor.Executor._nonfinite = staticmethod(
        _timed(executor.Executor._nonfinite, "the finite check")
    )
    optimizer.PipeMareOptimizer.step = _timed(
        optimizer.PipeMareOptimizer.step, "PipeMareOptimizer.step (corrections and optimiser)"
    )
    for name in ("before_update", "after_update"):
        setattr(stage.Stage, name, _timed(getattr(stage.Stage, name), f"Stage.{name}"))
    for module in pkgutil.iter_modules(corrections.__path__):
        loaded = importlib.import_module(f"{corrections.__name__}.{module.name}")
        for name, cls in inspect.getmembers(loaded, inspect.isclass):
            for hook in ("before_step", "after_step"):
                if cls.__module__ == loaded.__name__ and hook in cls.__dict__:
                    setattr(cls, hook, _timed(cls.__dict__[hook], f"{name}.{hook}"))


def _show() -> None:
    for label, seconds in sorted(_SECONDS.items()):
        if len(seconds) > 1:
            print(
                f"{label}: median {1e3 * statistics.median(seconds):.3f} ms, mean "
                f"{1e3 * statistics.mean(seconds):.3f} ms, {len(seconds)} calls"
            )


if __name__ == "__main__":
    _clock_updates()
    atexit.register(_show)
    sys.argv = [str(WHERE), "64", "4", "32", "pipemare", "--one-process", "--out", os.devnull]
    runpy.run_path(str(WHERE), run_name="__main__")
