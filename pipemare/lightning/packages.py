"""What differs between Lightning's two packages for the strategy, imported the ordinary way.

Lightning ships ``pytorch_lightning`` and ``lightning.pytorch``: the same classes under two
names, with separate registries, launchers, precision plugins and exceptions. The strategy's
behaviour is one mixin (:class:`~pipemare.lightning.strategy.PipeMareStrategyMixin`); each
package's subclass names its :class:`LightningPackage`, the handful of classes and functions
whose identity matters (an ``isinstance`` on the user's plugin, the exception Lightning's loop
catches, the launcher that knows its own Trainer). Everything the two packages share comes
from ``lightning_fabric`` directly.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lightning_fabric.plugins.environments import ClusterEnvironment
from pytorch_lightning.plugins.precision import HalfPrecision, MixedPrecision, Precision
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from pytorch_lightning.utilities import rank_zero
from pytorch_lightning.utilities.exceptions import SIGTERMException

from pipemare.lightning.checkpoint_io import AtomicCheckpointIO, LightningAtomicCheckpointIO

__all__ = ["LIGHTNING", "PYTORCH_LIGHTNING", "LightningPackage", "ScriptLauncher"]


class ScriptLauncher(Protocol):
    """What the strategy uses of the launcher that re-runs the user's script per process."""

    procs: list[subprocess.Popen[bytes]]

    def __init__(
        self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int
    ) -> None: ...

    def kill(self, signum: signal.Signals) -> None: ...


@dataclass(frozen=True)
class LightningPackage:
    """The classes and functions of one Lightning package that the strategy must take from
    that package and no other.

    Attributes:
        name: the package's import name.
        script_launcher: the launcher that re-runs the user's script per process.
        spawn_launcher: the launcher over ``torch.multiprocessing`` (spawn, fork).
        precision: 32-bit precision; ``mixed_precision`` and ``half_precision`` the bf16 ones.
        rank_zero_only: the decorator whose ``rank`` the package's loggers read.
        rank_zero_info: logs on global rank 0.
        rank_zero_warn: warns on global rank 0.
        sigterm: the exception the package's training loop stops on after a SIGTERM.
        checkpoint_io: the atomic checkpoint writer over the package's ``TorchCheckpointIO``.
    """

    name: str
    script_launcher: type[ScriptLauncher]
    spawn_launcher: type
    precision: type
    mixed_precision: type
    half_precision: type
    rank_zero_only: Callable[..., object]
    rank_zero_info: Callable[..., None]
    rank_zero_warn: Callable[..., None]
    sigterm: type[BaseException]
    checkpoint_io: type


PYTORCH_LIGHTNING = LightningPackage(
    name="pytorch_lightning",
    script_launcher=_SubprocessScriptLauncher,
    spawn_launcher=_MultiProcessingLauncher,
    precision=Precision,
    mixed_precision=MixedPrecision,
    half_precision=HalfPrecision,
    rank_zero_only=rank_zero.rank_zero_only,
    rank_zero_info=rank_zero.rank_zero_info,
    rank_zero_warn=rank_zero.rank_zero_warn,
    sigterm=SIGTERMException,
    checkpoint_io=AtomicCheckpointIO,
)

#: ``lightning.pytorch``'s, where that package is installed; else None
LIGHTNING: LightningPackage | None = None

if importlib.util.find_spec("lightning") is not None:
    from lightning.pytorch.plugins import precision as _precision
    from lightning.pytorch.strategies.launchers import multiprocessing as _spawn
    from lightning.pytorch.strategies.launchers import subprocess_script as _script
    from lightning.pytorch.utilities import exceptions as _exceptions
    from lightning.pytorch.utilities import rank_zero as _rank_zero

    assert LightningAtomicCheckpointIO is not None  # lightning.fabric ships with lightning
    LIGHTNING = LightningPackage(
        name="lightning.pytorch",
        script_launcher=_script._SubprocessScriptLauncher,
        spawn_launcher=_spawn._MultiProcessingLauncher,
        precision=_precision.Precision,
        mixed_precision=_precision.MixedPrecision,
        half_precision=_precision.HalfPrecision,
        rank_zero_only=_rank_zero.rank_zero_only,
        rank_zero_info=_rank_zero.rank_zero_info,
        rank_zero_warn=_rank_zero.rank_zero_warn,
        sigterm=_exceptions.SIGTERMException,
        checkpoint_io=LightningAtomicCheckpointIO,
    )
