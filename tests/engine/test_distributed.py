"""Simulation equals distribution: gloo processes end with the in-process run's weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from support import dist_worker as worker
from support.launch import ranks, run_all

pytestmark = pytest.mark.distributed
SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the worker scripts


def start_ranks(nproc: int, script: Path, *args: str, timeout: float = 240) -> None:
    """Run ``script`` on ``nproc`` local processes, each rank started here with the environment
    torchrun would give it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``)."""
    run_all(ranks([sys.executable, str(script), *args], nproc), timeout=timeout)


@pytest.mark.parametrize("world", [2, 3])
def test_processes_match_the_simulator(world, tmp_path, one_thread):
    start_ranks(world, SUPPORT / "dist_worker.py", "--out", str(tmp_path))
    for schedule in ("async", "pipemare"):
        model, pipe, _ = worker.train(schedule, world, "inprocess")
        moved = 0.0
        for rank in range(world):
            saved = torch.load(tmp_path / f"{schedule}-rank{rank}.pt")
            # sends are let go once delivered: at most depth + 2 = 4 messages per neighbour
            # and channel in flight over the whole run, and none once drained
            assert saved["in_flight"]["most"] <= 2 * 4 and saved["in_flight"]["after_drain"] == 0
            local = pipe.stage_modules[saved["stage"]].state_dict()
            assert saved["state"].keys() == local.keys()
            for key, value in saved["state"].items():
                torch.testing.assert_close(
                    value,
                    local[key],
                    rtol=0,
                    atol=1e-6,
                    msg=f"{schedule} stage {saved['stage']} {key}",
                )
        fresh = worker.build_model()
        moved = max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
        )
        assert moved > 1e-2  # training changed the weights, so equality is not trivial
