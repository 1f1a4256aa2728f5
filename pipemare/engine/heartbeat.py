"""Liveness apart from progress: each stage process beats, and a peer that stops is named.

A stage's step can take minutes on a large model, so a deadline on progress
(``stall_timeout``) cannot tell a slow stage from a dead one. A heartbeat can: a thread in
every process bumps a counter of its own in the job's rendezvous store (the TCPStore that
``torch.distributed`` was initialised with, so it works across hosts) every
``timeout / 10`` seconds, and reads everybody else's. The thread runs through long
computations (torch releases the interpreter lock in its kernels, and in waits on other
processes), so a healthy stage keeps beating however long its forward takes. A counter that
has not moved over two reads ``timeout`` seconds apart means its process is killed,
stopped (SIGSTOP, a debugger), stuck in a native call that holds the interpreter lock, or
unreachable; this process then fails at once, naming that stage.

Only counters that moved are trusted: if this process itself is slowed (a busy host), its
reads are late but see a moved counter, so slowness here never reads as a death there. A
process that ends normally marks itself finished first, and is not reported.

When a peer is lost, the main thread raises the error at its next wait if it gets there
within a couple of seconds; when it is blocked in a wait that cannot be interrupted (a
receive from another process, a collective) or computes on, the heartbeat thread prints the
error and ends the process with exit code 1, after running the hooks registered with
:meth:`FatalReporter.on_fatal` (the Lightning launcher ends the processes it started). A
process that is already failing (its own exception) posts a one-line cause instead of
beating, so the others name it as failed, not as hung; a store that cannot be reached for
another ``timeout`` ends only a process that waits on the others.

Each process reads the other ``W - 1`` counters every interval: ``W**2 / interval`` store
operations per second in all, small for the tens of ranks a pipeline spans.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["FatalReporter", "Heartbeat", "announce", "store_address"]

#: how long the heartbeat thread leaves the main thread to raise a detected loss itself
GRACE_S = 2.0

#: this process's running heartbeat (one per process: a new run's replaces the last's)
_current: Heartbeat | None = None


def store_address() -> tuple[str, int] | None:
    """Host and port of the job's TCPStore (the default group's), or None where there is none
    (a ``file://`` or hash store): then no heartbeat runs, and ``stall_timeout`` alone applies."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no default group: the environment names the store, if anything does
        store = None
    if store is not None:
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        return (store.host, store.port) if isinstance(store, dist.TCPStore) else None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port and port.isdigit():
        return host, int(port)
    return None


class Heartbeat:
    """This process's heartbeat and its watch over the others (one per process group).

    Args:
        address: the TCPStore's host and port (:func:`store_address`); a connection of the
            heartbeat's own, so a long store wait of the main thread never delays a beat.
        rank: this process's rank; ``world``: the number of ranks.
        timeout: seconds without a beat after which a peer is lost.
        on_lost: called in the heartbeat thread with the lost rank and the seconds it has
            been silent (``None`` when the store itself cannot be reached).
        run: a name of this attempt of the job that every rank gives alike.
    """

    def __init__(
        self,
        address: tuple[str, int],
        rank: int,
        world: int,
        timeout: float,
        on_lost: Callable[[int | None, float, str], None],
        run: str = "",
    ) -> None:
        self.rank, self.world, self.timeout = rank, world, float(timeout)
        self.interval = max(min(self.timeout / 10, 5.0), 0.05)
        self._on_lost = on_lost
        Heartbeat.finish_current()
        # keys of this attempt only (a store kept across torchrun restarts holds older ones);
        # ``run`` is the same on every rank, e.g. rank 0's host and PID
        self._prefix = f"pipemare/heartbeat/{run}/"
        self._store = dist.TCPStore(
            address[0],
            address[1],
            is_master=False,
            timeout=datetime.timedelta(seconds=max(self.timeout, 5.0)),
            wait_for_workers=False,
        )
        self._store.delete_key(self._done(rank))  # a previous run in this process finished
        self._store.add(self._beat(rank), 1)
        #: per watched rank: (its last counter read, when it last changed, monotonic)
        self._seen: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipemare-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)
        global _current
        _current = self

    @staticmethod
    def finish_current(finished: bool = True, cause: str = "") -> None:
        """Stop this process's heartbeat, if one runs (see :meth:`finish`)."""
        if _current is not None:
            _current.finish(finished, cause)

    def _beat(self, rank: int) -> str:
        return f"{self._prefix}beat/{rank}"

    def _done(self, rank: int) -> str:
        return f"{self._prefix}done/{rank}"

    def _failed(self, rank: int) -> str:
        return f"{self._prefix}failed/{rank}"

    def _at_exit(self) -> None:
        # an exception that ended the interpreter is a failure, not a finished run
        error = getattr(sys, "last_value", None)
        self.finish(error is None, "" if error is None else f"{type(error).__name__}: {error}")

    def silence(self, rank: int) -> float | None:
        """Seconds since ``rank``'s counter was last seen to move (None: not watched yet)."""
        seen = self._seen.get(rank)
        return None if seen is None else time.monotonic() - seen[1]

    def finish(self, finished: bool = True, cause: str = "") -> None:
        """Stop beating and watching. ``finished``: the run ended normally, and the others
        stop watching this process; otherwise (it is failing, for ``cause``) they report it,
        with that cause, once its beat has stopped for ``timeout``."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self._at_exit)
        with contextlib.suppress(Exception):
            if finished:
                self._store.set(self._done(self.rank), "1")
            elif cause:
                self._store.set(self._failed(self.rank), cause.splitlines()[0][:300])
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5.0)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`finish` was called (the process ends, or handles its own error)."""
        return self._stop.is_set()

    def _run(self) -> None:
        start = time.monotonic()
        others = [r for r in range(self.world) if r != self.rank]
        self._seen = {r: (-1, start) for r in others}
        failing_since: float | None = None  # when the store stopped answering
        while not self._stop.wait(self.interval):
            try:
                self._store.add(self._beat(self.rank), 1)
                lost = self._check(others)
                failing_since = None
            except Exception as err:  # the store's host is gone, stopped or unreachable
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if self._stop.is_set():
                    return
                if now - failing_since > self.timeout:
                    self._on_lost(None, now - failing_since, f"{type(err).__name__}: {err}")
                    return
                continue
            if lost is not None:
                rank, cause = lost
                self._on_lost(rank, time.monotonic() - self._seen[rank][1], cause)
                return

    def _check(self, others: list[int]) -> tuple[int, str] | None:
        """A watched rank silent for longer than ``timeout`` and what it posted of its failure
        (empty: nothing), after dropping those that finished."""
        now = time.monotonic()
        for r in list(others):
            count = self._store.add(self._beat(r), 0)
            last, since = self._seen[r]
            if count != last:
                self._seen[r] = (count, now)
            elif now - since > self.timeout:
                if self._store.check([self._done(r)]):
                    others.remove(r)  # it finished its run; it is not watched any more
                    continue
                failed = self._failed(r)
                cause = self._store.get(failed).decode() if self._store.check([failed]) else ""
                return r, cause
        return None


def announce(error: BaseException) -> None:
    """Print a failure where and when it is found (stderr, flushed): a process can be ended
    from outside before its traceback prints (Lightning's launcher ends rank 0 within 5 s
    of a child's failed exit)."""
    with contextlib.suppress(Exception):
        print(f"\n{error}\n", file=sys.stderr, flush=True)


class FatalReporter:
    """Turns a lost peer found by the heartbeat thread into an error for the main thread, or,
    when the main thread cannot take it (blocked in a wait), into a printed error and exit 1."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        #: what the main thread waits for now, and from which rank
        self.waiting: str | None = None
        self.waiting_rank: int | None = None
        #: whether the process stopped its heartbeat (it ends, or handles an error of its own)
        self.stopped: Callable[[], bool] = lambda: False
        self._taken = threading.Event()
        self._hooks: list[Callable[[], Any]] = []

    def on_fatal(self, hook: Callable[[], Any]) -> None:
        """Run ``hook`` before this process is ended by the heartbeat thread."""
        self._hooks.append(hook)

    def take(self) -> BaseException | None:
        """The error to raise in the main thread, if the heartbeat found one."""
        if self.error is not None:
            self._taken.set()
        return self.error

    def report(self, error: BaseException, exit_unless_waiting: bool = True) -> None:
        """Hand ``error`` to the main thread. When the main thread is blocked in a wait, or
        does not take it within :data:`GRACE_S` and ``exit_unless_waiting``, print it, run
        the hooks and end the process with exit code 1."""
        self.error = error
        if self.waiting is None and (not exit_unless_waiting or self._taken.wait(GRACE_S)):
            return  # the main thread raises it
        if self.waiting is None and self.stopped():
            return  # the main thread is handling an error of its own: let it finish
        announce(error)
        for hook in self._hooks:
            with contextlib.suppress(Exception):
                hook()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(1)
