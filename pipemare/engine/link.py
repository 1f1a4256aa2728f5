"""The link between two neighbouring stages: its latency and bandwidth, measured or simulated.

A message of ``b`` bytes sent over a link of latency ``L`` and bandwidth ``W`` (bytes per
second) occupies the link for ``b / W`` seconds, behind the link's earlier messages (one
direction's messages are delivered in series; the two directions do not share), and arrives
``L`` seconds after it left the link. The replays
(:func:`pipemare.engine.telemetry.replay_timeline` and
:func:`pipemare.planner.cost.replayed_step_time`) and the simulated link in the transport
(:class:`LinkClock`) follow that one rule, so that a replay can be checked against real runs
over a slow link on one machine. A run measures its links at setup
(:func:`pipemare.engine.link_probe.measure_links`).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["Link", "LinkClock", "Links"]

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
