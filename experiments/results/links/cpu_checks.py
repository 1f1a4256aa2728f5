"""Two checks behind the links README's "Where the missing time goes" (issue 62), run alone:

    python experiments/results/links/cpu_checks.py messages    # CPU per gloo message, each side
    python experiments/results/links/cpu_checks.py contention  # a matmul, alone and beside another
    python experiments/results/links/cpu_checks.py memory      # an AdamW update, alone and beside
    python experiments/results/links/cpu_checks.py blocks      # GPT blocks: fastest and median

``messages``: two processes (a file store, so no port is taken) stream 300 one-way messages of
16 KB, 0.2 MB and 0.8 MB; each prints the CPU time of all its threads per message and the wall
time. ``contention``: a 192-wide MLP layer's two matmuls on 256 rows, one thread, timed alone
and then while a second process runs the same loop on the other core. ``memory``: the same
for an update of AdamW over 1.77M parameters (a compute-bound stage's, in tensors of a GPT
block's shapes), whose time is the memory's rather than the core's. ``blocks``: four GPT
blocks of width 192 (the compute-bound GPT's stage) on a microbatch of 8 rows of 64 tokens,
forward then backward, each pass in the thread's CPU time: the fastest and the median pass,
alone and beside a second process doing the same (setup times layers by one of the two).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

SIZES = (16_384, 200_000, 800_000)  # bytes per message
MESSAGES = 300


def _stream(rank: int, store: str, nbytes: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    buffer = torch.zeros(nbytes // 4)
    move = dist.send if rank == 0 else dist.recv
    for _ in range(20):  # warm the connection up
        move(buffer, 1 - rank)
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(MESSAGES):
        move(buffer, 1 - rank)
    dist.barrier()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    side = "sender" if rank == 0 else "receiver"
    print(
        f"{nbytes / 1e6:.3f} MB, {side}: {1e3 * cpu / MESSAGES:.3f} ms of CPU a message (every "
        f"thread), {1e3 * wall / MESSAGES:.3f} ms of wall time",
        flush=True,
    )
    dist.destroy_process_group()


def messages() -> None:
    context = mp.get_context("spawn")
    for nbytes in SIZES:
        with tempfile.TemporaryDirectory() as folder:
            store = os.path.join(folder, "store")
            procs = [context.Process(target=_stream, args=(r, store, nbytes)) for r in (0, 1)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
                assert p.exitcode == 0, f"a streaming process ended with {p.exitcode}"


def _layer_loop(calls: int, out: mp.Queue | None = None) -> float:
    torch.set_num_threads(1)
    x, w1, w2 = torch.randn(256, 192), torch.randn(192, 768), torch.randn(768, 192)
    for _ in range(50):
        torch.nn.functional.gelu(x @ w1) @ w2
    start = time.process_time()
    for _ in range(calls):
        torch.nn.functional.gelu(x @ w1) @ w2
    seconds = (time.process_time() - start) / calls
    if out is not None:
        out.put(seconds)
    return seconds


def _update_loop(calls: int, out: mp.Queue | None = None) -> float:
    torch.set_num_threads(1)
    width = 192  # four GPT blocks of width 192 and their layer norms: about 1.77M parameters
    shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * 4
    params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
    params += [torch.nn.Parameter(torch.ones(width)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(20):
        opt.step()
    start = time.process_time()
    for _ in range(calls):
        opt.step()
    seconds = (time.process_time() - start) / calls
    if out is not None:
        out.put(seconds)
    return seconds


def _blocks_loop(calls: int, out: mp.Queue | None = None) -> list[float]:
    """Fastest and median forward, then backward, in seconds of the thread's CPU."""
    from pipemare.experiments.tasks.gpt import GPTBlock

    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(GPTBlock(192, 6) for _ in range(4)))
    x = torch.randn(8, 64, 192, requires_grad=True)
    passes: list[list[float]] = [[], []]
    for k in range(calls + 5):  # five to warm up
        start = time.thread_time()
        y = blocks(x)
        middle = time.thread_time()
        y.sum().backward()
        if k >= 5:
            passes[0].append(middle - start)
            passes[1].append(time.thread_time() - middle)
    figures = [f(p) for p in passes for f in (min, statistics.median)]
    if out is not None:
        out.put(figures)
    return figures


def _alone_and_beside(loop, calls: int) -> tuple[Any, Any]:
    """``loop``'s CPU seconds a call alone, then beside a second process running it."""
    alone = loop(calls)
    context = mp.get_context("spawn")
    other = context.Process(target=loop, args=(2 * calls,))
    other.start()
    time.sleep(3)  # the other process past its imports and warm-up, computing
    beside = loop(calls)
    other.join(300)
    return alone, beside


def contention() -> None:
    alone, beside = _alone_and_beside(_layer_loop, 3000)
    print(
        f"a 192-wide MLP layer on 256 rows: {1e3 * alone:.3f} ms of CPU alone, "
        f"{1e3 * beside:.3f} ms beside a second process doing the same ({beside / alone - 1:+.0%})"
    )


def memory() -> None:
    alone, beside = _alone_and_beside(_update_loop, 300)
    print(
        f"AdamW's update of 1.77M parameters: {1e3 * alone:.3f} ms of CPU alone, "
        f"{1e3 * beside:.3f} ms beside a second process doing the same ({beside / alone - 1:+.0%})"
    )


def blocks() -> None:
    alone, beside = _alone_and_beside(_blocks_loop, 150)
    for name, figures in (("alone", alone), ("beside a second process", beside)):
        f_min, f_med, b_min, b_med = (1e3 * t for t in figures)
        print(
            f"four GPT blocks of width 192, 8 x 64 tokens, {name}: forward {f_min:.2f} ms "
            f"fastest, {f_med:.2f} median ({f_med / f_min - 1:+.0%}); backward {b_min:.2f} "
            f"fastest, {b_med:.2f} median ({b_med / b_min - 1:+.0%})"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=["messages", "contention", "memory", "blocks"])
    checks = {"messages": messages, "contention": contention, "memory": memory, "blocks": blocks}
    checks[parser.parse_args().check]()
