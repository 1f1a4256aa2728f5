"""The cost of Adam in a rotated basis (:class:`pipemare.optim.RotatedAdamW`) at the widths users
train, against AdamW: one transformer MLP block's two matrices (``width × 4·width`` and back),
a step's forward and backward on ``tokens`` tokens, and the optimiser's step averaged over a
full eigendecomposition period (``every`` steps, SOAP's 10), on one CPU thread.

Run it alone on the machine: ``python -m pipemare.experiments.bench.rotated_cost``. Printed per
width (and, with ``--out FILE``, written there as JSON with the command and the machine):
milliseconds of forward+backward, of AdamW's step and of RotatedAdamW's, and the ratio
of a whole training step with each (the issue's question: is the rotated step's cost, 36% of a
step on 64-wide layers, still prohibitive at 1024 and beyond?).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

from pipemare.optim import RotatedAdamW

__all__ = ["rotated_step_cost"]


def _block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def _seconds(fn, repeats: int) -> float:
    fn()  # warm up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def rotated_step_cost(
    width: int, tokens: int, every: int = 10, periods: int = 2
) -> dict[str, float]:
    """Milliseconds of one step's forward+backward, AdamW's step and RotatedAdamW's step (its
    step averaged over ``periods`` eigendecomposition periods)."""
    torch.manual_seed(0)
    block = _block(width)
    x = torch.randn(tokens, width)

    def backward() -> None:
        block.zero_grad(set_to_none=False)
        block(x).square().mean().backward()

    backward_ms = 1e3 * _seconds(backward, 3)
    out = {"width": width, "tokens": tokens, "forward_backward_ms": backward_ms}
    for name, opt in (
        ("adamw", torch.optim.AdamW(block.parameters(), lr=1e-4)),
        ("rotated", RotatedAdamW(block.parameters(), lr=1e-4, every=every)),
    ):
        backward()
        opt.step()  # the first step seeds the state (and the rotated factors)
        out[f"{name}_step_ms"] = 1e3 * _seconds(opt.step, every * periods)
    whole = {k: backward_ms + out[f"{k}_step_ms"] for k in ("adamw", "rotated")}
    out["step_ratio"] = whole["rotated"] / whole["adamw"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, help="a JSON file for the rows, command and machine")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| width | tokens | fwd+bwd ms | AdamW step ms | RotatedAdamW step ms | step ratio |")
    print("|---|---|---|---|---|---|")
    rows = []
    for width in args.widths:
        r = rotated_step_cost(width, args.tokens)
        rows.append(r)
        print(
            f"| {width} | {args.tokens} | {r['forward_backward_ms']:.1f} | "
            f"{r['adamw_step_ms']:.1f} | {r['rotated_step_ms']:.1f} | {r['step_ratio']:.2f} |",
            flush=True,
        )
    if args.out is not None:
        command = "python -m pipemare.experiments.bench.rotated_cost " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        machine = {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        record = {"command": command.strip(), "machine": machine, "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
