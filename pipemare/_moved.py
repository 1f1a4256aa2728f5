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
from types import ModuleType

_ENGINE = "clip errors executor lagged layout microbatch pipeline replicas snapshot stage"
_ENGINE += " telemetry transport watchdog"
_LIGHTNING = "checkpoint_io checkpointing launching logreplay module_adapter saving steps strategy"

#: old module -> where it lives now.
MOVED = {
    "pipemare.delay": "pipemare.schedule.delay",
    "pipemare.partition": "pipemare.model.partition",
    "pipemare.config": "pipemare.optim.config",
    "pipemare.corrections": "pipemare.optim.corrections",
    "pipemare.corrections.stability": "pipemare.optim.stability",
    **{f"pipemare.{name}": f"pipemare.engine.{name}" for name in _ENGINE.split()},
    **{f"pipemare.{name}": f"pipemare.lightning.{name}" for name in _LIGHTNING.split()},
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the target ran when it was imported


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(MOVED[fullname]))


def install() -> None:
    """Let the old names import (idempotent)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
