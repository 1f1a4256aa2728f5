"""Import paths of pipemare 0.1's flat layout, kept working: each old module name is the
module that now holds its code (the same object, so ``isinstance`` and monkeypatching agree).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import CodeType, ModuleType

_ENGINE = "clip errors executor lagged layout microbatch pipeline replicas snapshot stage"
_ENGINE += " telemetry transport watchdog"
_LIGHTNING = "checkpoint_io checkpointing launching logreplay module_adapter saving steps strategy"
_TASKS = "classifiers data datamodules language_models lr_schedules models translation"
_STUDIES = "fair plan_study protocol recompute_study sharpness study suites summary"

#: old module -> where it lives now.
MOVED = {
    "pipemare.delay": "pipemare.schedule.delay",
    "pipemare.partition": "pipemare.model.partition",
    "pipemare.config": "pipemare.optim.config",
    "pipemare.corrections": "pipemare.optim.corrections",
    "pipemare.corrections.stability": "pipemare.optim.stability",
    **{f"pipemare.{name}": f"pipemare.engine.{name}" for name in _ENGINE.split()},
    **{f"pipemare.{name}": f"pipemare.lightning.{name}" for name in _LIGHTNING.split()},
    **{f"pipemare.experiments.{n}": f"pipemare.experiments.tasks.{n}" for n in _TASKS.split()},
    **{f"pipemare.experiments.{n}": f"pipemare.experiments.studies.{n}" for n in _STUDIES.split()},
    "pipemare.experiments.bench_engine": "pipemare.experiments.bench.engine",
    "pipemare.experiments.bench_monitors": "pipemare.experiments.bench.monitors",
    "pipemare.experiments.bench_torch": "pipemare.experiments.bench.torch_peer",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the target ran when it was imported

    def get_code(self, fullname: str) -> CodeType | None:
        """The target's code, so that ``python -m OLD.NAME`` runs the module that moved."""
        loader = _spec(self.target).loader
        return (
            loader.get_code(self.target)
            if isinstance(loader, importlib.abc.InspectLoader)
            else None
        )


def _spec(name: str) -> importlib.machinery.ModuleSpec:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"pipemare moved a module to {name}, which is missing", name=name)
    return spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        origin = _spec(MOVED[fullname]).origin  # runpy sets sys.argv[0] to it
        return importlib.util.spec_from_loader(fullname, _Alias(MOVED[fullname]), origin=origin)


def install() -> None:
    """Let the old names import (idempotent)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
