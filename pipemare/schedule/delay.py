"""Per-stage weight delays, derived by replaying a schedule, and their closed form.

Convention: update ``k`` takes a stage's weights from version ``k`` to ``k+1`` (version ``k``
is the weights after ``k`` updates). Its gradient sums the microbatches of minibatch ``k``;
microbatch ``m`` ran its forward pass with version ``v_f(m)`` and its backward pass with
``v_b(m)``. The delays of that microbatch are ``k - v_f(m)`` and ``k - v_b(m)``: zero means
"the weights being updated", as in plain synchronous SGD.

In the non-flushing 1F1B stream, stage ``i`` lets ``s = P-1-i`` other microbatches pass
between a microbatch's forward and its backward, so microbatch ``r`` of a minibatch
(``0 <= r < N``) sees::

    τ_fwd(r) = ceil((s - r) / N)      mean over r: s / N      max: ceil(s / N)
    τ_bkwd   = 0                       (async, pipemare: the live weights)
    τ_bkwd   = τ_fwd                   (pipedream: the stashed forward version)

Flushing schedules (gpipe, 1f1b) have zero delays. A minibatch therefore mixes two adjacent
delays; the *stage delay* used by T1 and T2 is the mean, which is exact for the gradient's
average staleness. This is the executed 1F1B stream's delay: a stage alternates one forward and
one backward, so it is about half of PipeMare's ``(2(P-i)+1)/N`` (Yang et al., MLSys 2021),
whose hardware model overlaps a stage's forward and backward work.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction

from pipemare.schedule.actions import Op, generate, spec

__all__ = ["StageDelay", "closed_form_delays", "derive_delays"]


@dataclasses.dataclass(frozen=True)
class StageDelay:
    """Steady-state delays of one stage, in optimiser updates.

    Attributes:
        forward: mean forward delay τ_fwd over a minibatch's microbatches.
        backward: mean backward delay τ_bkwd.
        per_microbatch: ``(τ_fwd, τ_bkwd)`` of microbatch ``r`` of a minibatch, ``r = 0..N-1``.
    """

    forward: float
    backward: float
    per_microbatch: tuple[tuple[int, int], ...]

    @property
    def forward_max(self) -> int:
        """The largest forward delay any microbatch sees."""
        return max(f for f, _ in self.per_microbatch)

    @property
    def discrepancy(self) -> float:
        """Δ = τ_fwd - τ_bkwd: updates between a gradient's forward and backward weights."""
        return self.forward - self.backward


def _from_table(table: list[tuple[int, int]]) -> StageDelay:
    n = len(table)
    fwd = Fraction(sum(f for f, _ in table), n)
    bkwd = Fraction(sum(b for _, b in table), n)
    return StageDelay(float(fwd), float(bkwd), tuple(table))


@functools.lru_cache(maxsize=256)  # a pure function of its arguments, its result immutable
def derive_delays(schedule: str, stages: int, microbatches: int) -> tuple[StageDelay, ...]:
    """Replay the schedule's action lists with version counters and read off the delays.

    This follows exactly the actions the executor runs, so it is the ground truth the closed
    form is checked against. The replay is long enough to pass the pipeline fill, and every
    steady-state minibatch must show the same delays (otherwise the schedule has no steady
    state and this raises).
    """
    sp = spec(schedule)
    fill = math.ceil((stages - 1) / microbatches) + 1
    minibatches = 2 * fill + 2
    plans = generate(schedule, stages, microbatches, minibatches)
    result = []
    for plan in plans:
        version, v_f, v_b = 0, {}, {}
        for action in plan:
            if action.op is Op.FORWARD:
                v_f[action.index] = version
            elif action.op is Op.BACKWARD:
                v_b[action.index] = v_f[action.index] if sp.stashes else version
            else:
                version += 1
        tables = []
        for k in range(fill, minibatches):
            ms = range(k * microbatches, (k + 1) * microbatches)
            tables.append([(k - v_f[m], k - v_b[m]) for m in ms])
        if any(t != tables[0] for t in tables):
            raise RuntimeError(f"schedule {schedule!r} has no steady state: {tables}")
        result.append(_from_table(tables[0]))
    return tuple(result)


def closed_form_delays(schedule: str, stages: int, microbatches: int) -> tuple[StageDelay, ...]:
    """The documented closed form of :func:`derive_delays` (see the module docstring)."""
    sp = spec(schedule)
    result = []
    for stage in range(stages):
        s = stages - 1 - stage
        table = []
        for r in range(microbatches):
            fwd = 0 if sp.flushes else -((r - s) // microbatches)  # ceil((s - r) / N)
            table.append((fwd, fwd if sp.stashes else 0))
        result.append(_from_table(table))
    return tuple(result)
