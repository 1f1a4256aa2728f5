"""``pipemare study SUITE``: run a named suite of configs into one directory and one W&B group.

``pipemare study default`` is the main job: does pipemare reach your quality sooner than 1F1B on
4 devices, at the rate you tuned on one (:mod:`~pipemare.experiments.studies.main_job`, about five
minutes on two cores). The other suites run packaged Lightning configs, as follows.

Every run gets a directory ``OUT/SUITE/RUN`` holding the exact config it ran
(``config.yaml``, re-runnable with ``pipemare fit --config``), its CSV metrics, its offline
W&B run and ``summary.json``. A run whose ``summary.json`` exists is skipped, so an
interrupted study picks up where it stopped. Runs on one device execute in this process;
runs on several devices start ``pipemare fit`` as a subprocess (Lightning launches the ranks).

Pipeline time is never read from a clock while a run trains: before the first run, each
layout's per-action times are taken from a file (measured alone and added where missing,
:mod:`~pipemare.experiments.studies.action_times`) and replayed through its schedule, so a
budget is a step count fixed before training and two studies give the same tables.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from pipemare.experiments._commands import command_parser
from pipemare.experiments.studies.action_times import ActionTimes
from pipemare.experiments.studies.suites import SUITES, RunSpec

__all__ = ["config_for", "main", "packaged_config", "run_study"]


def packaged_config(name: str) -> dict[str, Any]:
    """A YAML config shipped with pipemare (``configs/NAME``), as a dict."""
    text = importlib.resources.files("pipemare.configs").joinpath(name).read_text()
    return yaml.safe_load(text)


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    node = config
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


#: a run with a time budget may take this many times its reference's steps (or epochs)
BUDGET_ROOM = 4

#: where the studies keep their layouts' per-action times (checked in: both runs of a study,
#: and every machine that reproduces it, replay the same times)
ACTION_TIMES = Path(__file__).resolve().parents[1] / "results" / "action_times.json"


def config_for(
    run: RunSpec,
    run_dir: Path,
    suite: str,
    wandb: bool,
    budget_s: float | None = None,
    step_s: float | None = None,
) -> dict[str, Any]:
    """The config a run executes: the packaged one, the run's overrides, and its own logs;
    ``step_s``, its replayed pipeline time per step, goes to its summary; with ``budget_s``,
    room for :data:`BUDGET_ROOM` times the steps and a stop when the pipeline time (``step_s``
    per step) is spent."""
    config = copy.deepcopy(packaged_config(run.config))
    for key, value in run.overrides.items():
        _set(config, key, value)
    trainer = config.setdefault("trainer", {})
    if budget_s is not None:
        for key in ("max_steps", "max_epochs"):
            if isinstance(trainer.get(key), int) and trainer[key] > 0:
                trainer[key] *= BUDGET_ROOM
    trainer["default_root_dir"] = str(run_dir)
    trainer["enable_checkpointing"] = False
    trainer["enable_model_summary"] = False
    loggers: list[dict[str, Any]] = [
        {
            "class_path": "pytorch_lightning.loggers.CSVLogger",
            # a directory of its own: Lightning warns when a logger's directory holds files
            "init_args": {"save_dir": str(run_dir), "name": "", "version": "csv"},
        },
    ]
    if wandb:
        loggers.append(
            {
                "class_path": "pipemare.callbacks.OfflineSafeWandbLogger",
                "init_args": {
                    "project": "pipemare",
                    "group": suite,
                    "name": run.name,
                    "save_dir": str(run_dir),
                },
            }
        )
    trainer["logger"] = loggers
    callbacks = [
        c for c in trainer.get("callbacks", []) if "RunSummary" not in c.get("class_path", "")
    ]
    callbacks.append(
        {
            "class_path": "pipemare.experiments.RunSummary",
            "init_args": {
                "path": str(run_dir),
                "monitor": run.monitor,
                "mode": run.mode,
                "step_seconds": step_s,
            },
        }
    )
    if budget_s is not None:
        callbacks.append(
            {
                "class_path": "pipemare.callbacks.PipelineTimeBudget",
                "init_args": {"seconds": budget_s, "step_seconds": step_s},
            }
        )
    trainer["callbacks"] = callbacks
    return config


def _run_one(config_path: Path, devices: int) -> None:
    if devices > 1:
        cmd = [sys.executable, "-m", "pipemare", "fit", "--config", str(config_path)]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        return
    import torch

    from pipemare.cli.lightning_cli import PipeMareCLI

    threads, argv = torch.get_num_threads(), sys.argv
    torch.set_num_threads(1)  # like one process per stage, and comparable between runs
    sys.argv = [argv[0]]  # the study's own arguments are not the run's
    try:
        cli = PipeMareCLI(args=["fit", "--config", str(config_path)])
    finally:
        torch.set_num_threads(threads)
        sys.argv = argv
    for logger in cli.trainer.loggers:  # Lightning leaves W&B runs open; close before the next
        experiment = getattr(logger, "_experiment", None)
        if experiment is not None and hasattr(experiment, "finish"):
            experiment.finish()


def _budget(study_dir: Path, run: RunSpec) -> float | None:
    """The pipeline time of the run ``run`` takes its budget from (run earlier in the suite)."""
    if run.budget_of is None:
        return None
    summary = study_dir / run.budget_of / "summary.json"
    if not summary.exists():
        raise RuntimeError(
            f"run {run.name} takes its time budget from {run.budget_of}, which has not run: "
            f"run the suite without --only, or include {run.budget_of}"
        )
    done = json.loads(summary.read_text())
    if not done.get("step_s"):
        raise RuntimeError(
            f"{summary} holds a measured pipeline time, not one replayed from per-action times, "
            f"so {run.name} has no budget that a second study would repeat; run "
            f"{run.budget_of} again into a fresh directory"
        )
    return float(done["pipeline_time_s"])


def _time_layouts(
    study_dir: Path, suite: str, runs: list[RunSpec], times: ActionTimes, wandb: bool
) -> None:
    """Measure, before anything trains, the layouts of the runs still to do that ``times``
    lacks (each alone), and say where they were written."""
    fresh = [
        run.name
        for run in runs
        if not (study_dir / run.name / "summary.json").exists()
        and times.ensure(run.name, config_for(run, study_dir / run.name, suite, wandb))
    ]
    if fresh:
        print(
            f"timed {len(fresh)} layouts into {times.path}; keep the file (commit it) so that "
            "later studies replay the same times",
            flush=True,
        )


def run_study(
    suite: str,
    out: Path,
    wandb: bool = True,
    only: list[str] | None = None,
    action_times: Path = ACTION_TIMES,
) -> Path:
    """Run ``suite`` into ``out/suite`` (skipping complete runs); return that directory.

    Each layout's pipeline time per step comes from ``action_times`` (per-action times,
    measured where missing before any run trains), replayed through its schedule."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose one of {', '.join(SUITES)}")
    study_dir = out / suite
    study_dir.mkdir(parents=True, exist_ok=True)
    runs = [r for r in SUITES[suite]() if only is None or r.name in only]
    index = []
    start = time.perf_counter()
    times = ActionTimes(action_times)
    _time_layouts(study_dir, suite, runs, times, wandb)
    for i, run in enumerate(runs, 1):
        run_dir = study_dir / run.name
        summary = run_dir / "summary.json"
        if summary.exists():
            print(f"[{i}/{len(runs)}] {run.name}: already complete, skipped", flush=True)
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            step_s = times.step_seconds(config_for(run, run_dir, suite, wandb))
            config = config_for(run, run_dir, suite, wandb, _budget(study_dir, run), step_s)
            config_path = run_dir / "config.yaml"
            config_path.write_text(yaml.safe_dump(config, sort_keys=False))
            spec = {
                "name": run.name,
                "suite": suite,
                "task": run.config.removesuffix(".yaml"),
                "monitor": run.monitor,
                "mode": run.mode,
                "overrides": run.overrides,
            }
            (run_dir / "run.json").write_text(json.dumps(spec, indent=1))
            trainer = config["trainer"]
            devices = int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
            t0 = time.perf_counter()
            print(f"[{i}/{len(runs)}] {run.name} ...", flush=True)
            _run_one(config_path, devices)
            if not summary.exists():
                raise RuntimeError(
                    f"run {run.name} ended without writing {summary}; see its logs in {run_dir}"
                )
            print(
                f"[{i}/{len(runs)}] {run.name}: done in {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
        result = json.loads(summary.read_text())
        index.append(
            {
                "name": run.name,
                "config": run.config,
                "status": result["status"],
                "best": result["best"],
            }
        )
    (study_dir / "study.json").write_text(json.dumps({"suite": suite, "runs": index}, indent=1))
    print(
        f"suite {suite!r}: {len(runs)} runs in {study_dir} ({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    return study_dir


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pipemare study", __doc__)
    parser.add_argument(
        "suite",
        nargs="?",
        default="default",
        choices=["default", *sorted(SUITES)],
        help="default: the main job (see pipemare.experiments.studies.main_job); the others "
        "run packaged Lightning configs",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs"), help="where studies go (default: runs)"
    )
    parser.add_argument("--no-wandb", action="store_true", help="CSV logs only")
    parser.add_argument("--only", nargs="+", help="run only these runs of the suite")
    parser.add_argument("--dashboard", action="store_true", help="write the dashboard afterwards")
    parser.add_argument(
        "--action-times",
        type=Path,
        default=ACTION_TIMES,
        help="the layouts' per-action times, replayed for pipeline time; missing ones are "
        f"measured and added (default: {ACTION_TIMES.relative_to(ACTION_TIMES.parents[2])})",
    )
    args = parser.parse_args(argv)
    if args.suite == "default":
        if args.only:
            parser.error("--only: the main job trains all its runs, to answer from them")
        from pipemare.experiments.studies.main_job import run_main_job

        run_main_job(args.out / "default", wandb=not args.no_wandb)
        if args.dashboard:
            from pipemare.experiments.dashboard.answer_page import write_answer_page

            print(f"dashboard: {write_answer_page(args.out / 'default')}", flush=True)
        return
    study_dir = run_study(
        args.suite, args.out, not args.no_wandb, args.only, action_times=args.action_times
    )
    if args.dashboard:
        from pipemare.experiments.dashboard import page

        page.main([str(study_dir)])
