"""D copies of a P-stage pipeline (data x pipeline parallelism) over real processes.

Launches run tests/support/replica_worker.py in subprocesses (Lightning's launcher re-runs it per
rank); the merging of results and the gradient buckets are also tested in this process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipemare.engine.replicas import _buckets
from pipemare.lightning.steps import Record, merge_published
from support import recipes, replica_worker
from support.launch import environment, free_port, ranks, reports, run_all, run_here

# one worker runs the module: its tests share module-scoped fixtures
pytestmark = pytest.mark.xdist_group("replicas")

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the worker scripts
WORKER = str(SUPPORT / "replica_worker.py")


def launch(out: Path, *args: str) -> list[str]:
    return [sys.executable, WORKER, "--out", str(out), *args]


@pytest.fixture(scope="module")
def gpipe_runs(tmp_path_factory):
    """Two copies of a 2-stage gpipe pipeline (4 processes, 16 samples per copy and step)
    and one plain device with the combined batch of 32 (the same script, in this process)."""
    copies, single = tmp_path_factory.mktemp("copies"), tmp_path_factory.mktemp("single")
    run_all(ranks(launch(copies, "--devices", "4", "--stages", "2", "--batch", "16"), 4), 600)
    one_device = ("--strategy", "single", "--devices", "1", "--batch", "32")
    run_here(replica_worker.main, "--out", str(single), *one_device)
    return reports(copies, 4), reports(single, 1)[0], copies, single


@pytest.mark.distributed
def test_two_copies_of_gpipe_reproduce_one_device(gpipe_runs):
    copies, single, out, ref = gpipe_runs
    want = torch.load(ref / "weights-rank0.pt")
    for r in range(4):  # every process ends with the whole model
        got = torch.load(out / f"weights-rank{r}.pt")
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)
    saved = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)
    for key in want:  # one consolidated checkpoint, the whole model
        torch.testing.assert_close(saved["state_dict"][key], want[key], rtol=0, atol=1e-6)
    assert len(saved["optimizer_states"][0]["state"]) == len(want)  # every parameter's momentum
    assert len(copies[0]["losses"]) == len(single["losses"]) == single["global_step"] == 92
    torch.testing.assert_close(copies[0]["losses"], single["losses"], rtol=0, atol=1e-6)
    for name in ("val_loss", "val_acc", "train_loss"):
        assert copies[0]["metrics"][name] == pytest.approx(single["metrics"][name], abs=1e-6)


@pytest.mark.distributed
def test_copies_split_the_batches_and_agree_on_everything(gpipe_runs):
    copies, single, _, _ = gpipe_runs
    r0, r1, r2, r3 = copies
    assert r0["replicas"] == 2 and r0["stage_groups"] == [[0, 2], [1, 3]]
    for key in ("losses", "metrics", "global_step", "best_model_score", "train_batches"):
        assert r0[key] == r1[key] == r2[key] == r3[key], key
    # each copy gets its own half of every batch: the processes of a copy see the same
    # samples, the copies different ones, together the one-device batch
    assert r0["first_labels"] == r1["first_labels"] != r2["first_labels"] == r3["first_labels"]
    both = sorted(r0["first_labels"][0] + r2["first_labels"][0])
    assert both == sorted(single["first_labels"][0])


@pytest.mark.distributed
def test_torchrun_on_two_nodes_keeps_each_pipeline_inside_a_node(gpipe_runs, tmp_path):
    """docs/scaling-up.md's torchrun recipe across nodes, as the page writes it: 2 nodes x 2
    processes, stages=2, both nodes on 127.0.0.1. Each node runs one copy of the pipeline, only
    the gradient average crosses nodes; the result is the one-device run's."""
    _, single, _, ref = gpipe_runs
    counts = recipes.worker_arguments("nodes-train")
    assert counts == ["--devices", "2", "--num-nodes", "2", "--stages", "2"]  # the reference's
    endpoint = f"127.0.0.1:{free_port()}"
    commands = []
    for node in (0, 1):
        torchrun = recipes.command(
            "torchrun-nodes", {"$NODE_RANK": str(node), "$HEAD:$PORT": endpoint}
        )
        assert torchrun[0] == "torchrun" and torchrun[-1] == "train.py", torchrun
        cmd = [
            sys.executable, "-m", "torch.distributed.run", *torchrun[1:-1],
            *launch(tmp_path, *counts)[1:], "--batch", "16",
        ]  # fmt: skip
        commands.append((cmd, environment()))
    run_all(commands, timeout=600)
    stages = reports(tmp_path, 4)
    assert stages[0]["pipelines"] == [[0, 1], [2, 3]] and stages[0]["stage_groups"] == [
        [0, 2],
        [1, 3],
    ]
    assert stages[0]["pipelines_cross_nodes"] is False
    want = torch.load(ref / "weights-rank0.pt")
    got = torch.load(tmp_path / "weights-rank3.pt")
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)
    assert all(r["metrics"] == stages[0]["metrics"] for r in stages)
    assert stages[0]["metrics"]["val_acc"] == pytest.approx(single["metrics"]["val_acc"], abs=1e-6)


@pytest.mark.distributed
def test_two_copies_of_pipemare_train_the_cnn_as_one_pipeline(tmp_path):
    """The digits CNN, schedule pipemare, N = 2, global batch 32: two copies of a 2-stage
    pipeline (4 processes, 16 samples each) against one 2-stage pipeline (2 processes), for 3
    epochs: measured 0.943 validation accuracy both (at 6 epochs, as this test ran before,
    0.970 both)."""
    copies, one = tmp_path / "copies", tmp_path / "one"
    common = ["--model", "cnn", "--schedule", "pipemare", "--epochs", "3", "--stages", "2"]
    common += ["--balance", "5,4"]  # the same cut in both (timing the layers could differ)
    run_all(
        ranks(launch(copies, *common, "--devices", "4", "--batch", "16"), 4)
        + ranks(launch(one, *common, "--devices", "2", "--batch", "32"), 2),
        timeout=900,
    )
    four, two = reports(copies, 4), reports(one, 2)
    assert four[0]["global_step"] == two[0]["global_step"] == 3 * 46
    assert all(r["metrics"] == four[0]["metrics"] for r in four)
    acc4, acc2 = four[0]["metrics"]["val_acc"], two[0]["metrics"]["val_acc"]
    print(f"\nval_acc: 2 copies x 2 stages {acc4:.4f}, one 2-stage pipeline {acc2:.4f}")
    assert acc2 > 0.9
    assert acc4 >= acc2 - 0.01 - 1e-6  # within one point (300 validation images: 3 of them)


def test_copies_merge_losses_and_logs_as_one_batch():
    def rec(name, value, weight, fx="mean"):
        return Record(name, {"reduce_fx": fx}, value=value, weight=weight)

    a = (0.5, [rec("loss", 0.5, 1.0), rec("n", 3.0, 1.0, "sum"), rec("top", 2.0, 1.0, "max")])
    b = (1.5, [rec("loss", 1.5, 1.0), rec("n", 4.0, 1.0, "sum"), rec("top", 5.0, 1.0, "max")])
    value, records = merge_published([a, b])
    assert value == 1.0
    got = {r.name: r.result() for r in records}
    assert got == {"loss": 1.0, "n": 7.0, "top": 5.0}
    assert a[1][0].value == 0.5  # the inputs are left alone
    outputs = ({"logits": torch.zeros(2)}, [])  # not a number: copy 0's value
    assert merge_published([outputs, ({"logits": torch.ones(2)}, [])])[0] is outputs[0]


def test_buckets_keep_order_and_limit():
    grads = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64)]
    buckets = _buckets(grads, limit=100)  # bytes: 40, 40, 120, 40
    assert [[g.numel() for g in b] for b in buckets] == [[10, 10], [30], [5]]
    assert all(x is y for x, y in zip([g for b in buckets for g in b], grads, strict=True))
