"""The experiments' commands as a user types them: ``pipemare plan`` on the packaged configs
(and its refusals), and ``pipemare demo``'s checks of its options."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipemare.experiments import demo, plan_command

ROOT = Path(__file__).resolve().parents[2]


def test_the_cli_plans_a_gpt_that_is_no_sequential():
    """configs/char_gpt.yaml: blocks in a ModuleList and a tied head, cut into segments as the
    strategy cuts it, then planned like any Sequential."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable, "-m", "pipemare", "plan", "--config", "configs/char_gpt.yaml",
            "--devices", "4", "--microbatches", "4", "--repeats", "1",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "profiled 8 layers" in result.stdout  # 6 blocks, the embeddings and the head
    assert "choice: P=" in result.stdout


def test_the_cli_plans_the_mnist_config():
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable, "-m", "pipemare", "plan", "--config", "configs/mnist.yaml",
            "--devices", "2", "--microbatches", "1,2", "--repeats", "2", "--memory-limit", "1GiB",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "choice: P=" in result.stdout and "modelled step time" in result.stdout
    assert "runner-ups" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "configs/mnist.yaml", "--memory-limit", "8XB"], "cannot read '8XB'"),
        (["--config", "configs/mnist.yaml", "--devices", "0"], "positive number"),
        (["--config", "no/such.yaml"], "no config file"),
        (["--config", "configs/mnist.yaml", "--schedule", "gpip"], "did you mean 'gpipe'"),
        ([], "--config"),
    ],
)
def test_the_cli_refuses_bad_arguments(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_:
        plan_command.main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_demo_checks_its_options_before_it_runs(capsys):
    for argv, message in [
        (["--stages", "0"], "argument --stages: must be a whole number >= 1, got '0'"),
        (["--stages", "99"], "--stages 99: the demo's model has 9 layers"),
        (["--schedules", "gpip"], "invalid choice: 'gpip'"),
        (["--microbatches", "64"], "--microbatches 64 exceeds --batch-size 32"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            demo.main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
