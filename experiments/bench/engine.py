"""Engine overhead benchmarks: the simulator against plain training, and 2 processes against 1.

Run ``python -m pipemare.experiments.bench.engine sim`` and ``... dist``. Timings are medians
of repeated runs taken in one process (or one launch), so the ratios compare like with like on
a shared machine; nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from pipemare import Pipeline
from pipemare.experiments.bench.launch import add_model_options, flags, torchrun
from pipemare.experiments.bench.memory import mlp


def _median_step_time(step: Callable[[], object], warmup: int, steps: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def bench_simulator(width: int, depth: int, batch: int, stages: int, schedule: str) -> dict:
    """Step time of the in-process engine over plain training of the same model and batch."""
    torch.set_num_threads(1)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))

    plain = mlp(width, depth)
    opt = torch.optim.SGD(plain.parameters(), lr=1e-3)

    def plain_step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(plain(x), y).backward()
        opt.step()

    piped = mlp(width, depth)
    pipe = Pipeline(
        piped,
        torch.optim.SGD(piped.parameters(), lr=1e-3),
        nn.functional.cross_entropy,
        stages=stages,
        microbatches=1,
        schedule=schedule,
    )
    results = {}
    for _ in range(2):  # interleave, so drift on a shared machine hits both alike
        results.setdefault("plain", []).append(_median_step_time(plain_step, 3, 20, 5))
        results.setdefault("pipeline", []).append(
            _median_step_time(lambda: pipe.step((x, y)), 3, 20, 5)
        )
    t_plain, t_pipe = min(results["plain"]), min(results["pipeline"])
    return {
        "benchmark": "simulator",
        "schedule": schedule,
        "stages": stages,
        "width": width,
        "depth": depth,
        "batch": batch,
        "plain_ms": 1e3 * t_plain,
        "pipeline_ms": 1e3 * t_pipe,
        "ratio": t_pipe / t_plain,
    }


def _dist_worker(args: argparse.Namespace) -> None:
    """Alternate, in one launch, rank 0 training the whole model alone and both ranks piping it."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    whole = mlp(args.width, args.depth)
    whole_opt = torch.optim.SGD(whole.parameters(), lr=1e-4)

    def single_step() -> None:
        whole_opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(whole(x), y).backward()
        whole_opt.step()

    piped = mlp(args.width, args.depth)
    pipe = Pipeline(
        piped,
        torch.optim.SGD(piped.parameters(), lr=1e-4),
        nn.functional.cross_entropy,
        microbatches=args.microbatches,
        schedule=args.schedule,
        transport="distributed",
        balance=args.balance,
    )
    single, piped_rates = [], []
    for _ in range(3):
        torch.distributed.barrier()
        if rank == 0:  # the other rank waits in the barrier below, using no CPU
            single.append(args.batch / _median_step_time(single_step, 2, args.steps, 1))
        torch.distributed.barrier()
        piped_rates.append(
            args.batch / _median_step_time(lambda: pipe.step((x, y)), 3, args.steps, 1)
        )
    pipe.drain()
    if rank == 0:
        print(
            json.dumps(
                {"single": statistics.median(single), "pipeline": statistics.median(piped_rates)}
            )
        )


def bench_distributed(args: argparse.Namespace) -> dict:
    """Samples/s of a 2-process pipeline over one process training the whole model (one launch)."""
    names = ("width", "depth", "batch", "microbatches", "schedule", "steps", "balance")
    failure = "benchmark launch failed"
    proc = torchrun("pipemare.experiments.bench.engine", 2, flags(args, *names), 1800, failure)
    rates = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    return {
        "benchmark": "distributed",
        "schedule": args.schedule,
        "width": args.width,
        "depth": args.depth,
        "batch": args.batch,
        "microbatches": args.microbatches,
        "balance": args.balance,
        "single_samples_per_s": rates["single"],
        "two_process_samples_per_s": rates["pipeline"],
        "speedup": rates["pipeline"] / rates["single"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["sim", "dist", "worker"])
    add_model_options(parser, width=None, depth=16, batch=64)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--balance", default="params", choices=["even", "params"])
    args = parser.parse_args(argv)
    if args.what == "sim":
        result = bench_simulator(
            args.width or 512, args.depth, args.batch, args.stages, args.schedule or "async"
        )
    elif args.what == "dist":
        args.width = args.width or 1024
        args.schedule = args.schedule or "pipemare"
        result = bench_distributed(args)
    else:
        _dist_worker(args)
        return
    print(json.dumps(result))


if __name__ == "__main__":
    main()
