"""Where a real two-process step goes, against what the replay charged for it (issue 62).

The links check found the replayed steps 27-31% short of the measured ones on the compute-bound
GPT whatever the link, so the missing time is not the link's. This runs ``measure.py``'s setup
(the experiments' GPT over the char corpus, batch 16, AdamW, two gloo processes, one thread
each) with every rank's actions recorded from step 10 on (``Probe(timeline=True)``), and keeps
what the run measured at setup for its replays (each layer's forward and backward at the run's
microbatch, the engine's fixed seconds per action, its update's seconds per trained parameter).
Each rank then prints, per action kind, the median measured time against the setup's charge
for that stage (its layers' sum plus the fixed cost; for the update, the fixed cost plus the
rate times the parameters the stage trains), and its CPU time against the wall clock. Rank 0
also times its own layers again after the run, as setup timed them, on the same microbatch:
whether setup's figures still held when the steps ran, or the machine's speed moved. Run
alone on the machine::

    python experiments/results/links/where.py 192 8 64 pipemare
    python experiments/results/links/where.py 192 8 64 1f1b 4

Rank 0 appends a ``WHERE`` line (JSON) with both stages' figures to ``--out``. With
``--one-process`` one process runs both stages (``PipeMareStrategy(stages=2)``, one core busy,
messages passed by reference): the same actions without a second process beside them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

import pipemare.lightning.runner as runner_module
from pipemare import PipeMareStrategy
from pipemare.engine.microbatch import batch_size
from pipemare.engine.telemetry import Probe
from pipemare.experiments.studies import step_clock
from pipemare.experiments.studies.step_clock import gpt_and_schedule_arguments
from pipemare.model import partition
from pipemare.planner.measurements import Overhead
from pipemare.schedule.actions import spec

FROM_STEP = 10
_SETUP: dict[str, Any] = {}
_TIMED: dict[int, tuple[Any, Any]] = {}  # rows -> (the layers, the microbatch) setup timed
_layer_passes = partition.layer_passes
_time_layers = partition.time_layers


def _keeping_what_is_timed(seq, sample, *args, **kwargs):
    """:func:`~pipemare.model.partition.time_layers` that keeps what it timed."""
    _TIMED[batch_size(sample)] = (
        seq,
        tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, sample),
    )
    return _time_layers(seq, sample, *args, **kwargs)


def _keep_setup(decide):
    """``decide`` that also keeps what it was decided from."""

    def kept(options, facts):
        plan = decide(options, facts)
        _SETUP.update(
            passes=facts.layer_passes,
            overheads=dict(facts.overheads),
            trained=facts.model.layer_trained,
            tensors=facts.model.layer_tensors,
            cut=list(plan.balance),
            n=plan.microbatches,
            rows=facts.rows,
        )
        return plan

    return kept


class ActionClock(pl.Callback):
    """Records every action of this rank's stage from step ``FROM_STEP`` on, with the
    process's and its training thread's CPU time over the same window."""

    def __init__(self, schedule: str) -> None:
        self.schedule = schedule

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == FROM_STEP:
            trainer.strategy.pipeline.probe = Probe(timeline=True)
            self.start = (time.perf_counter(), time.process_time(), time.thread_time())

    def on_train_end(self, trainer, pl_module):
        wall, process, thread = (
            now - then
            for now, then in zip(
                (time.perf_counter(), time.process_time(), time.thread_time()),
                self.start,
                strict=True,
            )
        )
        spans = trainer.strategy.pipeline.probe.take_spans()
        stages = sorted({span[0] for span in spans})
        self.figures = [
            _figures(spans, self.schedule, stage, wall, process, thread) for stage in stages
        ]
        if trainer.global_rank == 0:  # its layers are its own: time them again, as setup did
            rows = -(-_SETUP["rows"] // _SETUP["n"])
            seq, sample = _TIMED[rows]
            again = _layer_passes(nn.Sequential(*list(seq)[: _SETUP["cut"][0]]), sample)
            self.figures[0]["retimed_ms"] = {
                "F": 1e3 * sum(f for f, _ in again),
                "B": 1e3 * sum(b for _, b in again),
            }


def _figures(
    spans, schedule: str, rank: int, wall: float, process: float, thread: float
) -> dict[str, Any]:
    """Per action kind, the measured median and the setup's charge (milliseconds), for the
    stage of index ``rank`` (a process's own, or one of those one process runs)."""
    kinds = defaultdict(list)
    for stage, name, _, start, end in spans:
        if stage == rank:
            kinds[name].append(end - start)
    updates = len(kinds["U"])
    cut, n, rows = _SETUP["cut"], _SETUP["n"], _SETUP["rows"]
    bounds = list(itertools.accumulate([0, *cut]))
    layers = _SETUP["passes"][-(-rows // n)][bounds[rank] : bounds[rank + 1]]
    overhead = _SETUP["overheads"].get(schedule, Overhead(0.0, 0.0, 0.0))
    trained = sum(_SETUP["trained"][bounds[rank] : bounds[rank + 1]])
    tensors = sum(_SETUP["tensors"][bounds[rank] : bounds[rank + 1]]) or 1
    # as the replay charges it: an asynchronous schedule's last stage predicts nothing
    forward, backward, update = overhead.charge(
        trained, spec(schedule).flushes or rank < len(cut) - 1, tensors
    )
    charged = {
        "F": forward + sum(f for f, _ in layers),
        "B": backward + sum(b for _, b in layers),
        "U": update,
    }
    return {
        "rank": rank,
        "N": n,
        "cut": cut,
        "measured_ms": {k: 1e3 * statistics.median(v) for k, v in kinds.items()},
        "charged_ms": {k: 1e3 * v for k, v in charged.items()},
        "per_step_ms": {k: 1e3 * sum(v) / updates for k, v in kinds.items()},
        "step_ms": 1e3 * wall / updates,
        "cpu_share": {"process": process / wall, "training thread": thread / wall},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpt_and_schedule_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "where.jsonl")
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="both stages in one process (one core busy, no messages): the actions' cost "
        "without a second process beside them",
    )
    args = parser.parse_args()
    # in one process the strategy is told its two stages; over two, each process holds one
    stages = {"stages": 2} if args.one_process else {}
    if args.schedule == "pipemare":
        strategy = PipeMareStrategy(**stages)
    else:
        strategy = PipeMareStrategy(schedule="1f1b", microbatches=args.n, **stages)
    runner_module.decide = _keep_setup(runner_module.decide)
    partition.time_layers = _keeping_what_is_timed
    clock = ActionClock(args.schedule)
    make_trainer = step_clock.pl.Trainer
    step_clock.pl.Trainer = lambda *a, callbacks=(), **k: make_trainer(
        *a, callbacks=[*callbacks, clock], **k
    )
    trainer, step_ms = step_clock.timed_fit(
        strategy, args.width, args.layers, args.context, devices=1 if args.one_process else 2
    )
    if args.one_process:
        gathered = clock.figures
    else:
        each: list[Any] = [None, None]
        dist.all_gather_object(each, clock.figures)
        gathered = [figures for rank in each for figures in rank]
    if trainer.global_rank != 0:
        return
    model = {"width": args.width, "layers": args.layers, "context": args.context}
    record = {
        **model,
        "schedule": args.schedule,
        "processes": 1 if args.one_process else 2,
        "step_ms": step_ms,
        "ranks": gathered,
    }
    for figures in gathered:
        shown = ", ".join(
            f"{k} {figures['measured_ms'][k]:.2f} against {figures['charged_ms'][k]:.2f}"
            for k in ("F", "B", "U")
        )
        retimed = figures.get("retimed_ms")
        if retimed is not None:
            shown += f"; its layers timed again after the run: F {retimed['F']:.2f}, B "
            shown += f"{retimed['B']:.2f} (without the engine's fixed cost)"
        print(
            f"{args.schedule} stage {figures['rank']} (N={figures['N']}, cut {figures['cut']}): "
            f"median ms measured against charged: {shown}; per step "
            f"{json.dumps({k: round(v, 1) for k, v in figures['per_step_ms'].items()})}; "
            f"CPU {figures['cpu_share']['training thread']:.0%} of the wall clock"
        )
    line = json.dumps(record)
    print("WHERE", line)
    with args.out.open("a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
