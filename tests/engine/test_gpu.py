"""The CUDA path: the simulator on a GPU matches the CPU run (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from support.models import sgd_pipeline

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("schedule", ["1f1b", "pipemare", "pipedream"])
def test_cuda_simulator_matches_cpu(schedule):
    def run(device):
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
        )
        net.to(device)
        loss = nn.functional.cross_entropy
        pipe = sgd_pipeline(net, loss, lr=0.1, stages=3, microbatches=2, schedule=schedule)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            pipe.step((torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)))
        pipe.drain()
        return [p.detach().cpu() for p in net.parameters()]

    for a, b in zip(run("cuda"), run("cpu"), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_strategy_trains_on_one_gpu_with_simulated_stages():
    import pytorch_lightning as pl

    from pipemare import PipeMareStrategy
    from support.data import DigitsDataModule
    from support.models import DigitsCNN

    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=PipeMareStrategy(stages=4, microbatches=2),
        accelerator="gpu",
        devices=1,
        max_epochs=3,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(DigitsCNN(), DigitsDataModule())
    assert trainer.callback_metrics["val_acc"] > 0.8


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between stages needs two GPUs")
def test_nccl_stages_match_gloo(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = str(Path(__file__).resolve().parents[1] / "support" / "dist_worker.py")
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for device in ("cuda", "cpu"):
        out = tmp_path / device
        out.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            worker,
            "--out",
            str(out),
            "--schedules",
            "pipemare",
            "--device",
            device,
        ]
        proc = subprocess.run(
            cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        a = torch.load(tmp_path / "cuda" / f"pipemare-rank{rank}.pt")["state"]
        b = torch.load(tmp_path / "cpu" / f"pipemare-rank{rank}.pt")["state"]
        for key in a:
            torch.testing.assert_close(a[key].cpu(), b[key], rtol=1e-3, atol=1e-4)
