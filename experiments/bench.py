"""``pipemare bench``: throughput and memory of pipemare's pipelines against the alternatives.

One invocation launches, for each process count P, one ``torchrun`` job (gloo, one thread per
process) that trains the same model, batch and optimiser (SGD, momentum 0.9) in turn as:

- ``single``: the whole model in one process (rank 0; the others wait in a barrier);
- ``torch``: ``torch.distributed.pipelining``'s GPipe, 1F1B, Interleaved1F1B and
  InterleavedZeroBubble with hand-split stages (:mod:`pipemare.experiments.bench_torch`);
- ``engine``: pipemare's :class:`~pipemare.Pipeline` with every schedule;
- ``lightning``: ``Trainer(strategy=PipeMareStrategy(...))`` with every schedule;

so every ratio compares runs of one launch. Each configuration is one JSON line: samples/s,
per-stage utilisation (compute over wall) and communication seconds, the bubble (mean idle
fraction), memory per stage (weights, optimiser state, stashed weights, correction buffers,
activations) and ratios against single-process training and torch's 1F1B. Then a table and a
bar chart. A separate in-process pass measures stage 0's weight memory under ``pipedream``'s
stash and ``pipemare``'s correction buffers at several P against their analytic values.

Run it alone on the machine: anything else running turns the figures into noise.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipemare.model import partition
from pipemare.schedule.actions import SCHEDULES, spec

__all__ = ["main", "memory_study", "run"]

_ENGINE = "pipemare.experiments.bench"


def mlp(width: int, depth: int, classes: int = 10) -> nn.Sequential:
    """``depth`` blocks of Linear(width, width) + GELU, then a linear classifier (seeded)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _optimizer_bytes(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> int:
    return sum(_bytes(opt.state[p].values()) for p in params if p in opt.state)


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward of ``module`` (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


# -- one process per stage (inside torchrun) ------------------------------------------------


def _timed(step: Any, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - start


def _single(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any] | None:
    model = mlp(args.width, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    if dist.get_rank() != 0:
        dist.barrier()  # rank 0's timed window opens with this barrier
        dist.barrier()
        return None
    wall = _timed(step, args.warmup, args.steps)
    dist.barrier()
    params = list(model.parameters())
    memory = {
        "weights": _bytes(params),
        "optimizer": _optimizer_bytes(opt, params),
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
    weights = _bytes(params)
    with torch.no_grad():  # this stage's input on one microbatch: the earlier layers' output
        inputs = mlp(args.width, args.depth)[: sum(pipe.balance[:i])](
            x[: math.ceil(len(x) / args.microbatches)]
        )
    return {
        "weights": weights,
        "optimizer": _optimizer_bytes(opt, params),
        "stash": stage.peak_stashed_versions * weights,
        "buffers": sum(pipe.optimizer.buffer_bytes(i).values()),
        "activations": saved_bytes(copy.deepcopy(pipe.stage_modules[i]), inputs)
        * stage.peak_in_flight,
    }


def _spans_summary(spans: list, stages: int, wall: float) -> tuple[list[float], list[float]]:
    from pipemare.engine.telemetry import summarize_spans

    stats = summarize_spans(spans, wall)
    util = [stats.get(i, {}).get("utilization", 0.0) for i in range(stages)]
    comm = [stats.get(i, {}).get("comm", 0.0) for i in range(stages)]
    return util, comm


def _engine(
    args: argparse.Namespace, schedule: str, balance: list[int], x: torch.Tensor, y: torch.Tensor
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
    )
    pipe.probe = Probe(timeline=True, max_spans=1_000_000)
    for _ in range(args.warmup):
        pipe.step((x, y))
    assert pipe.probe is not None
    pipe.probe.take_spans()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        pipe.step((x, y))
    wall = time.perf_counter() - start
    spans = [s for s in pipe.probe.take_spans() if s[3] >= 0]
    pipe.drain()
    return {"wall_s": wall, "spans": spans, "memory": _stage_memory(pipe, opt, args, x)}


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

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            if i == args.warmup:
                probe = trainer.strategy.pipeline.probe
                probe.take_spans()
                seen["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, out: Any, b: Any, i: int) -> None:
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
    return {"wall_s": seen["wall"], "spans": seen["spans"], "memory": memory}


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
    if stages != p:
        row["stages"], row["copies"] = stages, p // stages
    return row


def _worker(args: argparse.Namespace) -> None:
    from pipemare.experiments.bench_torch import TORCH_SCHEDULES, torch_pipeline_run

    torch.set_num_threads(1)
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
        r["vs_torch_1f1b"] = r["samples_per_s"] / torch_1f1b if torch_1f1b else None
        # what P one-thread processes could reach at most on this machine's cores
        r["cpu_bound_vs_single"] = min(r["processes"], cores)
        if r["kind"] != "single" and "copies" not in r:
            # the slowest stage's own compute, measured alone: no schedule can beat it
            r["stage_bound_vs_single"] = bound / single
            r["of_stage_bound"] = r["samples_per_s"] / bound


# -- the command ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> list[dict]:
    """Launch one torchrun job per process count; returns every JSON row."""
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for p in args.processes:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={p}",
            "-m",
            _ENGINE,
            "worker",
            *_forward(args),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the benchmark at P={p} failed:\n{proc.stderr[-4000:]}")
        rows += [
            json.loads(line) for line in (args.out / f"bench-p{p}.jsonl").read_text().splitlines()
        ]
    return rows


def _forward(args: argparse.Namespace) -> list[str]:
    return [
        "--out", str(args.out),
        "--width", str(args.width),
        "--depth", str(args.depth),
        "--batch", str(args.batch),
        "--microbatches", str(args.microbatches),
        "--steps", str(args.steps),
        "--warmup", str(args.warmup),
        "--lr", str(args.lr),
        "--schedules", *args.schedules,
    ]  # fmt: skip


def memory_study(stages: list[int], width: int, depth: int, batch: int, n: int) -> list[dict]:
    """Stage 0's extra weight memory: pipedream's stash against pipemare's buffers (simulated).

    Analytic: pipedream keeps one stashed copy per weight version still awaited by an
    in-flight microbatch, ``ceil((P-1)/N)`` copies of stage 0's weights at most; pipemare keeps
    the buffers its corrections declare (a count of weight-sized tensors, times the weights).
    """
    from pipemare import Pipeline

    rows = []
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, width, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    for p in stages:
        model = mlp(width, depth)
        w0 = _bytes(model[: partition.balance_by_params(model, p)[0]].parameters())
        row: dict[str, Any] = {"stages": p, "microbatches": n, "stage0_weights": w0}
        for schedule in ("pipedream", "pipemare"):
            model = mlp(width, depth)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
            pipe = Pipeline(
                model,
                opt,
                nn.functional.cross_entropy,
                stages=p,
                microbatches=n,
                schedule=schedule,
                balance="params",
            )
            for _ in range(p + 2):
                pipe.step((x, y))
            stage = pipe.stages[0]
            if schedule == "pipedream":
                row["stash_measured"] = stage.peak_stashed_versions * w0
                row["stash_analytic"] = math.ceil((p - 1) / n) * w0
            else:
                row["buffers_measured"] = sum(pipe.optimizer.buffer_bytes(0).values())
                row["buffers_by_correction"] = pipe.optimizer.buffer_bytes(0)
            pipe.drain()
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """A markdown table of the JSON rows."""
    lines = [
        "| P | kind | schedule | samples/s | × single | × torch 1F1B | of stage bound "
        "| utilisation per stage | bubble |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['processes']} | {r['kind']} | {r['schedule']} | {r['error']} ||||||"
            )
            continue
        util = " / ".join(f"{u:.2f}" for u in r["utilisation"])
        vs_torch = f"{r['vs_torch_1f1b']:.2f}" if r.get("vs_torch_1f1b") else "-"
        # copies of a shorter pipeline have other stages than the bound measured for P stages
        bound = "-" if "copies" in r else f"{r.get('of_stage_bound', 1.0):.2f}"
        lines.append(
            f"| {r['processes']} | {r['kind']} | {r['schedule']} | {r['samples_per_s']:.0f} | "
            f"{r['vs_single']:.2f} | {vs_torch} | {bound} | {util} | "
            f"{r['bubble']:.2f} |"
        )
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    """Bar chart of samples/s per configuration, one group per process count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r["processes"] for r in rows if r["kind"] != "single"})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    colours = {
        "single": "grey",
        "torch": "tab:orange",
        "engine": "tab:blue",
        "lightning": "tab:green",
    }
    for ax, p in zip(axes[0], groups, strict=True):
        single = next(r for r in rows if r["kind"] == "single" and r.get("launch") == p)
        shown = [single] + [r for r in rows if r["processes"] == p and "samples_per_s" in r]
        labels = [f"{r['kind']}\n{r['schedule'].replace('Interleaved', 'Intl.')}" for r in shown]
        ax.bar(range(len(shown)), [r["samples_per_s"] for r in shown],
               color=[colours[r["kind"]] for r in shown])  # fmt: skip
        ax.set_xticks(range(len(shown)), labels, rotation=70, fontsize=7)
        ax.axhline(single["samples_per_s"] * min(p, os.cpu_count() or 1), ls="--", c="k", lw=0.8)
        bound = next(r for r in shown if r["kind"] != "single")
        if "stage_bound_vs_single" in bound:
            ax.axhline(single["samples_per_s"] * bound["stage_bound_vs_single"], c="tab:red", lw=1)
        ax.set_title(
            f"P = {p} (dashed: {min(p, os.cpu_count() or 1)}× single; red: slowest stage alone)",
            fontsize=9,
        )
        ax.set_ylabel("samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def decompose(args: argparse.Namespace, shared: bool = False) -> dict[str, float]:
    """Where a 2-stage pipeline's gap to 2x one process goes, in milliseconds per step: the
    whole model on the whole batch, its first half on the whole batch, the same half as N
    microbatches, and (``shared``) that again while a twin process does the same."""
    torch.set_num_threads(1)
    model = mlp(args.width, args.depth)
    half = model[: partition.balance_by_params(model, 2)[0]]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)

    def whole() -> None:
        nn.functional.cross_entropy(model(x), y).backward()

    def stage(chunks: int) -> Any:
        def run() -> None:
            for xs in x.tensor_split(chunks):
                out = half(xs)
                out.backward(torch.ones_like(out))

        return run

    def ms(fn: Any, n: int = 15) -> float:
        for _ in range(3):
            fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return 1e3 * (time.perf_counter() - start) / n

    if shared:
        return {"half_microbatched_shared": ms(stage(args.microbatches), 30)}
    out = {
        "whole": ms(whole),
        "half_whole_batch": ms(stage(1)),
        "half_microbatched": ms(stage(args.microbatches)),
    }
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            stage(args.microbatches)()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    cmd = [sys.executable, "-m", _ENGINE, "twin", *_forward(args)]
    twins = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [json.loads(t.communicate(timeout=600)[0].splitlines()[-1]) for t in twins]
    out["half_microbatched_shared"] = statistics.mean(o["half_microbatched_shared"] for o in outs)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipemare bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "what",
        nargs="?",
        default="run",
        choices=["run", "decompose", "worker", "twin"],
        help="run: the benchmark; decompose: where the gap to 2x one process goes",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--memory-stages", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--timeout", type=float, default=3600)
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    for name in args.schedules:
        spec(name)
    if args.what == "worker":
        _worker(args)
        return []
    if args.what in ("decompose", "twin"):
        print(json.dumps(decompose(args, shared=args.what == "twin")))
        return []
    rows = run(args)
    memory = memory_study(args.memory_stages, args.width, args.depth, args.batch, args.microbatches)
    with open(args.out / "bench.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    (args.out / "memory.json").write_text(json.dumps(memory, indent=1))
    text = table(rows)
    (args.out / "bench.md").write_text(text + "\n")
    chart(rows, args.out / "bench.png")
    print(text)
    for m in memory:
        print(json.dumps(m))
    return rows


if __name__ == "__main__":
    main()
