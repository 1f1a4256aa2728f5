"""A step's reported loss and logs are those of the minibatch ``lag`` steps earlier, everywhere.

Pure checks of the lag against its closed form, then real runs: three gloo processes (one
stage each) and the same three stages simulated in one process report, step by step, the same
minibatch's values; epoch aggregates cover exactly their epoch; predictions stay per batch.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from pipemare.engine.lagged import LocalResults, result_lag
from pipemare.engine.microbatch import combine, scatter
from pipemare.schedule.actions import SCHEDULES, spec
from support import lag_worker
from support.launch import environment, ranks, reports, run, run_all, run_here

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the worker scripts
WORKER = str(SUPPORT / "lag_worker.py")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_lag_is_zero_when_flushing_else_ceil_p_minus_one_over_n(schedule):
    for p in range(1, 10):
        for n in range(1, 9):
            want = 0 if spec(schedule).flushes else math.ceil((p - 1) / n)
            assert result_lag(schedule, p, n) == want, (p, n)


def test_results_are_taken_once_in_order():
    board = LocalResults(start=3)
    for k in range(3, 7):
        board.publish(k, f"m{k}")
    assert board.take_through(2) == []
    assert board.take_through(4) == ["m3", "m4"]
    assert board.take_through(4) == []
    assert board.take_through(6) == ["m5", "m6"]


def test_combine_inverts_scatter():
    x = torch.arange(10.0).reshape(5, 2)
    parts = scatter((x, {"y": x[:, 0]}), 2)
    sizes = [3, 2]
    whole = combine(parts, sizes)
    assert torch.equal(whole[0], x) and torch.equal(whole[1]["y"], x[:, 0])
    means = [torch.tensor(2.0), torch.tensor(7.0)]
    assert combine(means, sizes).item() == pytest.approx((3 * 2 + 2 * 7) / 5)
    assert combine(["a", "b"], sizes) == ["a", "b"]


def _expected(report: dict) -> None:
    """Every step reports the minibatch ``lag`` earlier, the run's first and each epoch's last
    step their own; loss and logs come from the same minibatch; epoch sums are exact."""
    lag, steps = report["lag"], report["steps"]
    assert lag == 2  # P = 3, N = 1
    per_epoch = 5
    for t, s in enumerate(steps):
        epoch_step = t % per_epoch
        if epoch_step == per_epoch - 1 or t == 0:
            want = s["own_first_index"]  # caught up: its own minibatch
        elif epoch_step < lag:
            continue  # nothing new yet this epoch: no step value is logged
        else:
            want = steps[t - lag]["own_first_index"]
        assert s["first_index"] == want, (t, s)
        assert s["loss"] == pytest.approx(s["loss_copy"], abs=1e-6), (t, s)
        assert s["lag"] == lag
    for e in report["epochs"]:
        assert e["index_sum"] == sum(range(40))  # each minibatch once, in its own epoch
        assert e["val_index_sum"] == sum(range(1000, 1024))
    assert [round(v) for p in report["predictions"] for v in p] == list(range(1000, 1024))


@pytest.mark.distributed
def test_lagged_reports_match_on_every_rank_and_in_the_simulator(tmp_path):
    dist, sim = tmp_path / "dist", tmp_path / "sim"
    dist.mkdir()
    sim.mkdir()
    run_all(ranks([sys.executable, WORKER, "--out", str(dist), "--devices", "3"], 3))
    # the simulator: the same script, the three stages in this process
    run_here(lag_worker.main, "--out", str(sim), "--devices", "1", "--stages", "3")
    stages = reports(dist, 3)
    (simulated,) = reports(sim, 1)
    for r in stages:
        _expected(r)
        assert r["steps"] == stages[0]["steps"] and r["epochs"] == stages[0]["epochs"]
    # the simulator reports the same minibatch at every step, with the same values
    for a, b in zip(stages[0]["steps"], simulated["steps"], strict=True):
        assert a["first_index"] == b["first_index"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert stages[0]["epochs"] == simulated["epochs"]


@pytest.mark.distributed
def test_a_nan_in_the_data_stops_every_process_with_an_error_naming_step_and_stage(tmp_path):
    """No monitor attached: the loss check, on the lagged results every rank shares."""
    cmd = [sys.executable, WORKER, "--out", str(tmp_path), "--devices", "2", "--nan-at", "20"]
    proc = run(cmd, environment(), timeout=300)  # forked: no fresh interpreter's imports
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    # sample 20 is in the third minibatch (batch 8): step 3, computed on stage 1, rank 1
    assert "the loss of step 3 is nan (computed on stage 1, the last, rank 1)" in out, out[-3000:]
    assert not list(tmp_path.glob("report-*.json"))  # nobody finished as if nothing happened
