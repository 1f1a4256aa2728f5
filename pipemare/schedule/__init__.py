"""What runs when, and how stale it is: the schedules as pure data and the delays they imply.

The lowest layer: no torch, no process, nothing but the action streams of each schedule
(:mod:`~pipemare.schedule.actions`) and the per-stage delays derived from them
(:mod:`~pipemare.schedule.delay`). Everything above reads delays from here; nothing types
them in.
"""

from pipemare.schedule.actions import (
    SCHEDULES,
    Action,
    Op,
    ScheduleSpec,
    drain_tail,
    generate,
    spec,
    stream,
)
from pipemare.schedule.delay import StageDelay, closed_form_delays, derive_delays

__all__ = [
    "SCHEDULES",
    "Action",
    "Op",
    "ScheduleSpec",
    "StageDelay",
    "closed_form_delays",
    "derive_delays",
    "drain_tail",
    "generate",
    "spec",
    "stream",
]
