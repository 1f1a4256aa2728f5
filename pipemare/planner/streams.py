"""A schedule's action streams as the cost model replays them: their dependencies and the
microbatches and weight versions each stage holds at its peak.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pipemare.schedule.actions import Op, generate, spec


@dataclasses.dataclass(frozen=True)
class _Streams:
    """A schedule's action lists for a replay, in an order that respects the dependencies."""

    order: tuple[tuple[int, Op, int], ...]
    first: int  # the steady-state window's first and last minibatch
    last: int
    peaks: tuple[tuple[int, int], ...]  # per stage: most microbatches in flight, stashed versions


_STREAMS: dict[tuple[str, int, int], _Streams] = {}


def _streams(schedule: str, stages: int, microbatches: int) -> _Streams:
    key = (schedule, stages, microbatches)
    if key not in _STREAMS:
        fill = -(-stages // microbatches)  # minibatches in flight on stage 0 at most
        first, window = fill + 2, 6
        plans = generate(schedule, stages, microbatches, first + window + fill + 1)
        _STREAMS[key] = _Streams(
            _causal(plans),
            first,
            first + window,
            tuple(_peaks(actions, microbatches, spec(schedule).stashes) for actions in plans),
        )
    return _STREAMS[key]


def _causal(plans: list[list[Any]]) -> tuple[tuple[int, Op, int], ...]:
    """Interleave the stages' actions as the executor would: each waits for its inputs."""
    last, pos = len(plans) - 1, [0] * len(plans)
    done: set[tuple[int, Op, int]] = set()
    order: list[tuple[int, Op, int]] = []
    progressed = True
    while progressed:
        progressed = False
        for i, actions in enumerate(plans):
            while pos[i] < len(actions):
                a = actions[pos[i]]
                if a.op is Op.FORWARD and i > 0 and (i - 1, Op.FORWARD, a.index) not in done:
                    break
                if a.op is Op.BACKWARD and i < last and (i + 1, Op.BACKWARD, a.index) not in done:
                    break
                done.add((i, a.op, a.index))
                order.append((i, a.op, a.index))
                pos[i] += 1
                progressed = True
    return tuple(order)


def _peaks(actions: Sequence[Any], microbatches: int, stashes: bool) -> tuple[int, int]:
    """Most microbatches in flight on a stage, and most weight versions it stashes.

    Follows :class:`pipemare.engine.stage.Stage`: a microbatch is in flight from its forward to its
    backward; with weight stashing an update copies the live version when an in-flight
    microbatch still needs it, and a copy goes when its last microbatch's backward ran.
    """
    version, pending, users = 0, {}, Counter[int]()
    stash: set[int] = set()
    peak_flight = peak_stash = 0
    for a in actions:
        if a.op is Op.FORWARD:
            pending[a.index] = version
            users[version] += 1
            peak_flight = max(peak_flight, len(pending))
        elif a.op is Op.BACKWARD:
            v = pending.pop(a.index)
            users[v] -= 1
            if users[v] == 0:
                del users[v]
                stash.discard(v)
        else:
            if stashes and users[version] > 0:
                stash.add(version)
                peak_stash = max(peak_stash, len(stash))
            version += 1
    return peak_flight, peak_stash
