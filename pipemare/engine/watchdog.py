"""Waiting on another stage without hanging, and failing with a message that says who failed.

Every wait on a message from another process has a deadline (``stall_timeout``, default 5
minutes, far below torch's 30-minute process-group timeout): a stage that stopped responding
(SIGSTOP, a deadlock, a hung device) makes its neighbours fail instead of hanging, and their
exit closes their connections, so the failure reaches every process. Both a timeout and a
connection the peer closed (it was killed, or crashed) become :class:`StageFailedError`, which
names the peer's stage, rank, host and PID, the last microbatch heard from it, and, when the
peer runs on this host, what its process is doing now (gone, or stopped).

Liveness is watched apart from progress (:mod:`pipemare.engine.heartbeat`): a peer whose
heartbeat stops for ``heartbeat_timeout`` is named at once, so ``stall_timeout`` is left for
the different case of a live process that makes no progress, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from pipemare.engine.heartbeat import FatalReporter, Heartbeat, announce, store_address
from pipemare.lines import text

__all__ = ["Peer", "StageFailedError", "Watchdog", "describe_process"]


@dataclasses.dataclass(frozen=True)
class Peer:
    """Where a rank runs."""

    rank: int
    stage: int
    host: str
    pid: int


def this_process(rank: int, stage: int) -> Peer:
    return Peer(rank, stage, socket.gethostname(), os.getpid())


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def describe_process(peer: Peer, settle: float = 0.0) -> str:
    """What the peer's process is doing, where this host can tell (same host only).

    ``settle``: seconds to follow a process that still reads as running until it reads as
    gone or stopped. A killed process closes its connections while it exits, before it reads
    as a zombie, so a peer that saw the connection close can otherwise catch it "running".
    """
    if peer.host != socket.gethostname():
        return "is on another host"
    deadline = time.monotonic() + settle
    while True:
        state = _state(peer.pid)
        if state is None or state == "Z":  # Z: exited, not yet reaped by its parent
            return "is gone (killed or crashed)"
        if state in ("T", "t"):
            return "is stopped (SIGSTOP or a debugger)"
        if time.monotonic() >= deadline:
            return "is running but did not answer"
        time.sleep(0.02)


class StageFailedError(RuntimeError):
    """Another stage failed, stopped or stalled; this process stops too.

    Attributes:
        peer: the stage that failed (rank, host, PID).
        last_microbatch: the last microbatch heard from it (None: nothing yet).
        completed_steps: the steps (updates) its stage had completed when it sent that
            microbatch, the latest known (None: nothing heard yet).
    """

    def __init__(
        self,
        peer: Peer,
        me: Peer,
        what: str | None,
        last_microbatch: int | None,
        microbatches: int,
        cause: str,
        completed: int | None = None,
        state: str | None = None,
    ) -> None:
        self.peer, self.last_microbatch = peer, last_microbatch
        self.completed_steps = completed
        heard = (
            "nothing heard from it yet"
            if last_microbatch is None
            else f"last heard from it at microbatch {last_microbatch} (step "
            f"{last_microbatch // microbatches + 1})"
        )
        if completed is not None and last_microbatch is not None:
            heard += f", when it had completed {completed} steps (its updates)"
        doing = (
            f"was waiting for {what}"
            if what
            else "was not waiting on another stage (computing, or in a collective)"
        )
        super().__init__(
            text(
                "stage.failed",
                stage=peer.stage,
                rank=peer.rank,
                host=peer.host,
                pid=peer.pid,
                state=state or describe_process(peer),
                my_stage=me.stage,
                my_rank=me.rank,
                my_pid=me.pid,
                doing=doing,
                heard=heard,
                cause=cause.splitlines()[0] if cause else "unknown",
            )
        )


class Watchdog:
    """Waits on point-to-point work with a deadline; turns failures into StageFailedError.

    Args:
        peers: every rank's :class:`Peer`, indexed by rank.
        me: this process.
        timeout: the longest a single wait may take (``stall_timeout``).
    """

    def __init__(self, peers: list[Peer], me: Peer, timeout: datetime.timedelta) -> None:
        self.peers, self.me, self.timeout = peers, me, timeout
        self.microbatches = 1
        self._heard: dict[int, int] = {}
        self._completed: dict[int, int] = {}
        #: what the heartbeat found, handed to the main thread (or fatal when it is blocked)
        self.reporter = FatalReporter()
        self.heartbeat: Heartbeat | None = None

    @classmethod
    def of_job(cls, stage: int, timeout: datetime.timedelta) -> Watchdog:
        """This process's watchdog over every rank of the job, this one running ``stage`` (-1:
        none): every rank calls it alike, once, and learns who runs where."""
        rank = dist.get_rank()
        peers: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peers, this_process(rank, stage))
        return cls(peers, peers[rank], timeout)

    def start_heartbeat(self, timeout: float) -> None:
        """Beat, and watch every other rank's beat (see :mod:`pipemare.engine.heartbeat`);
        nothing runs where the job has no TCPStore."""
        address = store_address()
        if address is None or len(self.peers) < 2:
            return
        first = self.peers[0]
        try:
            heartbeat = Heartbeat(
                address,
                self.me.rank,
                len(self.peers),
                timeout,
                self._lost,
                f"{first.host}-{first.pid}",
            )
        except Exception as err:  # the job still runs, with stall_timeout alone
            warnings.warn(
                text(
                    "heartbeat.off",
                    host=address[0],
                    port=address[1],
                    error=err,
                    timeout=self.timeout,
                ),
                stacklevel=2,
            )
            return
        self.heartbeat = heartbeat
        self.reporter.stopped = lambda: heartbeat.stopped

    def heard(self, rank: int, microbatch: int, completed: int | None = None) -> None:
        """A message of ``microbatch`` arrived from ``rank``, whose stage had then completed
        ``completed`` steps (applied that many updates)."""
        self._heard[rank] = microbatch
        if completed is not None:
            self._completed[rank] = completed

    def wait(self, work: Any, rank: int, what: str) -> None:
        lost = self.reporter.take()
        if lost is not None:
            raise lost
        self.reporter.waiting, self.reporter.waiting_rank = what, rank
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as err:
            raise self.failure(rank, what, err) from err
        finally:
            self.reporter.waiting = None

    @contextlib.contextmanager
    def posting(self, rank: int, what: str) -> Iterator[None]:
        """While a send to ``rank`` or a receive from it is posted: gloo finds a connection the
        peer's death reset as it posts, not only as it waits, and that error names no stage."""
        try:
            yield
        except RuntimeError as err:
            raise self.failure(rank, f"connection ({what})", err) from err

    def culprit(self, settle: float = 2.0) -> int | None:
        """A rank whose process this host can see is gone or stopped, if any, looking again
        for ``settle`` seconds (a killed process reads as running for a moment)."""
        deadline = time.monotonic() + settle
        while True:
            for peer in self.peers:
                if peer.rank != self.me.rank and describe_process(peer).startswith(
                    ("is gone", "is stopped")
                ):
                    return peer.rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def failure(self, rank: int, what: str, err: BaseException) -> StageFailedError:
        peer = self.peers[rank]
        state = describe_process(peer, settle=5.0)
        silence = self.heartbeat.silence(rank) if self.heartbeat is not None else None
        if silence is not None and silence < self.heartbeat.timeout:  # type: ignore[union-attr]
            if "timed out" in str(err).lower():
                state = (
                    f"is alive (it beat {silence:.0f} s ago) but sent nothing within "
                    f"stall_timeout ({self.timeout}): no progress, e.g. a deadlock or a wait "
                    "in user code, not a dead process"
                )
            elif state.startswith("is on another host"):
                state = f"closed its connection; it beat {silence:.0f} s ago"
        error = StageFailedError(
            peer,
            self.me,
            f"its {what}",
            self._heard.get(rank),
            self.microbatches,
            str(err),
            self._completed.get(rank),
            state,
        )
        announce(error)
        return error

    def _lost(self, rank: int | None, silence: float, cause: str) -> None:
        """Called in the heartbeat thread: ``rank`` stopped beating, or (None) the store is
        unreachable."""
        waiting, waited = self.reporter.waiting, self.reporter.waiting_rank
        doing = f"waiting for {waiting} from rank {waited}" if waiting else "computing"
        if waiting and rank is not None:
            waiting = f"its {waiting}" if waited == rank else f"{waiting} from rank {waited}"
        timeout = self.heartbeat.timeout if self.heartbeat is not None else 0.0
        if rank is None:
            first = self.peers[0]
            host = ""
            if first.rank != self.me.rank and first.host == socket.gethostname():
                host = f"; rank 0 (pid {first.pid}) {describe_process(first, settle=1.0)}"
            error: BaseException = RuntimeError(
                text(
                    "store.lost",
                    stage=self.me.stage,
                    rank=self.me.rank,
                    pid=self.me.pid,
                    doing=doing,
                    silence=silence,
                    host=host,
                    cause=cause,
                )
            )
        else:
            state = describe_process(self.peers[rank], settle=1.0)
            if cause:  # it posted its own failure before it stopped beating
                state = f"failed with an error of its own ({cause}); see its traceback"
                cause = f"it stopped beating {silence:.0f} s ago after that error"
            elif state.startswith("is running"):
                state = (
                    "is running but does not beat: stuck in a native call that holds the "
                    "interpreter lock, or starved"
                )
            elif state.startswith("is on another host"):
                state = "is on another host: killed, stopped, or its host is unreachable"
            error = StageFailedError(
                self.peers[rank],
                self.me,
                waiting,
                self._heard.get(rank),
                self.microbatches,
                cause
                or f"no heartbeat from it for {silence:.0f} s (heartbeat_timeout {timeout:g} s)",
                self._completed.get(rank),
                state,
            )
        # a lost store while this process computes may be the normal end of the process
        # that hosts it: then only a wait that follows fails
        self.reporter.report(error, exit_unless_waiting=rank is not None)


def posting(watchdog: Watchdog | None, rank: int, what: str) -> contextlib.AbstractContextManager:
    """:meth:`Watchdog.posting`, or nothing where no watchdog is kept."""
    return watchdog.posting(rank, what) if watchdog is not None else contextlib.nullcontext()
