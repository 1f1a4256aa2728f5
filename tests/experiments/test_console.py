"""What a user sees from ``pipemare fit`` and ``pipemare validate`` on a packaged config: a W&B
run (offline) beside the CSV logs with every per-stage metric, a quiet console, and a
validation that reports how its checkpoint was trained. Each command runs as a user runs it,
in a process of its own."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from support.launch import run
from support.wandb_records import records, run_contents

ROOT = Path(__file__).resolve().parents[2]

#: short runs of the packaged configs that train on the CPU from offline data
SHORT = {
    "mnist": ["--trainer.max_epochs=1", "--trainer.limit_train_batches=20"],
    "char_lm": ["--trainer.max_steps=20", "--trainer.val_check_interval=10"],
    "char_gpt": ["--trainer.max_steps=20", "--trainer.val_check_interval=10"],
}

#: what every stage logs (docs/watching.md); a stage without parameters has no weight
#: discrepancy
PER_STAGE = (
    "tau_fwd",
    "tau_bkwd",
    "tau_fwd_measured",
    "tau_bkwd_measured",
    "discrepancy",
    "discrepancy_uncorrected",
    "lr",
    "guard",
    "in_flight",
    "grad_norm",
    "utilization",
    "compute_s",
    "comm_s",
    "idle_s",
)
NEEDS_WEIGHTS = {"discrepancy", "discrepancy_uncorrected"}

#: what the project's commands must not print (issue 25): Lightning's CLI, torch's pytree
#: deprecation, Lightning's product tips and informational chatter, W&B's banner
NOISE = (
    "args parameter",
    "LeafSpec",
    "Tip:",
    "GPU available",
    "Seed set to",
    "wandb:",
    "sync_dist",
    "dirpath has changed",
)
WARNING_LOCATION = re.compile(r"\.py:\d+: ")  # how Python and Lightning print a warning


def pipemare(args: list[str], cwd: Path) -> str:
    """Run ``pipemare ARGS`` in ``cwd`` as a user would, without an API key; its console."""
    # nothing of W&B's from this process: no key, no banner setting, and no service an
    # earlier test started here (a run attached to it would be written by this process's)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", HOME=str(cwd), OMP_NUM_THREADS="1")
    done = run([sys.executable, "-m", "pipemare", *args], env, timeout=600, cwd=cwd)
    console = done.stdout
    assert done.returncode == 0, console[-3000:]
    return console


def assert_quiet(console: str) -> None:
    for phrase in NOISE:
        assert phrase not in console, f"{phrase!r} printed:\n{console}"
    warnings = [line for line in console.splitlines() if WARNING_LOCATION.search(line)]
    assert not warnings, "\n".join(warnings)


def layout_line(console: str) -> str:
    (line,) = [line for line in console.splitlines() if re.match(r"pipemare: \d+ stages", line)]
    return line


def decision_lines(console: str) -> list[str]:
    """The lines under the layout line naming each decision taken for the run, with its reason."""
    return [line for line in console.splitlines() if line.startswith("pipemare:   ")]


@pytest.mark.parametrize("name", sorted(SHORT))
def test_a_packaged_config_logs_every_stage_to_wandb_and_prints_no_noise(name, tmp_path):
    config = ROOT / "configs" / f"{name}.yaml"
    console = pipemare(
        ["fit", "--config", str(config), "--trainer.limit_val_batches=2", *SHORT[name]], tmp_path
    )
    assert_quiet(console)
    line = layout_line(console)
    assert "schedule 'pipemare'" in line and "corrections: lr_reschedule(horizon=" in line
    assert "W&B run saved offline in runs/" in console

    (run,) = (tmp_path / "runs" / name / "wandb").glob("offline-run-*")
    assert f"wandb sync runs/{name}/wandb/{run.name}" in console
    assert list((tmp_path / "runs" / name).rglob("metrics.csv"))  # CSV beside it
    (info,) = [r.run for r in records(next(run.glob("run-*.wandb"))) if r.HasField("run")]
    assert info.run_group == name and info.display_name.startswith("pipemare-P")
    _, _, history = run_contents(run)
    logged = {key for row in history for key in row}
    (table,) = sorted(run.glob("files/media/table/pipemare/stages_*.table.json"))[-1:]
    stages = json.loads(table.read_text())
    params = dict(zip(stages["columns"], zip(*stages["data"], strict=True), strict=True))["params"]
    assert len(params) == int(line.split()[1])  # one row per stage
    for i, count in enumerate(params):
        for metric in PER_STAGE:
            if metric in NEEDS_WEIGHTS and count == 0:
                assert f"pipemare/stage{i}/{metric}" not in logged
                continue
            assert f"pipemare/stage{i}/{metric}" in logged, (i, metric)


def test_validate_reports_the_corrections_its_checkpoint_was_trained_with(tmp_path):
    config = str(ROOT / "configs" / "mnist.yaml")
    fit = pipemare(
        [
            *("fit", "--config", config, "--no-wandb", "--trainer.limit_val_batches=2"),
            *("--trainer.max_epochs=1", "--trainer.limit_train_batches=12"),
            "--trainer.strategy.init_args.config.reschedule_fraction=0.5",
        ],
        tmp_path,
    )
    assert not (tmp_path / "runs" / "mnist" / "wandb").exists()  # --no-wandb: CSV only
    trained = layout_line(fit).split("corrections: ", 1)[1]
    assert "lr_reschedule(horizon=6)" in trained  # half of the run's 12 steps
    (checkpoint,) = (tmp_path / "runs").rglob("*.ckpt")
    # evaluated under another schedule and the default T1: the report is the checkpoint's
    validate = pipemare(
        [
            *("validate", "--config", config, "--no-wandb", "--trainer.limit_val_batches=2"),
            *("--trainer.strategy.init_args.schedule=async", f"--ckpt_path={checkpoint}"),
        ],
        tmp_path,
    )
    assert_quiet(validate)
    line = layout_line(validate)
    assert "schedule 'async'" not in line
    assert line.endswith(
        f"evaluating a checkpoint trained with schedule 'pipemare', N=1, corrections: {trained}"
    )
    # the run's first lines give every decision with its reason; validate repeats them
    decided = decision_lines(fit)
    assert "pipemare:   lr_reschedule horizon: 6 steps (0.5 of the run's 12 steps)" in decided
    assert any(d.startswith("pipemare:   weight_prediction: ") for d in decided)
    assert decision_lines(validate) == decided
