"""What the strategy's processes need from Lightning: its symbols in either package, a
torchrun restart warning and a SIGTERM check that does not block the pipeline.

Lightning ships two packages (``pytorch_lightning`` and ``lightning.pytorch``) with the same
classes under different names; :class:`LightningAPI` fetches the ones pipemare uses from
either, so one implementation serves both. The launch itself (the launcher, the ranks, the
process group) is the strategy's, as in Lightning's own strategies.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipemare.lightning.checkpoint_io import AtomicCheckpointIO, LightningAtomicCheckpointIO

__all__ = ["START_METHODS", "LightningAPI", "SigtermRelay", "restarts_share_the_store"]

START_METHODS = ("popen", "spawn", "fork", "forkserver")


class LightningAPI:
    """The Lightning symbols the strategy needs, from one of Lightning's two packages.

    Pickled (a spawned process receives the strategy and its runner) as the package's name,
    and looked up again where it is unpickled: modules themselves do not pickle."""

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return LightningAPI, (self.package,)

    def __init__(self, package: str) -> None:
        fabric = "lightning_fabric" if package == "pytorch_lightning" else "lightning.fabric"
        self.package = package
        self.strategies = importlib.import_module(f"{package}.strategies")
        #: the base of the strategy class for this package
        self.ParallelStrategy = self.strategies.ParallelStrategy
        launchers = importlib.import_module(f"{package}.strategies.launchers")
        self.SubprocessScriptLauncher = importlib.import_module(
            f"{package}.strategies.launchers.subprocess_script"
        )._SubprocessScriptLauncher
        self.MultiProcessingLauncher = launchers._MultiProcessingLauncher
        precision = importlib.import_module(f"{package}.plugins.precision")
        self.Precision, self.MixedPrecision = precision.Precision, precision.MixedPrecision
        self.HalfPrecision = precision.HalfPrecision
        rank_zero = importlib.import_module(f"{package}.utilities.rank_zero")
        self.rank_zero_only = rank_zero.rank_zero_only
        self.rank_zero_info = rank_zero.rank_zero_info
        self.rank_zero_warn = rank_zero.rank_zero_warn
        distributed = importlib.import_module(f"{fabric}.utilities.distributed")
        self.init_dist_connection = distributed._init_dist_connection
        self.sync_ddp_if_available = distributed._sync_ddp_if_available
        self.backend_for_device = distributed._get_default_process_group_backend_for_device
        self.reset_seed = importlib.import_module(f"{fabric}.utilities.seed").reset_seed
        self.TrainerFn = importlib.import_module(f"{package}.trainer.states").TrainerFn
        self.AtomicCheckpointIO = (
            AtomicCheckpointIO if package == "pytorch_lightning" else LightningAtomicCheckpointIO
        )
        exceptions = importlib.import_module(f"{package}.utilities.exceptions")
        self.SIGTERMException = exceptions.SIGTERMException


def restarts_share_the_store(env: Any = None) -> bool:
    """Whether torchrun may restart this job with its workers on the agent's shared store."""
    env = os.environ if env is None else env
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return shared and restarts.isdigit() and int(restarts) > 0


class SigtermRelay:
    """Lightning's per-step SIGTERM check, one step late and without a blocking collective.

    In distributed training Lightning broadcasts rank 0's "received SIGTERM" flag at the start
    of every training step, which makes every process wait for every other each step: a
    barrier that would cost a pipeline its overlap between steps. The relay posts the same
    broadcast without waiting (in a group of its own) and reads it at the next step, so every
    process still stops at the same step, one step after rank 0 got the signal.

    Args:
        trainer: the Trainer whose training loop it serves.
        api: Lightning's symbols, from the package the trainer belongs to.
        stall_timeout: the strategy's deadline for another process, in seconds.
        watchdog: the pipeline's watchdog (:class:`~pipemare.engine.watchdog.Watchdog`) once
            there is one, else None: it names a process that never arrives.
    """

    def __init__(
        self,
        trainer: Any,
        api: LightningAPI,
        stall_timeout: float | None = None,
        watchdog: Callable[[], Any] = lambda: None,
    ) -> None:
        self.trainer, self.api, self._watchdog = trainer, api, watchdog
        # the async broadcast runs on the group's own thread: bound it by the stall deadline
        # (not the 30-minute default), or a stopped peer would hold this process at exit
        timeout = datetime.timedelta(seconds=stall_timeout) if stall_timeout else None
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __call__(self) -> None:
        if self._pending is not None:
            work, flag = self._pending
            self._wait(work)
            if int(flag.item()) == 1:
                with contextlib.suppress(Exception):
                    dist.barrier(group=self.group)  # leave together, as Lightning does
                raise self.api.SIGTERMException()
        flag = torch.tensor([1 if getattr(self.trainer, "received_sigterm", False) else 0])
        self._pending = (dist.broadcast(flag, src=0, group=self.group, async_op=True), flag)

    def _wait(self, work: Any) -> None:
        """Wait with the pipeline's stall deadline; a process that never arrives is named."""
        watchdog = self._watchdog()
        if watchdog is None:
            work.wait()
            return
        lost = watchdog.reporter.take()  # the heartbeat found a process gone or stopped
        if lost is not None:
            raise lost
        watchdog.reporter.waiting = "step's SIGTERM check"
        try:
            work.wait(timeout=watchdog.timeout)
        except RuntimeError as err:
            culprit = watchdog.culprit()
            if culprit is None:
                raise RuntimeError(
                    "pipemare: a process did not reach the previous step's SIGTERM check within "
                    f"stall_timeout ({watchdog.timeout}); see the other processes' errors"
                ) from err
            raise watchdog.failure(culprit, "step's SIGTERM check", err) from err
        finally:
            watchdog.reporter.waiting = None

    def install(self) -> None:
        """Replace the training loop's own check for this trainer."""
        self.trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self
