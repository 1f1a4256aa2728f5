"""Starting the strategy's processes: Lightning's launchers, ranks, the process group.

Lightning ships two packages (``pytorch_lightning`` and ``lightning.pytorch``) with the same
classes under different names; :class:`LightningAPI` fetches the ones pipemare uses from
either, so one implementation serves both.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import signal
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from pipemare.engine.heartbeat import announce
from pipemare.lightning.checkpoint_io import AtomicCheckpointIO, LightningAtomicCheckpointIO

if TYPE_CHECKING:  # the strategy's mixins join a Lightning ParallelStrategy at run time
    from pytorch_lightning.strategies import ParallelStrategy as StrategyBase
else:
    StrategyBase = object

__all__ = [
    "START_METHODS",
    "LightningAPI",
    "SigtermRelay",
    "StrategyBase",
    "connect",
    "end_launched_processes",
    "make_launcher",
    "set_world_ranks",
]

START_METHODS = ("popen", "spawn", "fork", "forkserver")


class LightningAPI:
    """The Lightning symbols the strategy needs, from one of Lightning's two packages."""

    def __init__(self, package: str) -> None:
        fabric = "lightning_fabric" if package == "pytorch_lightning" else "lightning.fabric"
        self.package = package
        self.strategies = importlib.import_module(f"{package}.strategies")
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


def make_launcher(strategy: Any, start_method: str) -> Any:
    """Lightning's launcher for one process per stage, or None when every stage runs here.

    ``popen`` re-runs the user's script once per extra process (Lightning's default for
    scripts; torchrun and SLURM start the processes themselves and Lightning detects them);
    the other methods use :mod:`torch.multiprocessing`.
    """
    api: LightningAPI = strategy._lightning
    if not strategy.distributed:
        return None
    if start_method == "popen":
        return api.SubprocessScriptLauncher(
            strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        )
    return api.MultiProcessingLauncher(strategy, start_method=start_method)


def set_world_ranks(strategy: Any) -> None:
    """Tell the cluster environment and both packages' ``rank_zero_only`` this process's rank."""
    env = strategy.cluster_environment
    if env is not None:
        env.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        env.set_world_size(strategy.num_nodes * strategy.num_processes)
    # Loggers write from rank 0 only, whichever package's decorator guards them.
    strategy._lightning.rank_zero_only.rank = strategy.global_rank
    pl.utilities.rank_zero.rank_zero_only.rank = strategy.global_rank  # type: ignore[attr-defined]


def connect(strategy: Any, timeout: Any) -> None:
    """Seed, set the ranks and join the default process group (gloo on CPU, NCCL on CUDA)."""
    api: LightningAPI = strategy._lightning
    api.reset_seed()
    set_world_ranks(strategy)
    backend = api.backend_for_device(strategy.root_device)
    api.init_dist_connection(strategy.cluster_environment, backend, timeout=timeout)
    if restarts_share_the_store():
        api.rank_zero_warn(
            "pipemare: torchrun may restart this job (--max-restarts), and its workers share the "
            "agent's store, which keeps the first attempt's addresses: a restart's gloo setup "
            "then often fails connecting to the dead processes (pytorch/pytorch#135712). Start "
            "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment."
        )


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
    """

    def __init__(self, trainer: Any, api: LightningAPI, strategy: Any = None) -> None:
        self.trainer, self.api, self.strategy = trainer, api, strategy
        # the async broadcast runs on the group's own thread: bound it by the stall deadline
        # (not the 30-minute default), or a stopped peer would hold this process at exit
        stall = getattr(strategy, "stall_timeout", None)
        timeout = datetime.timedelta(seconds=stall) if stall else None
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
        transport = getattr(getattr(self.strategy, "pipeline", None), "transport", None)
        watchdog = getattr(transport, "watchdog", None)
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


def end_launched_processes(strategy: Any, error: BaseException | None = None) -> None:
    """After an error in the process that launched the others (``start_method="popen"``), end
    them as Lightning does after Ctrl-C: a stage left waiting, or stopped, would hold its
    device until its own deadline, or forever. torchrun's agent and ``srun
    --kill-on-bad-exit`` do the same for the jobs they start.

    ``error`` is printed first: Lightning's launcher ends this process within seconds of a
    child's failed exit, which can come before this process's traceback is printed."""
    launcher = getattr(strategy, "_launcher", None)
    if isinstance(launcher, strategy._lightning.SubprocessScriptLauncher) and launcher.procs:
        if error is not None:
            announce(error)
        launcher.kill(signal.SIGKILL)
