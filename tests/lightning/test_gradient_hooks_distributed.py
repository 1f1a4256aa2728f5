"""Lightning's gradient hooks over two real processes: each process's hooks see its own stage's
gradients, once per update, and every rank logs every stage's values at the same step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support import hooks_worker
from support.launch import ranks, reports, run_all, run_here

pytestmark = pytest.mark.distributed
WORKER = str(Path(__file__).resolve().parents[1] / "support" / "hooks_worker.py")
STAGE_PARAMS = {0: {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}}
STAGE_PARAMS[1] = {"net.4.weight", "net.4.bias"}


def test_each_process_sees_its_stage_and_every_rank_logs_every_stage(tmp_path):
    procs, sim = tmp_path / "procs", tmp_path / "sim"
    procs.mkdir()
    sim.mkdir()
    run_all(ranks([sys.executable, WORKER, "--out", str(procs), "--devices", "2"], 2))
    run_here(hooks_worker.main, "--out", str(sim), "--devices", "1", "--stages", "2")
    stages = reports(procs, 2)
    (simulated,) = reports(sim, 1)
    steps = hooks_worker.STEPS

    applied = {}  # (stage, minibatch) -> norms, over both processes
    for rank, report in enumerate(stages):
        assert [(s, k) for s, k, _ in report["applied"]] == [(rank, k) for k in range(steps)]
        assert report["after_backward"] == steps  # once per update of its own stage
        for stage, k, norms in report["applied"]:
            assert set(norms) == STAGE_PARAMS[stage]
            applied[stage, k] = norms
    # the same norms as the stages simulated in one process
    assert len(simulated["applied"]) == 2 * steps
    for stage, k, norms in simulated["applied"]:
        assert norms == pytest.approx(applied[stage, k], rel=1e-6)

    # every rank logs the same values, each the norm that stage applied to that minibatch
    lag = stages[0]["lag"]
    assert stages[0]["steps"] == stages[1]["steps"]
    checked = 0
    for t, logged in enumerate(stages[0]["steps"]):
        k = t - lag
        if k < 0:
            assert "updated" not in logged
            continue
        assert logged["updated"] == k
        for stage in (0, 1):
            for name in STAGE_PARAMS[stage]:
                assert logged[f"grad/{name}"] == pytest.approx(applied[stage, k][name], rel=1e-6)
        checked += 1
    assert checked == steps - lag
