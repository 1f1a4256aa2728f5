"""One process per stage inside torchrun: single-process, torch.distributed.pipelining, engine and
Lightning runs of the same model, timed and measured.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipemare.experiments.bench.memory import (
    memory_growth,
    memory_sample,
    mlp,
    optimizer_bytes,
    saved_bytes,
    tensor_bytes,
)
from pipemare.model import partition


def _timed(step: Any, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - start


def _single(
    args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, compiled: bool = False
) -> dict[str, Any] | None:
    model = mlp(args.width, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    run = torch.compile(model) if compiled else model  # torch.compile's defaults: inductor

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(run(x), y).backward()
        opt.step()

    if dist.get_rank() != 0:
        dist.barrier()  # rank 0's timed window opens with this barrier
        dist.barrier()
        return None
    wall = _timed(step, args.warmup, args.steps)
    dist.barrier()
    params = list(model.parameters())
    memory = {
        "weights": tensor_bytes(params),
        "optimizer": optimizer_bytes(opt, params),
        "stash": 0,
        "buffers": 0,
        "activations": saved_bytes(model, x),
    }
    return {"wall_s": wall, "utilisation": 1.0, "comm_s": 0.0, "memory": memory}


def _stage_memory(
    pipe: Any, opt: torch.optim.Optimizer, args: argparse.Namespace, x: torch.Tensor
) -> dict[str, int]:
    """Peak memory of this process's stage, by kind (activations: measured per microbatch
    times the most microbatches the stage held in flight)."""
    (i,) = pipe.local_stages
    stage = pipe.stages[0]
    params = list(pipe.stage_modules[i].parameters())
    weights = tensor_bytes(params)
    with torch.no_grad():  # this stage's input on one microbatch: the earlier layers' output
        inputs = mlp(args.width, args.depth)[: sum(pipe.balance[:i])](
            x[: math.ceil(len(x) / args.microbatches)]
        )
    return {
        "weights": weights,
        "optimizer": optimizer_bytes(opt, params),
        "stash": stage.peak_stashed_versions * weights,
        "buffers": sum(pipe.optimizer.buffer_bytes(i).values()),
        "activations": saved_bytes(copy.deepcopy(pipe.stage_modules[i]), inputs)
        * stage.peak_in_flight,
        # what the stage's hooks counted at its peak (compiled graphs save what they choose)
        "saved_peak": stage.peak_saved_bytes,
    }


def _spans_summary(spans: list, stages: int, wall: float) -> tuple[list[float], list[float]]:
    from pipemare.engine.telemetry import summarize_spans

    stats = summarize_spans(spans, wall)
    util = [stats.get(i, {}).get("utilization", 0.0) for i in range(stages)]
    comm = [stats.get(i, {}).get("comm", 0.0) for i in range(stages)]
    return util, comm


def _engine(
    args: argparse.Namespace,
    schedule: str,
    balance: list[int],
    x: torch.Tensor,
    y: torch.Tensor,
    compiled: bool = False,
) -> dict[str, Any]:
    from pipemare import Pipeline
    from pipemare.engine.telemetry import Probe

    model = mlp(args.width, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    pipe = Pipeline(
        model,
        opt,
        nn.functional.cross_entropy,
        microbatches=args.microbatches,
        schedule=schedule,
        transport="distributed",
        balance=balance,
        total_steps=args.warmup + args.steps,
        compile=compiled,
    )
    pipe.probe = Probe(timeline=True, max_spans=1_000_000)
    began = time.perf_counter()
    for _ in range(args.warmup):  # compiling, where asked, happens here
        pipe.step((x, y))
    warmup = time.perf_counter() - began
    assert pipe.probe is not None
    pipe.probe.take_spans()
    dist.barrier()
    start = time.perf_counter()
    trace = []  # memory after each step: reading it costs microseconds
    for i in range(args.steps):
        pipe.step((x, y))
        trace.append((i, *memory_sample()))
    wall = time.perf_counter() - start
    spans = [s for s in pipe.probe.take_spans() if s[3] >= 0]
    _count_saved(pipe, x, y)
    pipe.drain()
    memory = _stage_memory(pipe, opt, args, x)
    growth = memory_growth(trace)
    return {"wall_s": wall, "spans": spans, "memory": memory, "growth": growth, "warmup_s": warmup}


def _count_saved(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    """A few more steps, after the timed ones, with every stage counting the bytes autograd
    holds for its microbatches in flight (the memory row's ``saved_peak``). Counting takes a
    hook per saved tensor, which a stage that saves its weights by reference does not run
    otherwise, so the timed steps run as users' do, without it."""
    for stage in pipe.stages:
        stage.measure_saved = True
    for _ in range(len(pipe.balance) + 2):  # steady state again: every microbatch in flight
        pipe.step((x, y))


class _Module:
    """The benchmark's model as a LightningModule (built lazily to keep Lightning optional)."""

    @staticmethod
    def make(args: argparse.Namespace) -> Any:
        import pytorch_lightning as pl

        class Bench(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = mlp(args.width, args.depth)

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, y = batch
                return nn.functional.cross_entropy(self.net(x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9)

        return Bench()


def _lightning(
    args: argparse.Namespace,
    schedule: str,
    balance: list[int],
    x: torch.Tensor,
    y: torch.Tensor,
    stages: int | None = None,
) -> dict[str, Any]:
    """The Lightning strategy; with ``stages`` below the process count, D = processes/stages
    copies of the pipeline, each training on its own 1/D of every batch."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from pipemare import PipeMareStrategy

    total = args.warmup + args.steps
    if stages is not None:  # this copy's share of the batch (the distributed sampler's split)
        copies = dist.get_world_size() // stages
        copy_index = dist.get_rank() // stages
        x, y = x.tensor_split(copies)[copy_index], y.tensor_split(copies)[copy_index]
    batches = [(x, y)] * total  # whole batches: no per-sample collation in the timed steps
    seen: dict[str, Any] = {}
    trace: list[tuple[int, float, float | None]] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            if i == args.warmup:
                probe = trainer.strategy.pipeline.probe
                probe.take_spans()
                seen["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, out: Any, b: Any, i: int) -> None:
            if i >= args.warmup:
                trace.append((i, *memory_sample()))
            if i == total - 1:
                seen["wall"] = time.perf_counter() - seen["start"]
                pipe = trainer.strategy.pipeline
                seen["spans"] = pipe.probe.take_spans()
                seen["pipe"], seen["opt"] = pipe, trainer.optimizers[0]

    strategy = PipeMareStrategy(
        stages=stages, microbatches=args.microbatches, schedule=schedule, balance=balance
    )
    strategy.request_probe(timeline=True)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Clock()],
    )
    trainer.fit(_Module.make(args), DataLoader(batches, batch_size=None))
    memory = _stage_memory(seen["pipe"], seen["opt"], args, x)
    growth = memory_growth(trace)
    return {"wall_s": seen["wall"], "spans": seen["spans"], "memory": memory, "growth": growth}


def _stage_bound(
    args: argparse.Namespace, balance: list[int], x: torch.Tensor, y: torch.Tensor
) -> float:
    """Seconds this rank's stage computes per step with no pipeline at all: N microbatches'
    forward and backward and one SGD update, timed on every rank at once (as the pipeline
    runs them, sharing the machine). The slowest stage bounds any pipeline's step time."""
    model = mlp(args.width, args.depth)
    rank, cut = dist.get_rank(), [0, *itertools.accumulate(balance)]
    stage = model[cut[rank] : cut[rank + 1]]
    opt = torch.optim.SGD(stage.parameters(), lr=args.lr, momentum=0.9)
    with torch.no_grad():
        inputs = model[: cut[rank]](x)
    last = rank == len(balance) - 1

    def step() -> None:
        for xs, ys in zip(
            inputs.tensor_split(args.microbatches), y.tensor_split(args.microbatches), strict=True
        ):
            out = stage(xs.detach().requires_grad_(rank > 0))
            if last:
                nn.functional.cross_entropy(out, ys).backward()
            else:
                out.backward(torch.ones_like(out))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(step, args.warmup, args.steps) / args.steps


def _gather(local: Any) -> list[Any]:
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return parts


def _row(
    kind: str, schedule: str, args: argparse.Namespace, parts: list[dict], stages: int | None = None
) -> dict:
    """One JSON line from every rank's measurements (the pipeline's wall: the slowest rank).
    With ``stages`` below the process count, rank r runs stage r mod ``stages`` of its copy."""
    p = len(parts)
    stages = stages or p
    wall = max(part["wall_s"] for part in parts)
    row: dict[str, Any] = {
        "kind": kind,
        "schedule": schedule,
        "processes": p,
        "width": args.width,
        "depth": args.depth,
        "batch": args.batch,
        "microbatches": args.microbatches,
        "steps": args.steps,
        "samples_per_s": args.batch * args.steps / wall,
    }
    if "spans" in parts[0]:  # pipemare: the probe's spans of each rank's own stage
        util, comm = [], []
        for r, part in enumerate(parts):
            u, c = _spans_summary(part["spans"], stages, part["wall_s"])
            util.append(u[r % stages] * part["wall_s"] / wall)
            comm.append(c[r % stages])
    else:
        util = [part["utilisation"] * part["wall_s"] / wall for part in parts]
        comm = [part["comm_s"] for part in parts]
    row["utilisation"] = util
    row["bubble"] = 1 - statistics.mean(util)
    row["comm_s"] = comm
    row["memory"] = [part["memory"] for part in parts]
    # per rank, MB gained per 1,000 steps over the timed steps, where there are enough of them
    # for a slope (over 20 steps, one late allocation reads as hundreds of MB per 1,000)
    if "growth" in parts[0] and args.steps >= args.memory_steps:
        for key in parts[0]["growth"]:
            row[key] = [part["growth"][key] for part in parts]
    if "warmup_s" in parts[0]:  # the untimed first steps (compiling included, where asked)
        row["warmup_s"] = max(part["warmup_s"] for part in parts)
    if stages != p:
        row["stages"], row["copies"] = stages, p // stages
    return row


def run_worker(args: argparse.Namespace) -> None:
    """One rank of a launch: every kind and schedule in turn; rank 0 writes the JSON rows."""
    from pipemare.experiments.bench.torch_peer import TORCH_SCHEDULES, torch_pipeline_run

    torch.set_num_threads(1)
    if args.compile:  # one thread here too: inductor compiles in this process, no worker pool
        from torch._inductor import config as inductor

        inductor.compile_threads = 1
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    model = mlp(args.width, args.depth)
    balance = partition.balance_by_params(model, world)
    rows: list[dict] = []

    single = _single(args, x, y)
    parts = _gather(single)
    bound = max(_gather(_stage_bound(args, balance, x, y)))
    if rank == 0:
        rows.append(_row("single", "-", args, [parts[0]]))
        rows[-1]["processes"] = 1
        rows[-1]["stage_bound_step_s"] = {str(world): bound}

    for name in TORCH_SCHEDULES:
        pieces = world * (2 if name.startswith("Interleaved") else 1)
        try:
            out = torch_pipeline_run(
                name,
                mlp(args.width, args.depth),
                partition.balance_by_params(model, pieces),
                x,
                y,
                args.microbatches,
                args.steps,
                args.warmup,
                lr=args.lr,
            )
            out["memory"] = {
                "weights": out["weights_bytes"],
                "optimizer": out["optimizer_bytes"],
                "stash": 0,
                "buffers": 0,
                "activations": out["activation_peak_bytes"],
            }
            error = None
        except (RuntimeError, ValueError) as err:
            out, error = {}, str(err).splitlines()[0]
        parts = _gather((out, error))
        if rank == 0:
            errors = [e for _, e in parts if e]
            if errors:
                rows.append(
                    {"kind": "torch", "schedule": name, "processes": world, "error": errors[0]}
                )
            else:
                rows.append(_row("torch", name, args, [o for o, _ in parts]))

    for kind, run_one in (("engine", _engine), ("lightning", _lightning)):
        for name in args.schedules:
            parts = _gather(run_one(args, name, balance, x, y))
            if rank == 0:
                rows.append(_row(kind, name, args, parts))
            dist.barrier()

    if args.compile:  # each stage's forward compiled, beside the eager rows above
        parts = _gather(_single(args, x, y, compiled=True))
        if rank == 0:
            rows.append(_row("single+compile", "-", args, [parts[0]]))
            rows[-1]["processes"] = 1
        for name in args.schedules:
            parts = _gather(_engine(args, name, balance, x, y, compiled=True))
            if rank == 0:
                rows.append(_row("engine+compile", name, args, parts))
            dist.barrier()

    if world >= 4 and world % 2 == 0:  # data x pipeline: world/2 copies of a 2-stage pipeline
        for name in [n for n in args.schedules if n in ("pipemare", "1f1b")]:
            halves = partition.balance_by_params(model, 2)
            parts = _gather(_lightning(args, name, halves, x, y, stages=2))
            if rank == 0:
                label = f"{name}, {world // 2} copies x 2 stages"
                rows.append(_row("lightning", label, args, parts, stages=2))
            dist.barrier()

    if rank == 0:
        _add_ratios(rows, world)
        with open(args.out / f"bench-p{world}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _add_ratios(rows: list[dict], processes: int) -> None:
    first = rows[0]
    single = first["samples_per_s"]
    bound = first["batch"] / first["stage_bound_step_s"][str(processes)]
    torch_1f1b = next(
        (r["samples_per_s"] for r in rows if r["schedule"] == "1F1B" and "error" not in r), None
    )
    cores = os.cpu_count() or 1
    for r in rows:
        r["launch"] = processes  # the torchrun job (P processes) this row was measured in
        if "samples_per_s" not in r:
            continue
        r["vs_single"] = r["samples_per_s"] / single
        if r["kind"].endswith("+compile"):  # against the same run uncompiled
            eager = r["kind"].removesuffix("+compile")
            same = [e for e in rows if e["kind"] == eager and e["schedule"] == r["schedule"]]
            if same and "samples_per_s" in same[0]:
                r["vs_eager"] = r["samples_per_s"] / same[0]["samples_per_s"]
        r["vs_torch_1f1b"] = r["samples_per_s"] / torch_1f1b if torch_1f1b else None
        # what P one-thread processes could reach at most on this machine's cores
        r["cpu_bound_vs_single"] = min(r["processes"], cores)
        if r["kind"] != "single" and "copies" not in r:
            # the slowest stage's own compute, measured alone: no schedule can beat it
            r["stage_bound_vs_single"] = bound / single
            r["of_stage_bound"] = r["samples_per_s"] / bound
