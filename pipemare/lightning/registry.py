"""The strategy class for each of Lightning's two packages, and its names in their registries.

Lightning ships ``pytorch_lightning`` and ``lightning.pytorch`` with separate strategy base
classes and registries: one implementation (a mixin) is combined with each package's
``ParallelStrategy`` and registered under ``"pipemare"``, ``"pipemare_spawn"``,
``"pipemare_fork"`` and ``"pipemare_<schedule>"`` for every other schedule.
"""

from __future__ import annotations

import importlib.util
from typing import Any, TypeVar

from pipemare.lightning.launching import LightningAPI
from pipemare.schedule.actions import SCHEDULES

__all__ = ["lightning_strategy_class", "register", "register_strategies", "strategy_class"]

_T = TypeVar("_T", bound=type)


def strategy_class(mixin: _T, package: str, module: str, doc: str) -> _T:
    """``mixin`` combined with ``package``'s ParallelStrategy, named ``PipeMareStrategy``."""
    lt = LightningAPI(package)
    cls = type(
        "PipeMareStrategy",
        (mixin, lt.strategies.ParallelStrategy),
        {"__module__": module, "__doc__": doc, "_lightning": lt},
    )
    return cls  # type: ignore[return-value]


def lightning_strategy_class(mixin: _T, module: str, doc: str) -> _T | None:
    """The class for ``lightning.pytorch``, or None where the ``lightning`` package is absent."""
    if importlib.util.find_spec("lightning") is None:
        return None
    return strategy_class(mixin, "lightning.pytorch", module, doc)


def register_strategies(cls: type, strategy_registry: Any) -> None:
    """Register ``cls`` under pipemare's names in one package's StrategyRegistry (a name
    already there is kept)."""
    entries: list[tuple[str, dict[str, Any], str]] = [
        ("pipemare", {}, "PipeMare asynchronous pipeline: corrected, no flush, no weight stash"),
        ("pipemare_spawn", {"start_method": "spawn"}, "pipemare launched with spawn"),
        ("pipemare_fork", {"start_method": "fork"}, "pipemare launched with fork (notebooks)"),
    ]
    entries += [
        (f"pipemare_{name}", {"schedule": name}, f"pipemare engine with the {name!r} schedule")
        for name in SCHEDULES
        if name != "pipemare"
    ]
    for name, params, description in entries:
        if name in strategy_registry:
            continue
        strategy_registry.register(name, cls, description=description, **params)


def register(strategy: Any, lightning_strategy: Any | None) -> None:
    """Register ``strategy`` with ``pytorch_lightning`` and, when there is one,
    ``lightning_strategy`` with ``lightning.pytorch``."""
    from pytorch_lightning.strategies import StrategyRegistry

    strategy.register_strategies(StrategyRegistry)
    if lightning_strategy is not None:
        from lightning.pytorch.strategies import StrategyRegistry as LightningRegistry

        lightning_strategy.register_strategies(LightningRegistry)
