"""A long run keeps nothing per step: every schedule, a tied weight and a torchmetrics metric
updated and logged in ``training_step``, on one process (with pipeline's three monitors) and
on two. After a warm-up, the live tensors never rise and resident memory stays within
a few MB over the second half of the run (a leak of one activation per microbatch, as the
transport had, adds ~20 tensors and ~9 MB every 50 steps at this size: the tensors' count
shows it within the 16 steps sampled). Each worker sets its imports aside from the collector
first (``support.memory.settle_imports``), so that a sample costs milliseconds, not half a
second; a leak is still counted: an input kept per microbatch, put back into the stage's
forward, fails both tests at this length (gpipe, rank 0: 20 tensors more every 4 steps, 404
at the half; simulated: 116 more every 4 steps, 714 at the half)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipemare import SCHEDULES
from support.launch import environment, ranks, run_all

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the worker scripts
WORKER = str(SUPPORT / "soak_worker.py")
STEPS, EVERY = 32, 4  # samples at 4, 8, ..., 32: warm-up, then the second half (16-32)
RESIDENT_MB = 8.0  # allowed growth over the second half, for allocator noise


def _soak(out: Path, processes: int, *options: str) -> list[dict]:
    args = [WORKER, "--out", str(out), "--steps", str(STEPS), "--every", str(EVERY), *options]
    if processes == 1:
        run_all([([sys.executable, *args], environment())], timeout=900)
    else:  # every rank started here, as torchrun starts them
        run_all(ranks([sys.executable, *args, "--devices", str(processes)], processes), 900)
    return [json.loads((out / f"soak-rank{r}.json").read_text()) for r in range(processes)]


def _second_half(samples: list[list[float]]) -> list[list[float]]:
    return [s for s in samples if s[0] >= STEPS // 2]


def _assert_level(report: dict, where: str) -> None:
    assert set(report) == set(SCHEDULES)
    for schedule, samples in report.items():
        late = _second_half(samples)
        assert len(late) >= 3, (where, schedule, samples)
        tensors = [t for _, _, t in late]
        resident = [mb for _, mb, _ in late]
        assert max(tensors) <= tensors[0], (where, schedule, samples)  # the last step drains
        assert max(resident) - resident[0] <= RESIDENT_MB, (where, schedule, samples)


@pytest.mark.distributed
def test_two_processes_keep_nothing_per_step(tmp_path):
    for rank, report in enumerate(_soak(tmp_path, 2)):
        _assert_level(report, f"rank {rank}")


def test_one_process_with_the_monitors_keeps_nothing_per_step(tmp_path):
    (report,) = _soak(tmp_path, 1, "--stages", "4", "--monitors")
    _assert_level(report, "simulated, 4 stages")
