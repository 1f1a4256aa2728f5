"""Per-action times of a study's layouts: measured once, alone, before any run trains, kept in
a file, and replayed through each schedule for the pipeline time of a step.

A layout is the part of a run's config that sets the work of an action: the model (its
learning rate aside), the data (the microbatch size), the strategy's settings (schedule, P, N,
corrections) and the device. Its entry holds each stage's median forward, backward and update
seconds, timed in this process with one thread (like one process per stage) while nothing
else trains, after the pipeline filled and T3's synchronous warm-up ended, with the run's
corrections on: their cost counts. :func:`pipemare.planner.replayed_step_time` turns them into
seconds per step, a pure function, so every run that reads the same file gets the same
pipeline time however busy the machine is. A layout missing from the file is measured and
added; committing the file pins the times.
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import yaml
from pytorch_lightning.callbacks import Callback

from pipemare.planner import replayed_step_time

__all__ = ["ActionTimes", "layout_key", "time_layout"]

#: timed steps per layout (after the pipeline filled): medians over this many actions each
TIMED_STEPS = 20


def layout_key(config: dict[str, Any]) -> str:
    """A name for the layout ``config`` runs: a hash of the parts that set an action's work."""
    model = copy.deepcopy(config.get("model", {}))
    optimizer = model.get("init_args", {}).get("optimizer", {})
    optimizer.get("init_args", {}).pop("lr", None)  # the rate does not change the work
    trainer = config.get("trainer", {})
    parts = {
        "model": model,
        "data": config.get("data", {}),
        "strategy": trainer.get("strategy"),
        "accelerator": trainer.get("accelerator"),
        "precision": trainer.get("precision"),
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _ActionTimer(Callback):
    """Records the pipeline's actions once it is full and past T3's warm-up, for ``steps``
    steps, then stops the fit."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.spans: list[tuple[int, str, int, float, float]] = []
        self.timed = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.strategy.request_probe(timeline=True)  # type: ignore[attr-defined]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pipe = trainer.strategy.pipeline  # type: ignore[attr-defined]
        spans = pipe.probe.take_spans()
        settled = pipe.num_stages + 2 + pipe.settings.warmup_steps
        if trainer.global_step > settled:
            self.spans += spans
            self.timed += 1
        if self.timed >= self.steps:
            trainer.should_stop = True


def time_layout(config: dict[str, Any], steps: int = TIMED_STEPS) -> dict[str, Any]:
    """Time the actions of ``config``'s layout: its first batches through Lightning, without
    validation, loggers or other callbacks; each stage's median F, B and U seconds."""
    import torch

    from pipemare.cli.lightning_cli import PipeMareCLI

    config = copy.deepcopy(config)
    trainer = config.setdefault("trainer", {})
    for key in ("val_check_interval", "logger", "callbacks", "max_epochs"):
        trainer.pop(key, None)
    with tempfile.TemporaryDirectory() as tmp:
        trainer.update(
            default_root_dir=tmp,
            max_steps=-1,
            max_epochs=-1,  # the timer stops the fit
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        threads, argv = torch.get_num_threads(), sys.argv
        torch.set_num_threads(1)  # as the runs train: like one process per stage
        sys.argv = [argv[0]]
        try:
            cli = PipeMareCLI(args=["--config", str(path)], run=False)
            timer = _ActionTimer(steps)
            cli.trainer.callbacks.append(timer)  # type: ignore[attr-defined]
            cli.trainer.fit(cli.model, cli.datamodule)
        finally:
            torch.set_num_threads(threads)
            sys.argv = argv
    strategy: Any = cli.trainer.strategy
    stages = strategy.pipeline.num_stages
    durations: list[list[list[float]]] = [[[], [], []] for _ in range(stages)]
    for stage, name, _, start, end in timer.spans:
        if name in ("F", "B", "U"):
            durations[stage]["FBU".index(name)].append(end - start)
    return {
        "schedule": strategy.schedule,
        "stages": stages,
        "microbatches": strategy.microbatches,
        "actions_s": [[statistics.median(d) for d in stage] for stage in durations],
        "timed_steps": timer.timed,
        "torch_threads": 1,
        "torch": torch.__version__,
    }


class ActionTimes:
    """The per-action times of layouts, in a JSON file: read, measured where missing, written.

    Args:
        path: the file (created when the first layout is measured).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.layouts: dict[str, dict[str, Any]] = (
            json.loads(path.read_text())["layouts"] if path.exists() else {}
        )

    def ensure(self, name: str, config: dict[str, Any]) -> bool:
        """Measure ``config``'s layout (run ``name``'s) unless the file has it; True if it was
        measured now. Call it for every run before any trains: the timing must run alone."""
        key = layout_key(config)
        if key in self.layouts:
            return False
        print(f"timing the actions of {name}'s layout alone ({key}) ...", flush=True)
        self.layouts[key] = {"first_measured_for": name, **time_layout(config)}
        self._write()
        return True

    def step_seconds(self, config: dict[str, Any]) -> float:
        """Seconds per optimiser step of ``config``'s layout on P devices: its measured action
        times replayed through its schedule."""
        entry = self.layouts[layout_key(config)]
        durations = [tuple(a) for a in entry["actions_s"]]
        return replayed_step_time(entry["schedule"], durations, entry["microbatches"])  # type: ignore[arg-type]

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        about = (
            "Per-action seconds (forward, backward, update; median per stage) of each layout, "
            "measured once by `pipemare study`; replayed through the schedule for pipeline time."
        )
        text = json.dumps({"about": about, "layouts": self.layouts}, indent=1, sort_keys=True)
        self.path.write_text(text + "\n")
