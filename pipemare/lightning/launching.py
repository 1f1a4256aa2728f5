"""What the strategy's processes need around Lightning's launch: the start methods, a torchrun
restart warning and a SIGTERM check that does not block the pipeline.

The launch itself (the launcher, the ranks, the process group) is the strategy's, as in
Lightning's own strategies.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pipemare.lines import text

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from pipemare.engine.watchdog import Watchdog

__all__ = ["START_METHODS", "SigtermRelay", "restarts_share_the_store"]

START_METHODS = ("popen", "spawn", "fork", "forkserver")


def restarts_share_the_store(env: Mapping[str, str] | None = None) -> bool:
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
        sigterm: the exception the trainer's package stops its training loop on.
        stall_timeout: the strategy's deadline for another process, in seconds.
        watchdog: the pipeline's watchdog (:class:`~pipemare.engine.watchdog.Watchdog`) once
            there is one, else None: it names a process that never arrives.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        sigterm: type[BaseException],
        stall_timeout: float | None = None,
        watchdog: Callable[[], Watchdog | None] = lambda: None,
    ) -> None:
        self.trainer, self._sigterm, self._watchdog = trainer, sigterm, watchdog
        # the async broadcast runs on the group's own thread: bound it by the stall deadline
        # (not the 30-minute default), or a stopped peer would hold this process at exit
        timeout = datetime.timedelta(seconds=stall_timeout) if stall_timeout else None
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def __call__(self) -> None:
        if self._pending is not None:
            work, flag = self._pending
            self._wait(work)
            if int(flag.item()) == 1:
                with contextlib.suppress(Exception):
                    dist.barrier(group=self.group)  # leave together, as Lightning does
                raise self._sigterm()
        flag = torch.tensor([1 if getattr(self.trainer, "received_sigterm", False) else 0])
        self._pending = (dist.broadcast(flag, src=0, group=self.group, async_op=True), flag)

    def _wait(self, work: dist.Work) -> None:
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
                raise RuntimeError(text("sigterm.stalled", timeout=watchdog.timeout)) from err
            raise watchdog.failure(culprit, "step's SIGTERM check", err) from err
        finally:
            watchdog.reporter.waiting = None

    def install(self) -> None:
        """Replace the training loop's own check for this trainer (a private method of
        Lightning's epoch loop, replaced on this one instance: Lightning offers no hook)."""
        self.trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self  # type: ignore[method-assign]
