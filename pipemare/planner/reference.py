"""What asynchrony cost on the reference tasks: the measured figures the advice quotes.

They live in ``reference_quality.json`` beside this module (package data), written from the
results by ``experiments/studies/reference_quality.py`` and checked against them by a test; no
figure is typed in here. They describe the tasks they were measured on, not the user's model:
the advice names the tasks and their length beside every figure.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources

__all__ = ["ReferenceQuality", "measured_layouts", "measured_quality", "reference_cells"]

_DATA_FILE = "reference_quality.json"


@dataclasses.dataclass(frozen=True)
class ReferenceQuality:
    """One asynchronous schedule at one P and N on one reference task, against one device
    (which 1F1B computes step for step).

    Attributes:
        task: the protocol's name for the task (``"gpt_c64s"``, ``"char_gpt@adamw"``).
        what: the task in words (model, regime, rate schedule).
        steps: the run's length in optimiser steps.
        lr: the rate every schedule ran at (tuned on one device).
        optimizer: the protocol's optimiser (``"nanogpt"``, ``"adamw"``, ``"muon"``).
        family: its family as :func:`~pipemare.planner.decide.optimizer_family` names it.
        schedule: the asynchronous schedule measured (``"pipemare"``, ``"async"``).
        stages: P.
        microbatches: N.
        seeds: seeds averaged.
        loss_gap: the final seed-mean validation loss at equal steps relative to one device's
            (0.044: 4.4% higher).
        steps_ratio: the steps the schedule took to come within 1% of one device's final
            seed-mean loss, over the steps one device took; None: never within the run.
        reach: how that step was read from the seeds.
        source: the results it was read from, relative to the repository.
    """

    task: str
    what: str
    steps: int
    lr: float
    optimizer: str
    family: str | None
    schedule: str
    stages: int
    microbatches: int
    seeds: int
    loss_gap: float
    steps_ratio: float | None
    reach: str
    source: str

    @property
    def label(self) -> str:
        """The task and its length, as the advice names it: ``"gpt_c64s (2,400 steps)"``."""
        return f"{self.task} ({self.steps:,} steps)"


@functools.cache
def reference_cells() -> tuple[ReferenceQuality, ...]:
    """Every cell of the shipped data file, in its order.

    Example:
        >>> cells = reference_cells()
        >>> all(c.schedule in ("pipemare", "async") and c.stages > 1 for c in cells)
        True
    """
    text = resources.files(__package__).joinpath(_DATA_FILE).read_text()
    return tuple(ReferenceQuality(**cell) for cell in json.loads(text)["references"])


def measured_quality(
    schedule: str, family: str | None, stages: int, microbatches: int
) -> tuple[ReferenceQuality, ...]:
    """The reference cells of ``schedule`` with this optimiser family at this P and N, the
    longest run first (a tie in the file's order); empty where none was measured.

    Example:
        >>> steps = [c.steps for c in measured_quality("pipemare", "adam", 4, 4)]
        >>> len(steps) > 1 and steps == sorted(steps, reverse=True)
        True
        >>> measured_quality("pipemare", "adam", 4, 3), measured_quality("pipemare", None, 4, 4)
        ((), ())
    """
    if family is None:
        return ()
    found = [
        c
        for c in reference_cells()
        if (c.schedule, c.family, c.stages, c.microbatches)
        == (schedule, family, stages, microbatches)
    ]
    return tuple(sorted(found, key=lambda c: -c.steps))


def measured_layouts(schedule: str, family: str | None) -> tuple[tuple[int, int], ...]:
    """Every (P, N) at which ``schedule`` was measured with this optimiser family, in order.

    Example:
        >>> (4, 4) in measured_layouts("pipemare", "adam"), measured_layouts("pipemare", None)
        (True, ())
    """
    return tuple(
        sorted(
            {
                (c.stages, c.microbatches)
                for c in reference_cells()
                if c.family is not None and (c.schedule, c.family) == (schedule, family)
            }
        )
    )
