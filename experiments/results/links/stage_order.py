"""A GPT's blocks timed as setup times them against in a stage's order (issue 62).

Setup (``partition.layer_passes``) times each layer's backward right after its own forward. A
stage runs its layers' forwards in order and their backwards later, in reverse order. This
times the same blocks both ways, in turn, six times each, on one thread, and prints the sums of
the layers' median forwards and backwards and the ratio of the medians. Run alone::

    python experiments/results/links/stage_order.py 192 4 8 64   # width, blocks, rows, context
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipemare.experiments.tasks.gpt import GPTBlock
from pipemare.model import partition

Passes = list[tuple[float, float]]


def _inputs(layers: list[nn.Module], sample: torch.Tensor) -> list[Any]:
    inputs, x = [], sample
    with torch.no_grad():
        for layer in layers:
            inputs.append(x)
            x = layer(partition._leaf(x))
    return inputs


def back_to_back(layers: list[nn.Module], sample: torch.Tensor, repeats: int = 5) -> Passes:
    """Each layer's forward, then its backward, layer after layer: setup's own timing."""
    return partition.layer_passes(nn.Sequential(*layers), sample, repeats)


def stage_order(layers: list[nn.Module], sample: torch.Tensor, repeats: int = 5) -> Passes:
    """Every layer's forward in order, then their backwards in reverse (as a stage runs them)."""
    sync, clock = partition._clock(sample)
    inputs = _inputs(layers, sample)
    forwards: list[list[float]] = [[] for _ in layers]
    backwards: list[list[float]] = [[] for _ in layers]
    for _ in range(repeats + 1):
        outs = []
        for layer, x, fw in zip(layers, inputs, forwards, strict=True):
            start = clock()
            outs.append(layer(partition._leaf(x)))
            sync()
            fw.append(clock() - start)
        for out, bw in zip(reversed(outs), reversed(backwards), strict=True):
            start = clock()
            partition._backward_ones(out)
            sync()
            bw.append(clock() - start)
    return _medians(forwards, backwards)


def _medians(forwards: list[list[float]], backwards: list[list[float]]) -> Passes:
    return [
        (statistics.median(f[1:]), statistics.median(b[1:]))
        for f, b in zip(forwards, backwards, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("width", "blocks", "rows", "context"):
        parser.add_argument(name, type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    heads = 6 if args.width % 6 == 0 else 4
    layers = [GPTBlock(args.width, heads) for _ in range(args.blocks)]
    sample = torch.randn(args.rows, args.context, args.width)
    ways: dict[str, Callable[..., Passes]] = {
        "back to back": back_to_back,
        "stage order": stage_order,
    }
    sums: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(6):  # in turn, so a slower minute lands on both
        for name, way in ways.items():
            passes = way(layers, sample)
            sums[name].append((1e3 * sum(f for f, _ in passes), 1e3 * sum(b for _, b in passes)))
    for name, values in sums.items():
        print(
            f"{name}: forwards {[round(f, 2) for f, _ in values]} ms, "
            f"backwards {[round(b, 2) for _, b in values]} ms"
        )
    (old_f, old_b), (new_f, new_b) = (
        (statistics.median(f for f, _ in v), statistics.median(b for _, b in v))
        for v in sums.values()
    )
    print(
        f"stage order over back to back: forward {new_f / old_f:.3f}, backward {new_b / old_b:.3f}"
    )


if __name__ == "__main__":
    main()
