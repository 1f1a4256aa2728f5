"""The experiments' commands as a user types them: ``pipemare plan`` on the packaged configs
(and its refusals), ``pipemare demo``'s checks of its options, ``--version`` and ``--help``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipemare
from pipemare.__main__ import main as pipemare_command
from pipemare.experiments import demo, plan_command

ROOT = Path(__file__).resolve().parents[2]


def _plan(argv: list[str], capsys, monkeypatch) -> str:
    """``pipemare plan ARGV`` in the repository, through the command's own dispatch (the
    interpreter's start is tested by test_experiments' ``python -m pipemare``); its output."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    capsys.readouterr()
    pipemare_command(["plan", *argv])
    return capsys.readouterr().out


def test_the_cli_plans_a_gpt_that_is_no_sequential(capsys, monkeypatch):
    """configs/char_gpt.yaml: blocks in a ModuleList and a tied head, cut into segments as the
    strategy cuts it, then planned like any Sequential."""
    argv = ["--config", "configs/char_gpt.yaml", "--devices", "4", "--microbatches", "4"]
    out = _plan([*argv, "--repeats", "1", "--rounds", "1"], capsys, monkeypatch)
    assert "profiled 8 layers" in out  # 6 blocks, the embeddings and the head
    assert "choice: P=" in out


def test_the_cli_plans_the_mnist_config(capsys, monkeypatch):
    argv = ["--config", "configs/mnist.yaml", "--devices", "2", "--microbatches", "1,2"]
    out = _plan(
        [*argv, "--repeats", "2", "--rounds", "1", "--memory-limit", "1GiB"], capsys, monkeypatch
    )
    assert "choice: P=" in out and "modelled step time" in out
    assert "runner-ups" in out


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


def test_the_command_says_its_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        pipemare_command(["--version"])
    assert exit_.value.code == 0
    said = capsys.readouterr().out
    assert said.startswith(f"pipemare {pipemare.__version__} (torch {torch.__version__}, ")


@pytest.mark.parametrize("command", ["study", "user-protocol", "protocol"])
def test_a_commands_help_is_plain_text_and_its_usage_short(command, capsys):
    """A command's --help shows its docstring without reStructuredText markup, and the usage
    line names the tasks TASK instead of listing every one."""
    with pytest.raises(SystemExit) as exit_:
        pipemare_command([command, "--help"])
    assert exit_.value.code == 0
    said = capsys.readouterr().out
    assert "``" not in said and ":mod:" not in said and ":func:" not in said
    usage = said.split("\n\n", 1)[0]
    assert "char_gpt@muon" not in usage and len(usage.splitlines()) <= 8
