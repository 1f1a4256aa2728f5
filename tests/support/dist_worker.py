"""Worker for test_distributed: one stage per process, launched by torchrun.

Also imported by the test for the shared model and data, so both sides build them alike.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipemare import Pipeline, PipeMareConfig

STEPS = 20


def build_model() -> nn.Sequential:
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Linear(12, 32),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 16),
        nn.Tanh(),
        nn.Linear(16, 4),
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(99)
    # two short batches change the payload shapes mid-stream (and back), which the
    # distributed transport must notice in the receives it posted ahead
    sizes = [10 if step in (7, 8) else 16 for step in range(STEPS)]
    return [
        (torch.randn(n, 12, generator=gen), torch.randint(0, 4, (n,), generator=gen)) for n in sizes
    ]


def train(
    schedule: str, stages: int, transport: Any, device: str = "cpu"
) -> tuple[nn.Sequential, Pipeline, int]:
    """Train the shared model; ``transport``: ``"inprocess"``, ``"distributed"`` or a
    transport object."""
    model = build_model()
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        model.to(f"cuda:{local}")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = PipeMareConfig.t1_t2(reschedule_steps=10) if schedule == "pipemare" else None
    clip = {"clip_grad_norm": 0.5} if schedule == "pipemare" else {}
    pipe = Pipeline(
        model,
        opt,
        nn.functional.cross_entropy,
        stages=stages,
        microbatches=2,
        schedule=schedule,
        config=cfg,
        transport=transport,
        seed=7,
        **clip,
    )
    most = 0  # the most sends in flight (not known delivered) after a step
    for batch in batches():
        pipe.step(batch)
        if transport != "inprocess":
            most = max(most, pipe.transport.in_flight())
    pipe.drain()
    return model, pipe, most


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schedules", nargs="+", default=["async", "pipemare"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for schedule in args.schedules:
        _, pipe, most = train(schedule, world, "distributed", args.device)
        (stage,) = pipe.stages
        state = {k: v.detach().cpu().clone() for k, v in stage.module.state_dict().items()}
        sent = {"most": most, "after_drain": pipe.transport.in_flight()}
        saved = {"stage": stage.index, "state": state, "in_flight": sent}
        torch.save(saved, args.out / f"{schedule}-rank{rank}.pt")


if __name__ == "__main__":
    main()
