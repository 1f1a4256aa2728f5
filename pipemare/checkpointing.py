"""One ordinary Lightning checkpoint for a model whose stages live in different processes.

Each process holds its own stages' weights, optimiser state, pipemare's correction buffers and
random streams; saving gathers them into the whole model's state on rank 0 (or on every rank,
to give each process the whole model back after a run), in the keys a plain module expects.
Loading needs no scattering: every process reads the whole checkpoint and keeps its part.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipemare.pipeline import Pipeline

__all__ = ["gather", "load_pipemare_state", "module_state", "optimizer_state"]


def gather(local: Any, all_ranks: bool) -> list[Any]:
    """Every process's ``local``, on every process or on rank 0 only (elsewhere an empty list)."""
    parts: list[Any] = [None] * dist.get_world_size()
    if all_ranks:
        dist.all_gather_object(parts, local)
        return parts
    rank = dist.get_rank()
    dist.gather_object(local, parts if rank == 0 else None, dst=0)
    return parts if rank == 0 else []


def module_state(
    module: nn.Module, pipe: Pipeline, prefix: str, all_ranks: bool = False
) -> dict[str, Any]:
    """The whole module's state dict, gathered from the stages' processes (CPU tensors).

    Args:
        module: the LightningModule, whose Sequential at ``prefix`` is cut into stages.
        pipe: this process's pipeline.
        prefix: the Sequential's key prefix in the module's state dict, ending in ``.``.
        all_ranks: gather on every rank (else rank 0 only; other ranks get ``{}``).
    """
    local = {}
    for i in pipe.local_stages:
        for key, value in pipe.stage_modules[i].state_dict().items():
            local[prefix + key] = value.detach().cpu()
    if dist.get_rank() == 0:  # what lies outside the Sequential is the same everywhere
        outside = module.state_dict().items()
        local.update({k: v.detach().cpu() for k, v in outside if not k.startswith(prefix)})
    full: dict[str, Any] = {}
    for part in gather(local, all_ranks):
        full.update(part)
    return {k: full[k] for k in module.state_dict()} if full else {}


def optimizer_state(
    optimizer: torch.optim.Optimizer, pipe: Pipeline | None, distributed: bool
) -> dict[str, Any]:
    """The user's optimiser state for the whole model, with pipemare's own under "pipemare".

    Each process's optimiser only ever stepped its own stages' parameters, so the per-parameter
    states of all processes are disjoint and merge into the whole model's.
    """
    state = optimizer.state_dict()
    if pipe is None:
        return state
    extra = {
        "optimizer": pipe.optimizer.state_dict(include_optimizer=False),
        "pipeline": pipe.state_dict(),
    }
    if not distributed:
        return {**state, "pipemare": extra}
    cpu = {
        i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in state["state"].items()
    }
    parts = gather({"state": cpu, "extra": extra}, all_ranks=False)
    if not parts:  # only rank 0 writes checkpoints
        return state
    merged: dict[str, Any] = {"state": {}, "param_groups": state["param_groups"]}
    extra = {
        "optimizer": dict(extra["optimizer"], buffers={}),
        "pipeline": dict(extra["pipeline"], rng={}),
    }
    for part in parts:
        merged["state"].update(part["state"])
        for name, buffers in part["extra"]["optimizer"]["buffers"].items():
            extra["optimizer"]["buffers"].setdefault(name, {}).update(buffers)
        extra["pipeline"]["rng"].update(part["extra"]["pipeline"]["rng"])
    return {**merged, "pipemare": extra}


def load_pipemare_state(pipe: Pipeline, state: dict[str, Any]) -> None:
    """Restore what :func:`optimizer_state` saved under "pipemare" (this process's part)."""
    pipe.optimizer.load_state_dict(state["optimizer"])
    pipe.load_state_dict(state["pipeline"])
