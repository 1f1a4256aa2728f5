"""Throughput on a model as people write it: the character GPT (blocks in a ``ModuleList``,
head tied to the embedding; :class:`pipemare.experiments.tasks.gpt.GPT`) on P = 2 gloo
processes, every rank timing the same number of optimiser steps:

- ``pipemare``: the engine's ``pipemare`` schedule over the model cut by
  :func:`pipemare.model.segments.segment_module` before ``blocks.{k}``;
- ``pipemare-sequential``: the same layers written as an ``nn.Sequential`` (embedding, blocks,
  head, sharing the model's modules), cut before the same block: what the split costs;
- ``torch-1F1B``: torch's own ``pipeline()`` with ``SplitPoint.BEGINNING`` at the same block
  and ``Schedule1F1B`` (torch traces and splits the model itself; it replicates the tied
  weight and leaves its copies unsynchronised, which this throughput figure ignores).

Run it alone on the machine: ``pipemare bench gpt`` (or ``python -m
pipemare.experiments.bench.real_models``). One JSON line per engine: samples/s over the timed
steps of the slowest rank, and the ratios to torch's 1F1B and to the Sequential.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

__all__ = ["main", "run_rank"]


class _Embed(nn.Module):
    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class _Head(nn.Module):
    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def _model(args: argparse.Namespace) -> nn.Module:
    from pipemare.experiments.tasks.gpt import GPT

    torch.manual_seed(0)
    return GPT(256, args.width, 4, args.layers, args.context)


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (args.batch, args.context + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _timed(step: Any, args: argparse.Namespace) -> float:
    for _ in range(args.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    dist.barrier()
    return seconds


def _pipemare(args: argparse.Namespace, sequential: bool) -> float:
    from pipemare import Pipeline
    from pipemare.engine.transport import DistributedTransport
    from pipemare.model.segments import segment_module

    gpt = _model(args)
    x, y = _batch(args)
    cut = f"blocks.{args.cut}"
    if sequential:
        model = nn.Sequential(_Embed(gpt), *gpt.blocks, _Head(gpt))
        balance = [1 + args.cut, len(model) - 1 - args.cut]
    else:
        model = segment_module(gpt, (x[:2],), split_points=[cut])
        balance = [1, 1]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    pipe = Pipeline(
        model,
        opt,
        _loss,
        transport=DistributedTransport(2, heartbeat_timeout=None),
        microbatches=args.microbatches,
        schedule="pipemare",
        balance=balance,
    )
    seconds = _timed(lambda: pipe.step((x, y)), args)
    pipe.drain()
    return seconds


def _torch(args: argparse.Namespace) -> float:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    gpt = _model(args)
    x, y = _batch(args)
    mb = x[: args.batch // args.microbatches]
    pipe = pipeline(gpt, (mb,), split_spec={f"blocks.{args.cut}": SplitPoint.BEGINNING})
    rank = dist.get_rank()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=_loss)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()

    return _timed(step, args)


def run_rank(rank: int, store: str, args: argparse.Namespace, queue: Any) -> None:
    """One of the two processes: every engine in turn, the same steps. The two meet through a
    file store, so no port is picked and none can be taken by another process meanwhile."""
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    results = {}
    for name in args.engines:
        if name == "torch-1F1B":
            seconds = _torch(args)
        else:
            seconds = _pipemare(args, sequential=name == "pipemare-sequential")
        slowest = torch.tensor([seconds])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[name] = args.batch * args.steps / float(slowest)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        prog="pipemare bench gpt", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--cut", type=int, default=4, help="the second stage starts here")
    parser.add_argument(
        "--engines",
        nargs="+",
        default=["pipemare", "pipemare-sequential", "torch-1F1B"],
        choices=["pipemare", "pipemare-sequential", "torch-1F1B"],
    )
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        procs = [ctx.Process(target=run_rank, args=(r, store, args, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = queue.get(timeout=1800)
        for p in procs:
            p.join(timeout=120)
    base = results.get("torch-1F1B")
    seq = results.get("pipemare-sequential")
    for name, rate in results.items():
        row: dict[str, Any] = {"engine": name, "samples_per_s": round(rate, 1)}
        if base:
            row["vs_torch_1f1b"] = round(rate / base, 3)
        if seq and name == "pipemare":
            row["vs_sequential"] = round(rate / seq, 3)
        print(json.dumps(row))
    return results


if __name__ == "__main__":
    main()
