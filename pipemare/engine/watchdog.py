"""Waiting on another stage without hanging, and failing with a message that says who failed.

Every wait on a message from another process has a deadline (``stall_timeout``, default 5
minutes, far below torch's 30-minute process-group timeout): a stage that stopped responding
(SIGSTOP, a deadlock, a hung device) makes its neighbours fail instead of hanging, and their
exit closes their connections, so the failure reaches every process. Both a timeout and a
connection the peer closed (it was killed, or crashed) become :class:`StageFailedError`, which
names the peer's stage, rank, host and PID, the last microbatch heard from it, and, when the
peer runs on this host, what its process is doing now (gone, or stopped).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Any

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


def describe_process(peer: Peer) -> str:
    """What the peer's process is doing, where this host can tell (same host only)."""
    if peer.host != socket.gethostname():
        return "is on another host"
    try:
        with open(f"/proc/{peer.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "is gone (killed or crashed)"
    if state in ("T", "t"):
        return "is stopped (SIGSTOP or a debugger)"
    if state == "Z":  # exited, not yet reaped by its parent
        return "is gone (killed or crashed)"
    return "is running but did not answer"


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
        what: str,
        last_microbatch: int | None,
        microbatches: int,
        cause: str,
        completed: int | None = None,
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
        super().__init__(
            f"pipemare: stage {peer.stage} (rank {peer.rank}, host {peer.host}, pid {peer.pid}) "
            f"failed or stopped responding: its process {describe_process(peer)}; stage "
            f"{me.stage} (rank {me.rank}, pid {me.pid}) was waiting for its {what}; {heard}. "
            f"Cause: {cause.splitlines()[0] if cause else 'unknown'}"
        )


class Watchdog:
    """Waits on point-to-point work with a deadline; turns failures into StageFailedError.

    Args:
        peers: every rank's :class:`Peer`, indexed by rank.
        me: this process.
        timeout: the longest a single wait may take.
    """

    def __init__(self, peers: list[Peer], me: Peer, timeout: datetime.timedelta) -> None:
        self.peers, self.me, self.timeout = peers, me, timeout
        self.microbatches = 1
        self._heard: dict[int, int] = {}
        self._completed: dict[int, int] = {}

    def heard(self, rank: int, microbatch: int, completed: int | None = None) -> None:
        """A message of ``microbatch`` arrived from ``rank``, whose stage had then completed
        ``completed`` steps (applied that many updates)."""
        self._heard[rank] = microbatch
        if completed is not None:
            self._completed[rank] = completed

    def wait(self, work: Any, rank: int, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as err:
            raise self.failure(rank, what, err) from err

    def culprit(self) -> int | None:
        """A rank whose process this host can see is gone or stopped, if any."""
        for peer in self.peers:
            if peer.rank != self.me.rank and describe_process(peer).startswith(
                ("is gone", "is stopped")
            ):
                return peer.rank
        return None

    def failure(self, rank: int, what: str, err: BaseException) -> StageFailedError:
        return StageFailedError(
            self.peers[rank],
            self.me,
            what,
            self._heard.get(rank),
            self.microbatches,
            str(err),
            self._completed.get(rank),
        )
