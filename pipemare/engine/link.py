"""The link between two neighbouring stages: its latency and bandwidth, measured or simulated.

A message of ``b`` bytes sent over a link of latency ``L`` and bandwidth ``W`` (bytes per
second) occupies the link for ``b / W`` seconds, behind the link's earlier messages (one
direction's messages are delivered in series; the two directions do not share), and arrives
``L`` seconds after it left the link. The replays
(:func:`pipemare.engine.telemetry.replay_timeline` and
:func:`pipemare.planner.cost.replayed_step_time`) and the simulated link in the transport
(:class:`LinkClock`) follow that one rule, so that a replay can be checked against real runs
over a slow link on one machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Link", "LinkClock", "Links", "measure_links"]

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
_SPEC = re.compile(
    r"^\s*(?P<rate>[0-9.]+(?:e-?[0-9]+)?)\s*(?P<unit>[kmgt]?)(?P<kind>b|B)(?:it)?(?:ps|/s)\s*"
    r"[,@]\s*(?P<latency>[0-9.]+(?:e-?[0-9]+)?)\s*(?P<tunit>s|ms|us|µs)\s*$",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True)
class Link:
    """A link's latency (seconds) and bandwidth (bytes per second), and what each message
    costs the two processes' own threads beside the wire: ``send_s`` the sender's (posting
    the message, its header, keeping it until delivered) and ``recv_s`` the receiver's
    (taking it, posting the receive for a later one); 0 where not measured."""

    latency_s: float
    bandwidth: float
    send_s: float = 0.0
    recv_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.bandwidth > 0):
            raise ValueError(
                f"a link needs a latency of at least 0 s and a positive bandwidth, got "
                f"{self.latency_s} s and {self.bandwidth} bytes/s"
            )
        if not (self.send_s >= 0 and self.recv_s >= 0):
            raise ValueError(
                f"a message's seconds of CPU cannot be negative, got {self.send_s} s to send "
                f"and {self.recv_s} s to receive"
            )

    def transfer_s(self, nbytes: float) -> float:
        """Seconds ``nbytes`` occupy the link (the latency not included)."""
        return nbytes / self.bandwidth

    def seconds(self, nbytes: float) -> float:
        """Seconds from the start of sending ``nbytes`` on an idle link to their arrival."""
        return self.latency_s + self.transfer_s(nbytes)

    @classmethod
    def parse(cls, spec: str | Link) -> Link:
        """A link from ``"1Gb/s@1ms"`` (also ``"10Gbps,20us"``, ``"400MB/s@5us"``): bits
        (``b``) or bytes (``B``) per second with a k, M, G or T prefix, then the latency.

        Example:
            >>> Link.parse("1Gb/s@1ms")
            Link(latency_s=0.001, bandwidth=125000000.0, send_s=0.0, recv_s=0.0)
            >>> print(Link.parse("10Gbps, 20us"))
            10 Gb/s at 20 µs
        """
        if isinstance(spec, Link):
            return spec
        match = _SPEC.match(spec) if isinstance(spec, str) else None
        if match is None:
            raise ValueError(
                f"cannot read the link {spec!r}: give its bandwidth and latency, e.g. "
                "'1Gb/s@1ms', '10Gbps@20us' or '400MB/s@5us'"
            )
        rate = float(match["rate"]) * _UNITS[match["unit"].lower()]
        bandwidth = rate / 8 if match["kind"] == "b" else rate
        latency = float(match["latency"]) * _TIMES[match["tunit"].lower()]
        return cls(latency, bandwidth)

    def __str__(self) -> str:
        bits = self.bandwidth * 8
        unit, scale = next(
            ((u, f) for u, f in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if bits >= f),
            ("", 1.0),
        )
        if self.latency_s >= 1e-3:
            shown = f"{bits / scale:.3g} {unit}b/s at {self.latency_s * 1e3:.3g} ms"
        else:
            shown = f"{bits / scale:.3g} {unit}b/s at {self.latency_s * 1e6:.3g} µs"
        if self.send_s or self.recv_s:
            shown += (
                f" (a message's CPU: {self.send_s * 1e3:.2g} ms to send, "
                f"{self.recv_s * 1e3:.2g} ms to receive)"
            )
        return shown


class LinkClock:
    """When each message sent over one simulated link may be received.

    The sender stamps each message with :meth:`deliver_at` as it sends it; the receiver holds
    the message until then (the transport's :class:`~pipemare.engine.p2p.Inbox`). The sender
    never waits for the link: a slow link delays the receiver, as a real one would.
    """

    def __init__(self, link: Link, clock: Any = time.time) -> None:
        self.link, self._clock = link, clock
        self._free = 0.0  # when the link has sent everything before

    def deliver_at(self, nbytes: float) -> float:
        """The time (the clock's, seconds) a message of ``nbytes`` sent now arrives."""
        start = max(self._clock(), self._free)
        self._free = start + self.link.transfer_s(nbytes)
        return self._free + self.link.latency_s


class Links:
    """A replay's links: when a message that one stage finished sending reaches its neighbour.

    ``links[i]`` joins stages ``i`` and ``i + 1``; ``message_bytes[i]`` is what one microbatch
    carries across it (its activations forward; its gradients, the same size, back). Each
    direction of each link delivers its messages in the order they were sent, one at a time.
    Ask in the order the messages are sent.

    A stage's action also pays its messages' own CPU (:attr:`Link.send_s`,
    :attr:`Link.recv_s`): a forward takes its input from the stage before and sends its
    output on, a backward takes its output's gradient from the stage after and sends its
    input's back (:meth:`cpu_s`).

    Example:
        >>> links = Links([Link(0.001, 1e6)], [1000])  # 1 ms, 1 MB/s: 1 ms per message
        >>> links.arrival(0, forward=True, sent=0.0), links.arrival(0, forward=True, sent=0.0)
        (0.002, 0.003)
    """

    def __init__(self, links: Sequence[Link], message_bytes: Sequence[float]) -> None:
        if len(links) != len(message_bytes):
            raise ValueError(
                f"one message size per link: {len(links)} links, {len(message_bytes)} sizes"
            )
        self.links, self.message_bytes = list(links), list(message_bytes)
        self._free: dict[tuple[int, bool], float] = {}

    def cpu_s(self, stage: int, name: str) -> float:
        """Seconds of its own CPU ``stage`` spends on the messages of one forward (``"F"``) or
        backward (``"B"``): what it takes in and what it sends on; 0 for any other action.

        Example:
            >>> links = Links([Link(0.0, 1e9, send_s=0.3, recv_s=0.2)] * 2, [8, 8])
            >>> [links.cpu_s(stage, "F") for stage in range(3)]
            [0.3, 0.5, 0.2]
            >>> [links.cpu_s(stage, "B") for stage in range(3)], links.cpu_s(1, "U")
            ([0.2, 0.5, 0.3], 0.0)
        """
        if name not in ("F", "B"):
            return 0.0
        before = self.links[stage - 1] if stage > 0 else None
        after = self.links[stage] if stage < len(self.links) else None
        # a forward comes in from before and goes on after; a backward the other way
        taken, sent = (before, after) if name == "F" else (after, before)
        return (taken.recv_s if taken else 0.0) + (sent.send_s if sent else 0.0)

    def arrival(self, edge: int, forward: bool, sent: float) -> float:
        """When the message stage ``edge`` (forward) or ``edge + 1`` (back) sent at ``sent``
        arrives across link ``edge``."""
        link = self.links[edge]
        start = max(sent, self._free.get((edge, forward), 0.0))
        self._free[edge, forward] = start + link.transfer_s(self.message_bytes[edge])
        return self._free[edge, forward] + link.latency_s


def _round_trips(
    peer: int, nbytes: int, first: bool, repeats: int, group: Any, device: torch.device
) -> list[float]:
    """Seconds of each of ``repeats`` round trips of ``nbytes`` to ``peer`` and back (after one
    warm-up trip); ``first``: this rank sends first. On a GPU each trip waits for the device
    (NCCL's sends and receives are queued on a stream)."""
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    trips = []
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        if first:
            dist.send(buffer, peer, group=group)
            dist.recv(buffer, peer, group=group)
        else:
            dist.recv(buffer, peer, group=group)
            dist.send(buffer, peer, group=group)
        sync()
        if i:
            trips.append(time.perf_counter() - start)
    return trips


def measure_links(
    stage_ranks: list[int],
    nbytes: list[int],
    repeats: int = 7,
    group: Any = None,
    device: torch.device | str = "cpu",
    messages: bool = True,
) -> list[Link]:
    """Every link of the pipeline whose stage ``i`` runs on rank ``stage_ranks[i]``: the
    latency from the round trip of a tiny message, the bandwidth from the round trip of
    ``nbytes[i]`` (the run's activation across link ``i``), each the fastest of ``repeats``
    trips (a pause on a busy machine can only lengthen a trip). Where the large message's trip
    is no longer than the tiny one's, the bandwidth is taken as carrying it in a microsecond.
    With ``messages``, also what a message of ``nbytes[i]`` costs each side's own thread
    through the engine's transport (:func:`~pipemare.engine.p2p.message_cpu`: the median of
    15 one way, stage ``i`` sending): :attr:`Link.send_s` and :attr:`Link.recv_s`.
    Every rank of the group calls it alike; each link is measured by its two ranks
    while the others wait (links one apart in turn, so no rank serves two at once), and the
    result is shared with every rank. ``device``: this process's, whose tensors the backend
    carries (CUDA for NCCL).
    """
    from pipemare.engine.p2p import message_cpu  # the transport's module imports this one
    from pipemare.engine.watchdog import Watchdog, this_process

    rank, device = dist.get_rank(), torch.device(device)
    probe: tuple[Any, Any, Any] | None = None
    watchdog = None
    if messages:  # the transport's three groups a channel, and a watchdog naming the peer
        backend = dist.get_backend(group)
        probe = (
            dist.new_group(backend=backend),
            dist.new_group(backend=backend),
            dist.new_group(backend=backend),
        )
        peers: list[Any] = [None] * dist.get_world_size()
        me = stage_ranks.index(rank) if rank in stage_ranks else -1
        dist.all_gather_object(peers, this_process(rank, me))
        watchdog = Watchdog(peers, peers[rank], datetime.timedelta(seconds=300))
    found: dict[int, dict[str, float]] = {}
    for parity in (0, 1):
        for i in range(parity, len(stage_ranks) - 1, 2):
            a, b = stage_ranks[i], stage_ranks[i + 1]
            if rank not in (a, b):
                continue
            peer, first = (b if rank == a else a), rank == a
            small = min(_round_trips(peer, 4, first, repeats, group, device))
            big = min(_round_trips(peer, nbytes[i], first, repeats, group, device))
            found[i] = {"small": small, "big": big}
            if probe is not None and watchdog is not None:
                side = "send" if first else "recv"
                found[i][side] = message_cpu(peer, first, nbytes[i], probe, watchdog, device=device)
        dist.barrier(group=group)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, found, group=group)
    seen: dict[int, dict[str, float]] = {}
    for part in gathered:
        for i, figures in part.items():
            seen.setdefault(i, {}).update(figures)
    links = []
    for i in range(len(stage_ranks) - 1):
        small, big = seen[i]["small"], seen[i]["big"]
        latency = small / 2
        spent = max(big / 2 - latency, 1e-6)
        cpu = {"send_s": seen[i].get("send", 0.0), "recv_s": seen[i].get("recv", 0.0)}
        links.append(Link(latency, max(nbytes[i], 4) / spent, **cpu))
    return links
