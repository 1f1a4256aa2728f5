"""The strategy over real processes: Lightning's launcher, torchrun on two "nodes", and SLURM.

Each launch runs tests/support/lightning_worker.py in subprocesses (never inside pytest) and every
rank reports what it saw; the tests compare the ranks with each other and across launchers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from support import lightning_worker, recipes
from support.data import DigitsDataModule
from support.launch import environment, forked_spawns, free_port, reports, run_all, run_here
from support.models import DigitsCNN, quiet_trainer

# one worker runs the module: its tests share a module-scoped launch
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("strategy_distributed")]
SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the worker scripts
WORKER = str(SUPPORT / "lightning_worker.py")
MONITOR_WORKER = SUPPORT / "monitor_worker.py"


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    """Two processes started by Lightning's own launcher (it re-runs the script for rank 1)."""
    out = tmp_path_factory.mktemp("lightning")
    run_all([([sys.executable, WORKER, "--out", str(out), "--devices", "2"], environment())])
    return out


def test_every_rank_sees_the_same_metrics_and_decisions(lightning_run):
    r0, r1 = reports(lightning_run, 2)
    assert r0["world_size"] == 2 and r0["environment"] == "LightningEnvironment"
    for key in (
        "metrics",
        "logged",
        "best_model_path",
        "best_model_score",
        "stopped_epoch",
        "global_step",
        "predictions",
        "lr",
        "decisions",
    ):
        assert r0[key] == r1[key], key
    # the links between the two processes, measured at setup, went into the replays
    assert r0["decisions"]["links"].startswith("links: 0-1: ")
    assert "measured now between each pair of neighbouring processes" in r0["decisions"]["links"]
    assert "a message's CPU: " in r0["decisions"]["links"]  # charged to its sender and receiver
    assert {"train_loss", "val_loss", "val_acc", "train_acc", "lr-Adam"} <= set(r0["metrics"])
    assert r0["stopped_epoch"] > 0  # EarlyStopping fired (val_acc >= 0.93), on both ranks at once
    w0 = torch.load(lightning_run / "weights-rank0.pt")
    w1 = torch.load(lightning_run / "weights-rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # every process ends with the whole model
    logs = list((lightning_run / "csv").rglob("metrics.csv"))
    assert (
        len(logs) == 1 and "val_acc" in logs[0].read_text().splitlines()[0]
    )  # written once, by rank 0


def test_two_processes_train_close_to_one_device(lightning_run, tmp_path):
    # the same script on one device, Lightning's own strategy, run in this process
    run_here(lightning_worker.main, "--out", str(tmp_path), "--devices", "1", "--strategy", "auto")
    single = reports(tmp_path, 1)[0]["metrics"]["val_acc"]
    piped = reports(lightning_run, 2)[0]["metrics"]["val_acc"]
    print(f"\nval_acc: one device {single:.3f}, pipemare on 2 processes {piped:.3f}")
    assert single > 0.9
    assert piped > single - 0.05


def test_checkpoint_gives_a_plain_module_the_same_predictions(lightning_run):
    report = reports(lightning_run, 2)[0]
    plain = DigitsCNN.load_from_checkpoint(report["best_model_path"])
    final = DigitsCNN()
    final.load_state_dict(torch.load(lightning_run / "weights-rank0.pt"))
    data = DigitsDataModule()
    data.setup()
    x = data.val_set.tensors[0]
    with torch.no_grad():
        assert final.eval()(x).argmax(1).tolist() == report["predictions"]
        ckpt = torch.load(lightning_run / "ckpt" / "last.ckpt", weights_only=False)
        last = DigitsCNN()
        last.load_state_dict(ckpt["state_dict"])
        assert last.eval()(x).argmax(1).tolist() == report["predictions"]
        assert plain.eval()(x).shape == (300, 10)
    assert len(ckpt["optimizer_states"][0]["state"]) == 8  # both stages' Adam moments


def test_torchrun_on_two_nodes_matches_one_node(lightning_run, tmp_path):
    port = free_port()
    commands = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=pipemare-test",
            WORKER,
            "--out",
            str(tmp_path),
            "--devices",
            "1",
            "--num-nodes",
            "2",
        ]
        commands.append((cmd, environment()))
    run_all(commands)
    ranks = reports(tmp_path, 2)
    assert {r["environment"] for r in ranks} == {"TorchElasticEnvironment"}
    assert ranks[0]["metrics"] == ranks[1]["metrics"] == reports(lightning_run, 2)[0]["metrics"]
    ours, theirs = (
        torch.load(tmp_path / "weights-rank0.pt"),
        torch.load(lightning_run / "weights-rank0.pt"),
    )
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6)


def test_slurm_tasks_match_lightnings_launcher(lightning_run, tmp_path):
    """docs/scaling-up.md's SLURM recipe, as the page writes it: one process per task of its
    batch script, each with the environment ``srun`` would give it (every node on this
    machine), running a worker with the counts of the page's Trainer."""
    _, srun = recipes.sbatch("slurm-batch")
    assert srun == ["srun", "python", "train.py"], srun
    tasks = recipes.slurm_environments("slurm-batch")
    assert len(tasks) == 2  # the two processes of the reference launch
    counts = recipes.worker_arguments("slurm-train")
    worker = [sys.executable, WORKER, "--out", str(tmp_path), *counts]
    port = str(free_port())
    run_all([(worker, environment(**t, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for t in tasks])
    ranks = reports(tmp_path, 2)
    assert {r["environment"] for r in ranks} == {"SLURMEnvironment"}
    ours, theirs = (
        torch.load(tmp_path / "weights-rank1.pt"),
        torch.load(lightning_run / "weights-rank0.pt"),
    )
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6)


def test_spawn_returns_the_whole_trained_model_to_the_parent():
    import pytorch_lightning as pl

    pl.seed_everything(0)
    model = DigitsCNN(lr=3e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = quiet_trainer("pipemare_spawn", devices=2, max_epochs=1)
    with forked_spawns():  # spawned all the same, without a fresh interpreter's imports
        trainer.fit(model, DigitsDataModule())
    after = model.state_dict()
    # both stages changed in the parent, although only rank 0 sends its module back
    assert not torch.equal(before["net.0.weight"], after["net.0.weight"])
    assert not torch.equal(before["net.8.weight"], after["net.8.weight"])
    data = DigitsDataModule()
    data.setup()
    x, y = data.val_set.tensors
    with torch.no_grad():
        accuracy = (model.eval()(x).argmax(1) == y).float().mean()
    print(f"\nheld-out accuracy after one epoch: {accuracy:.3f}")
    assert accuracy > 0.6


def test_monitors_over_processes_divergence_timeline_utilization(tmp_path):
    """Stage 1 (on rank 1) blows up after 25 steps: both ranks stop there, naming it."""
    run_all(
        [
            (
                [sys.executable, str(MONITOR_WORKER), "--out", str(tmp_path)],
                environment(),
            )
        ]
    )
    r0, r1 = reports(tmp_path, 2)
    assert r0["divergence"] == r1["divergence"] and r0["global_step"] == r1["global_step"]
    d = r0["divergence"]
    assert d["stage"] == 1 and 25 <= d["step"] <= 27
    # named at the minibatch's own step, stopped when its loss was reported, lag 1 (P=2, N=2)
    assert r0["global_step"] == d["step"] + 1
    assert f"diverged at step {d['step']} in stage 1" in d["message"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1} and trace["otherData"]["simulated"] is False
    assert {"forward", "backward", "update", "send", "recv"} <= {e["cat"] for e in spans}
    (metrics,) = list((tmp_path / "csv").rglob("metrics.csv"))
    header = metrics.read_text().splitlines()[0].split(",")
    for name in (
        "pipemare/stage0/utilization",
        "pipemare/stage1/utilization",
        "pipemare/stage1/comm_s",
        "pipemare/stage0/tau_fwd_measured",
        "pipemare/stage0/discrepancy",
        "pipemare/stage1/grad_norm",
        "pipemare/memory/rank1/resident_mb",  # every process's memory, logged by rank 0
        "pipemare/memory/peak_resident_mb",
    ):
        assert name in header, name
