"""The reference quality the advice quotes: its data file, written from the results.

The advice at setup (:func:`pipemare.planner.decide.decide`) cannot train the user's model
twice, so it quotes what asynchrony cost on reference tasks where it was measured. This script
reads those results and writes, for each reference task, asynchronous schedule, optimiser
family, P and N, what the schedule cost against one device (which 1F1B computes step for step):

- ``loss_gap``: the seed-mean final validation loss at equal steps, relative to one device's
  (0.044: 4.4% higher);
- ``steps_ratio``: the step at which the schedule's validation loss first came within 1% of one
  device's final seed-mean loss, over the step at which one device's own did (None: never
  within the run); ``reach`` says how that step was read from the seeds.

Sources (only cells measured there; tasks measured in validation loss):

- the user's protocol (``experiments/results/user_protocol/results.json``, the dispatch-bound
  language models, and ``experiments/results/user_protocol_c64/results.json``, the compute-bound
  GPT at 300 steps): its stored ``steps_to_target``, the mean over seeds of each seed's first
  step within 1% (never where one seed never got there). Its curves are not in the repository;
  its held-out task and the tasks measured in accuracy (a target of half a point, not 1% of a
  loss) are left out;
- the horizon runs (``experiments/results/horizon/gpt_c64s-*-{STEPS}steps.json``, the task's own
  rate only: no ``-lr`` in the name): the seed-mean curve's first step within 1%, one device's
  likewise; every run length found there is its own reference.

Run ``python -P experiments/studies/reference_quality.py`` after new results land;
``tests/experiments/test_reference_quality.py`` fails until the shipped file is regenerated.
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

__all__ = ["DATA_FILE", "PROTOCOL_RESULTS", "reference_quality", "write_data_file"]

_ROOT = Path(__file__).resolve().parents[2]

#: where the advice reads the figures (package data of ``pipemare.planner``)
DATA_FILE = Path("pipemare") / "planner" / "reference_quality.json"

#: the user's protocol's results whose tasks are references, relative to the repository
PROTOCOL_RESULTS = (
    "experiments/results/user_protocol/results.json",
    "experiments/results/user_protocol_c64/results.json",
)
_HORIZON = "experiments/results/horizon"

#: the asynchronous schedules the advice can be asked about
_SCHEDULES = ("pipemare", "async")

#: how close to one device's final loss counts as its quality (the protocol's 1%)
_WITHIN = 0.01

#: what each reference task is, in the words the advice prints (the protocol's task, by base
#: name: ``char_gpt@adamw`` is ``char_gpt`` trained with AdamW)
_WHAT = {
    "char_gpt": "a GPT of 14 blocks of width 32 at context 16, dispatch-bound, constant rate",
    "char_lm": "a character transformer of 14 blocks of width 32 at context 16, "
    "dispatch-bound, constant rate",
    "gpt_c64": "a GPT of 8 blocks of width 128 at context 64, compute-bound, nanoGPT's recipe",
    "gpt_c64s": "a GPT of 6 blocks of width 128 at context 64, compute-bound, nanoGPT's recipe",
}

_PER_SEED = "each seed's first evaluated step within 1%, averaged over the seeds"
_CURVE = "the seed-mean curve's first evaluated step within 1%"

#: a horizon run's file: schedule, P, N, seed, run length (a re-tuned rate adds ``-lrX``)
_HORIZON_NAME = re.compile(r"gpt_c64s-(\w+)-P(\d+)-N(\d+)-s(\d+)-(\d+)steps\.json")


@functools.cache
def _family(optimizer: str) -> str | None:
    """The advice's optimiser family of the protocol's ``optimizer``, from the optimiser itself
    built on a throwaway model (:func:`~pipemare.planner.decide.optimizer_family`)."""
    import torch

    from pipemare.experiments.studies import protocol
    from pipemare.planner.decide import optimizer_family

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return optimizer_family(protocol._optimizer(optimizer, model, 1e-3))


def _cell(
    task: str,
    optimizer: str,
    steps: int,
    lr: float,
    source: str,
    reach: str,
    schedule: str,
    stages: int,
    microbatches: int,
    seeds: int,
    gap: float,
    steps_ratio: float | None,
) -> dict[str, Any]:
    return {
        "task": task,
        "what": _WHAT[task.partition("@")[0]],
        "steps": steps,
        "lr": lr,
        "optimizer": optimizer,
        "family": _family(optimizer),
        "schedule": schedule,
        "stages": stages,
        "microbatches": microbatches,
        "seeds": seeds,
        "loss_gap": round(gap, 4),
        "steps_ratio": None if steps_ratio is None else round(steps_ratio, 4),
        "reach": reach,
        "source": source,
    }


def _from_protocol(root: Path, source: str) -> list[dict[str, Any]]:
    """The user's protocol's asynchronous cells on its loss-measured tasks, held-out excepted."""
    from pipemare.experiments.studies.protocol import TASKS

    results = json.loads((root / source).read_text())
    cells = []
    for name, task in results["tasks"].items():
        if task["held_out"] or task["metric"] != "val_loss":
            continue
        for p, stage in task["stages"].items():
            base = stage["1f1b"]
            for row in stage["rows"]:
                if row["schedule"] not in _SCHEDULES:
                    continue
                reached = row["steps_to_target"]
                cells.append(
                    _cell(
                        name,
                        TASKS[name].optimizer,
                        task["steps"],
                        task["rate"],
                        source,
                        _PER_SEED,
                        row["schedule"],
                        int(p),
                        row["N"],
                        len(row["seeds"]),
                        row["final"] / base["final"] - 1,
                        reached / base["steps_to_target"] if math.isfinite(reached) else None,
                    )
                )
    return cells


def _mean_curve(runs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The seeds' mean validation loss at each evaluated step (every seed evaluated the same
    steps: a run's file is written only once it finished)."""
    steps = [point[0] for point in runs[0]["curve"]]
    if any([point[0] for point in r["curve"]] != steps for r in runs):
        raise ValueError(f"seeds evaluated at different steps: {[r['seed'] for r in runs]}")
    return [
        (step, statistics.fmean(r["curve"][i][1] for r in runs)) for i, step in enumerate(steps)
    ]


def _reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first step of ``curve`` within 1% of ``target`` (None: never)."""
    return next((step for step, loss in curve if loss <= (1 + _WITHIN) * target), None)


def _from_horizon(root: Path) -> list[dict[str, Any]]:
    """The horizon runs' asynchronous cells at the task's own rate, per run length against one
    device's runs of that length (gpipe, which computes one device's steps)."""
    groups: dict[tuple[str, int, int, int], list[dict[str, Any]]] = {}
    for path in sorted((root / _HORIZON).glob("gpt_c64s-*steps.json")):
        found = _HORIZON_NAME.fullmatch(path.name)
        if found is None:  # another rate than the task's: the re-tune, not a reference
            continue
        run = json.loads(path.read_text())
        key = (run["schedule"], run["stages"], run["microbatches"], run["steps"])
        groups.setdefault(key, []).append(run)
    one_device = {key[3]: runs for key, runs in groups.items() if key[0] == "gpipe"}
    cells = []
    for (schedule, p, n, steps), runs in sorted(groups.items()):
        if schedule not in _SCHEDULES or steps not in one_device:
            continue
        base = one_device[steps]
        target = statistics.fmean(r["final_val_loss"] for r in base)
        base_reach = _reach(_mean_curve(base), target)
        reach = _reach(_mean_curve(runs), target)
        rates = {r["lr"] for r in runs + base}
        optimizers = {r["setup"]["optimizer"] for r in runs + base}
        if len(rates) != 1 or len(optimizers) != 1 or base_reach is None:
            raise ValueError(f"horizon runs at {steps} steps do not compare: {rates} {optimizers}")
        cells.append(
            _cell(
                "gpt_c64s",
                optimizers.pop(),
                steps,
                rates.pop(),
                f"{_HORIZON}/gpt_c64s-{schedule}-P{p}-N{n}-s*-{steps}steps.json",
                _CURVE,
                schedule,
                p,
                n,
                len(runs),
                statistics.fmean(r["final_val_loss"] for r in runs) / target - 1,
                None if reach is None else reach / base_reach,
            )
        )
    return cells


def reference_quality(root: Path = _ROOT) -> dict[str, Any]:
    """The data file's contents from the results under ``root`` (the repository)."""
    cells = [c for source in PROTOCOL_RESULTS for c in _from_protocol(root, source)]
    cells += _from_horizon(root)
    cells.sort(key=lambda c: (c["task"], c["steps"], c["schedule"], c["stages"], c["microbatches"]))
    return {
        "about": (
            "What asynchronous schedules cost against one device (which 1F1B computes step "
            "for step) on reference tasks, per schedule, optimiser family, P and N: loss_gap, "
            "the final seed-mean validation loss at equal steps relative to one device's; "
            "steps_ratio, the steps to come within 1% of one device's final seed-mean loss "
            "over one device's own (null: never within the run). Generated by "
            "experiments/studies/reference_quality.py from the results named in each entry; "
            "do not edit by hand."
        ),
        "references": cells,
    }


def write_data_file(root: Path = _ROOT) -> Path:
    """Write the data file under ``root`` from the results there; returns its path."""
    path = root / DATA_FILE
    path.write_text(json.dumps(reference_quality(root), indent=1) + "\n")
    return path


def main() -> None:
    """Write the data file and say how many cells it holds."""
    path = write_data_file()
    count = len(json.loads(path.read_text())["references"])
    print(f"{path}: {count} reference cells")


if __name__ == "__main__":
    main()
