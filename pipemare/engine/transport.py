"""How stages exchange activations and gradients: in one process, or over torch.distributed.

Two channels connect neighbouring stages: ``ACT`` carries activations from stage ``i`` to
``i+1``, ``GRAD`` carries gradients from ``i+1`` to ``i``. Each channel is first-in first-out,
and every message carries its microbatch index, which the receiver checks. Between processes
the messages are torch.distributed point-to-point ones (:mod:`pipemare.engine.p2p`), each
described by a header (:mod:`pipemare.engine.wire`).
"""

from __future__ import annotations

import abc
import atexit
import collections
import datetime
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipemare.engine.errors import out_of_order
from pipemare.engine.layout import RankLayout
from pipemare.engine.link import Link, LinkClock
from pipemare.engine.p2p import Inbox, Outbox, channel_groups
from pipemare.engine.watchdog import Watchdog

__all__ = ["ACT", "GRAD", "DistributedTransport", "InProcessTransport", "Transport"]

ACT, GRAD = "act", "grad"

#: receives posted ahead per neighbour and channel: a message can be on the wire while the
#: previous one is still being computed on
DEPTH = 2


class Transport(abc.ABC):
    """Moves payloads (a tensor, or a tuple of tensors whose entries may be None) between stages."""

    #: how many stages the pipeline has
    num_stages: int
    #: stages that run in this process
    local_stages: tuple[int, ...]

    @abc.abstractmethod
    def send(self, src: int, dst: int, channel: str, microbatch: int, payload: Any) -> None:
        """Hand ``payload`` to stage ``dst`` without waiting for it to be received."""

    @abc.abstractmethod
    def ready(self, src: int, dst: int, channel: str) -> bool:
        """Whether :meth:`recv` would return at once (a blocking transport answers True)."""

    @abc.abstractmethod
    def recv(self, src: int, dst: int, channel: str, microbatch: int) -> Any:
        """The next payload from ``src`` on ``channel``, which must belong to ``microbatch``."""

    def release(self, src: int, dst: int, channel: str, microbatch: int) -> None:  # noqa: B027
        """The receiver is done with ``microbatch``'s payload; its buffers may be reused."""

    def progress(self, stage: int, completed: int) -> None:  # noqa: B027 - optional
        """Local ``stage`` has completed ``completed`` steps (applied that many updates)."""

    def connect(self, src: int, dst: int, channel: str) -> None:  # noqa: B027 - optional
        """Open ``channel`` from stage ``src`` to ``dst`` beside the neighbours' ``ACT`` and
        ``GRAD`` (tied weights, :mod:`pipemare.engine.ties`); every process calls it alike."""

    def flush(self) -> None:  # noqa: B027 - transports that deliver at once have nothing to wait for
        """Wait until everything sent has been delivered."""


class InProcessTransport(Transport):
    """Every stage in this process; payloads are passed by reference (no copy)."""

    def __init__(self, stages: int, device: torch.device | str | None = None) -> None:
        self.num_stages = stages
        self.local_stages = tuple(range(stages))
        self.device = torch.device(device) if device is not None else None
        self._queues: dict[tuple[int, int, str], collections.deque[tuple[int, Any]]] = (
            collections.defaultdict(collections.deque)
        )

    def send(self, src: int, dst: int, channel: str, microbatch: int, payload: Any) -> None:
        self._queues[src, dst, channel].append((microbatch, payload))

    def ready(self, src: int, dst: int, channel: str) -> bool:
        return bool(self._queues[src, dst, channel])

    def recv(self, src: int, dst: int, channel: str, microbatch: int) -> Any:
        got, payload = self._queues[src, dst, channel].popleft()
        if got != microbatch:
            raise out_of_order(src, dst, channel, microbatch, got)
        if self.device is not None:
            if isinstance(payload, torch.Tensor):
                return payload.to(self.device)
            payload = tuple(None if t is None else t.to(self.device) for t in payload)
        return payload

    def pending(self) -> int:
        """Messages sent and not yet received (zero once a pipeline has drained)."""
        return sum(len(q) for q in self._queues.values())


def init_process_group(backend: str) -> None:
    """Initialise the default process group from the launcher's environment, if not done yet."""
    if dist.is_initialized():
        return
    missing = [
        k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"torch.distributed is not initialised and {', '.join(missing)} are not set; start "
            "one process per stage with a launcher (torchrun --standalone --nproc-per-node=P, "
            "Lightning, SLURM) or run all stages in one process with transport='inprocess'"
        )
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    destroy_at_exit()


def destroy_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, before it tears itself
    down (once per process). Left to the interpreter's teardown, gloo's worker threads can
    still hold work whose tensors need the interpreter, and the process occasionally aborts
    at its very end ("terminate called without an active exception", SIGABRT) after a run
    that succeeded. Lightning does this for NCCL only."""
    global _destroy_registered
    if not _destroy_registered:
        atexit.register(_destroy_default_group)
        _destroy_registered = True


_destroy_registered = False


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _own_group(groups: Sequence[Sequence[int]], rank: int, backend: str) -> Any:
    """Create every group of ``groups`` (each process must create them all, in the same order)
    and return the one that holds ``rank``."""
    own = None
    for ranks in groups:
        group = dist.new_group(list(ranks), backend=backend)
        if rank in ranks:
            own = group
    return own


class DistributedTransport(Transport):
    """One stage per process over torch.distributed point-to-point messages.

    The backend follows the device: NCCL for CUDA, gloo otherwise. Activations and
    gradients travel in separate process groups, so each communicator carries traffic in one
    direction only and every send meets its receive in order, which NCCL needs (its
    point-to-point calls between a pair of ranks share one stream) and gloo tolerates.
    Receives are posted ahead of need (see :class:`~pipemare.engine.p2p.Inbox`), so data
    moves while both sides compute; a stage hands a received payload back with
    :meth:`release` once it no longer needs it, and its buffers receive a later message.

    Args:
        stages: number of stages; must equal the world size (the default) unless ``layout``
            runs several copies of the pipeline.
        device: this process's device; CUDA selects NCCL.
        layout: ``D`` data-parallel copies of the pipeline
            (:class:`~pipemare.engine.layout.RankLayout`): this process talks to the ranks of
            its own copy, and :attr:`replica_group` joins the ranks that hold its stage in
            every copy.
        stall_timeout: seconds any wait for another stage may take before this process
            fails, naming that stage (see :mod:`pipemare.engine.watchdog`).
        heartbeat_timeout: seconds without a heartbeat after which another process is named
            as lost (killed, stopped or unreachable) however long a step takes (see
            :mod:`pipemare.engine.heartbeat`); None: no heartbeat, ``stall_timeout`` alone.
        simulated_link: a slower link than the real one between neighbouring stages, for
            checking a replay on one machine (:mod:`pipemare.engine.link`): a
            :class:`~pipemare.engine.link.Link` or ``"1Gb/s@1ms"``. Each message becomes
            receivable no earlier than its send time plus the latency plus its bytes over the
            bandwidth, one direction's messages in series; senders never wait for it.
    """

    def __init__(
        self,
        stages: int | None = None,
        device: torch.device | str = "cpu",
        stall_timeout: float = 300.0,
        layout: RankLayout | None = None,
        heartbeat_timeout: float | None = 30.0,
        simulated_link: Link | str | None = None,
    ) -> None:
        #: the simulated link between neighbours, or None (the real one alone)
        self.simulated_link = None if simulated_link is None else Link.parse(simulated_link)
        self.device = torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        init_process_group(backend)
        world, rank = dist.get_world_size(), dist.get_rank()
        stages = world if stages is None else stages
        if layout is not None:
            if (layout.world_size, layout.stages) != (world, stages):
                raise ValueError(
                    f"the layout is for {layout.world_size} processes and {layout.stages} stages, "
                    f"but the world size is {world} and the pipeline has {stages} stages"
                )
        elif world != stages:
            raise ValueError(
                f"the world size is {world} but the pipeline has {stages} stages; run one "
                f"process per stage (e.g. torchrun --standalone --nproc-per-node={stages}) or set "
                f"stages={world}"
            )
        if layout is not None:
            self.replica, me = layout.position(rank)
            order = list(range(stages))  # ranks of this copy, in stage order, below
        else:
            self.replica = 0
            order = list(range(world))  # rank r runs stage r
            me = rank
        if stall_timeout <= 0:
            raise ValueError(
                f"stall_timeout must be a positive number of seconds, got {stall_timeout}"
            )
        if heartbeat_timeout is not None and (
            isinstance(heartbeat_timeout, bool) or not 0 < heartbeat_timeout < math.inf
        ):
            raise ValueError(
                "heartbeat_timeout must be a positive number of seconds or None, got "
                f"{heartbeat_timeout}"
            )
        self.num_stages = stages
        #: D, the copies of the pipeline; this process runs stage ``me`` of copy ``replica``
        self.replicas = layout.replicas if layout is not None else 1
        if layout is not None:
            self._rank_of = dict(enumerate(layout.pipelines[self.replica]))
        else:
            self._rank_of = {stage: r for r, stage in enumerate(order)}
        self.local_stages = (me,)
        #: deadlines on every wait, and errors naming the stage that failed
        self.watchdog = Watchdog.of_job(me, datetime.timedelta(seconds=stall_timeout))
        if heartbeat_timeout is not None:
            self.watchdog.start_heartbeat(heartbeat_timeout)
        # per channel, the groups its messages travel in
        groups = {ch: channel_groups(backend) for ch in (ACT, GRAD)}
        #: a group of its own for collectives over this copy's stages (gradient norms)
        self.collective_group = _own_group(
            layout.pipelines if layout is not None else [tuple(range(world))], rank, backend
        )
        #: the ranks holding this stage in every copy (they average gradients), or None
        self.replica_group = (
            _own_group(layout.stage_groups, rank, backend)
            if layout is not None and layout.replicas > 1
            else None
        )
        #: the global rank of each copy's process of this stage, copy 0 first
        self.replica_ranks = layout.stage_groups[me] if layout is not None else (self._rank_of[me],)
        self._inbox: dict[tuple[int, str], Inbox] = {}
        self._outbox: dict[tuple[int, str], Outbox] = {}
        self._backend, self._depth = backend, DEPTH
        #: per local stage, the steps it has completed (updates applied), sent with each
        #: message so that a peer's error can say how far a failed stage got
        self.completed: dict[int, int] = {}
        for ch, src, dst in ((ACT, me - 1, me + 1), (GRAD, me + 1, me - 1)):
            if 0 <= src < stages:
                inbox = Inbox(self._rank_of[src], groups[ch], self.device, self.watchdog)
                for _ in range(DEPTH):
                    inbox.post(None)
                self._inbox[src, ch] = inbox
            if 0 <= dst < stages:
                self._outbox[dst, ch] = Outbox(
                    self._rank_of[dst], groups[ch], DEPTH, self.watchdog, ch, self._clock()
                )

    def rank_of(self, stage: int) -> int:
        """The global rank that runs ``stage`` in this process's copy of the pipeline."""
        return self._rank_of[stage]

    def connect(self, src: int, dst: int, channel: str) -> None:
        groups = channel_groups(self._backend)  # on every rank
        me = self.local_stages[0]
        if me == dst:
            inbox = Inbox(self._rank_of[src], groups, self.device, self.watchdog)
            for _ in range(self._depth):
                inbox.post(None)
            self._inbox[src, channel] = inbox
        if me == src:
            self._outbox[dst, channel] = Outbox(
                self._rank_of[dst], groups, self._depth, self.watchdog, channel, self._clock()
            )

    def _clock(self) -> LinkClock | None:
        return None if self.simulated_link is None else LinkClock(self.simulated_link)

    def send(self, src: int, dst: int, channel: str, microbatch: int, payload: Any) -> None:
        completed = self.completed.get(src, 0)
        self._outbox[dst, channel].send(microbatch, payload, self.device, completed)

    def ready(self, src: int, dst: int, channel: str) -> bool:
        return True

    def progress(self, stage: int, completed: int) -> None:
        self.completed[stage] = completed

    def recv(self, src: int, dst: int, channel: str, microbatch: int) -> Any:
        return self._inbox[src, channel].take(src, dst, channel, microbatch)

    def release(self, src: int, dst: int, channel: str, microbatch: int) -> None:
        self._inbox[src, channel].release(microbatch)

    def flush(self) -> None:
        for outbox in self._outbox.values():
            outbox.in_flight.wait_all()

    def in_flight(self) -> int:
        """Messages sent and not known to be delivered (bounded: see
        :class:`~pipemare.engine.p2p.SendsInFlight`)."""
        return sum(len(outbox.in_flight) for outbox in self._outbox.values())
