"""The links between neighbouring stages' processes, measured at setup for the replays."""

from __future__ import annotations

import datetime
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from pipemare.engine.link import Link
from pipemare.engine.p2p import Inbox, Outbox, channel_groups
from pipemare.engine.transport import DEPTH
from pipemare.engine.watchdog import Watchdog

__all__ = ["measure_links", "message_cpu"]


def message_cpu(
    peer: int,
    sender: bool,
    nbytes: int,
    groups: tuple[Any, Any, Any],
    watchdog: Watchdog,
    repeats: int = 15,
    depth: int = DEPTH,
    device: torch.device | str = "cpu",
) -> float:
    """Seconds of this thread's CPU one message of ``nbytes`` costs this side, through the
    engine's own :class:`Outbox` (``sender``) or :class:`Inbox` (the receive posted ahead, the
    take, the release): the median of ``repeats``, after as many as fill the receives posted
    ``depth`` ahead. Thread time, so a wait for the peer or for the bytes costs nothing, as a
    replay that charges the link apart wants. ``peer`` calls it alike with the other role on
    the same ``groups`` (three, as the transport's channels have)."""
    device = torch.device(device)
    payload = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    warm, spent = depth + 2, []
    total = warm + repeats + depth
    if sender:
        outbox = Outbox(peer, groups, depth, channel="probe")
        for k in range(total):
            start = time.thread_time()
            outbox.send(k, payload, device)
            spent.append(time.thread_time() - start)
        outbox.in_flight.wait_all()
    else:
        inbox = Inbox(peer, groups, device, watchdog)
        for _ in range(depth):
            inbox.post(None)
        for k in range(total):
            start = time.thread_time()
            inbox.take(peer, -1, "probe", k, post_next=k < total - depth)
            inbox.release(k)
            spent.append(time.thread_time() - start)
    return statistics.median(spent[warm : warm + repeats])


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
    through the engine's transport (:func:`message_cpu`: the median of
    15 one way, stage ``i`` sending): :attr:`Link.send_s` and :attr:`Link.recv_s`.
    Every rank of the group calls it alike (with ``messages``, every rank of the job: the
    probe makes process groups of its own); each link is measured by its two ranks while
    every other rank waits, one link after another, and the result is shared with every rank.
    One at a time, because two pairs measuring at once on processes that share cores time
    each other: with four processes on two cores, links 0-1 and 2-3 measured together read
    78-397 µs of latency, and one link at a time 34-103 µs
    (``experiments/results/links/four_links.py``). ``device``: this process's, whose tensors
    the backend carries (CUDA for NCCL).
    """
    rank, device = dist.get_rank(), torch.device(device)
    probe: tuple[tuple[Any, Any, Any], Watchdog] | None = None
    if messages:  # a channel's groups, as the transport makes them, and a watchdog over them
        me = stage_ranks.index(rank) if rank in stage_ranks else -1
        probe = (
            channel_groups(dist.get_backend(group)),
            Watchdog.of_job(me, datetime.timedelta(seconds=300)),
        )
    found: dict[int, dict[str, float]] = {}
    for i in range(len(stage_ranks) - 1):  # one link at a time: see the docstring
        a, b = stage_ranks[i], stage_ranks[i + 1]
        if rank in (a, b):
            peer, first = (b if rank == a else a), rank == a
            small = min(_round_trips(peer, 4, first, repeats, group, device))
            big = min(_round_trips(peer, nbytes[i], first, repeats, group, device))
            found[i] = {"small": small, "big": big}
            if probe is not None:
                side = "send" if first else "recv"
                found[i][side] = message_cpu(peer, first, nbytes[i], *probe, device=device)
        dist.barrier(group=group)
    for probe_group in probe[0] if probe is not None else ():  # every message is in: the run
        dist.destroy_process_group(probe_group)  # keeps none of their connections (NCCL's buffers)
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
