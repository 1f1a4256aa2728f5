"""``pipemare bench``: throughput and memory of pipemare's pipelines against the alternatives.

One invocation launches, for each process count P, one ``torchrun`` job (gloo, one thread per
process) that trains the same model, batch and optimiser (SGD, momentum 0.9) in turn as:

- ``single``: the whole model in one process (rank 0; the others wait in a barrier);
- ``torch``: ``torch.distributed.pipelining``'s GPipe, 1F1B, Interleaved1F1B and
  InterleavedZeroBubble with hand-split stages (:mod:`~pipemare.experiments.bench.torch_peer`);
- ``engine``: pipemare's :class:`~pipemare.Pipeline` with every schedule;
- ``lightning``: ``Trainer(strategy=PipeMareStrategy(...))`` with every schedule;
- with ``--compile``, ``engine+compile`` and ``single+compile``: the engine's schedules and the
  single process again, each stage's forward through ``torch.compile`` (inductor), with their
  speed against the same run uncompiled (``× eager``) and the untimed warm-up's seconds, where
  the compiling happens;

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
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipemare.experiments.bench.launch import add_model_options, flags, torchrun
from pipemare.experiments.bench.memory import memory_study, mlp
from pipemare.experiments.bench.worker import run_worker
from pipemare.model import partition
from pipemare.schedule.actions import SCHEDULES, spec

_ENGINE = "pipemare.experiments.bench"


def run_benchmarks(args: argparse.Namespace) -> list[dict]:
    """Launch one torchrun job per process count; returns every JSON row."""
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for p in args.processes:
        failure = f"the benchmark at P={p} failed"
        torchrun(_ENGINE, p, _forward(args), args.timeout, failure, PYTHONWARNINGS="ignore")
        rows += [
            json.loads(line) for line in (args.out / f"bench-p{p}.jsonl").read_text().splitlines()
        ]
    return rows


def _forward(args: argparse.Namespace) -> list[str]:
    names = ("out", "width", "depth", "batch", "microbatches", "steps", "memory_steps")
    names += ("warmup", "lr", "schedules")
    return flags(args, *names) + (["--compile"] if args.compile else [])


def table(rows: list[dict]) -> str:
    """A markdown table of the JSON rows."""
    lines = [
        "| P | kind | schedule | samples/s | × single | × torch 1F1B | × eager | of stage bound "
        "| utilisation per stage | bubble | resident MB per 1,000 steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['processes']} | {r['kind']} | {r['schedule']} | {r['error']} ||||||||"
            )
            continue
        util = " / ".join(f"{u:.2f}" for u in r["utilisation"])
        vs_torch = f"{r['vs_torch_1f1b']:.2f}" if r.get("vs_torch_1f1b") else "-"
        vs_eager = f"{r['vs_eager']:.2f}" if r.get("vs_eager") else "-"  # compiled rows
        # copies of a shorter pipeline have other stages than the bound measured for P stages
        bound = "-" if "copies" in r else f"{r.get('of_stage_bound', 1.0):.2f}"
        growth = r.get("resident_mb_per_1000")  # the rank that grew most
        grown = "-" if growth is None else f"{max(growth):+.1f}"
        lines.append(
            f"| {r['processes']} | {r['kind']} | {r['schedule']} | {r['samples_per_s']:.0f} | "
            f"{r['vs_single']:.2f} | {vs_torch} | {vs_eager} | {bound} | {util} | "
            f"{r['bubble']:.2f} | {grown} |"
        )
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    """Bar chart of samples/s per configuration, one group per process count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r["processes"] for r in rows if not r["kind"].startswith("single")})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    colours = {
        "single": "grey",
        "torch": "tab:orange",
        "engine": "tab:blue",
        "lightning": "tab:green",
        "single+compile": "dimgrey",
        "engine+compile": "tab:purple",
    }
    for ax, p in zip(axes[0], groups, strict=True):
        single = next(r for r in rows if r["kind"] == "single" and r.get("launch") == p)
        compiled = [r for r in rows if r["kind"] == "single+compile" and r.get("launch") == p]
        shown = [single, *compiled]
        shown += [r for r in rows if r["processes"] == p and "samples_per_s" in r]
        labels = [f"{r['kind']}\n{r['schedule'].replace('Interleaved', 'Intl.')}" for r in shown]
        ax.bar(range(len(shown)), [r["samples_per_s"] for r in shown],
               color=[colours[r["kind"]] for r in shown])  # fmt: skip
        ax.set_xticks(range(len(shown)), labels, rotation=70, fontsize=7)
        ax.axhline(single["samples_per_s"] * min(p, os.cpu_count() or 1), ls="--", c="k", lw=0.8)
        bound = next(r for r in shown if not r["kind"].startswith("single"))
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
        help="run: the benchmark; decompose: where the gap to 2x one process goes; gpt: a "
        "GPT with a tied head against torch's pipeline() (pipemare bench gpt --help)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    add_model_options(parser, width=1024, depth=8, batch=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--memory-steps",
        type=int,
        default=100,
        help="report resident memory's growth per 1,000 steps when --steps is at least this "
        "(fewer steps make one late allocation read as hundreds of MB per 1,000)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--memory-stages", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time each schedule (and the single process) with torch.compile's defaults "
        "on each stage's forward: rows 'engine+compile' and 'single+compile', with x eager",
    )
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpt"]:  # the GPT as people write it against torch's pipeline()
        from pipemare.experiments.bench import real_models

        rates = real_models.main(argv[1:])
        return [{"engine": k, "samples_per_s": v} for k, v in rates.items()]
    args = _parser().parse_args(argv)
    for name in args.schedules:
        spec(name)
    if args.what == "worker":
        run_worker(args)
        return []
    if args.what in ("decompose", "twin"):
        print(json.dumps(decompose(args, shared=args.what == "twin")))
        return []
    rows = run_benchmarks(args)
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
