"""Data parallelism across copies of the pipeline: the replicas of a stage average gradients.

With ``D`` copies of a ``P``-stage pipeline (:class:`~pipemare.engine.layout.RankLayout`), each copy
trains on its own ``1/D`` of every batch. Before each update a stage's ``D`` replicas replace
their accumulated gradients by the mean over the replicas, so every replica applies the same
update to the same weights: the update of one pipeline fed the whole batch, when the loss is
a mean over the batch's samples. The schedule, the delays and every correction (T1, T2, T3,
clipping by the global norm) then act identically on every replica, because each sees the
same gradients and weights.

The mean is bucketed (gradients flattened into buckets of at most ``bucket_bytes``, one
all-reduce each) and asynchronous: it starts right after the stage's last backward pass of a
minibatch has sent its input gradient upstream, and is waited for when the stage reaches that
minibatch's update. In pipemare's schedules the update follows that backward directly, so the
all-reduce overlaps with the gradient's send and with its own buckets, not with other compute.

Weights and buffers start equal on every replica: :func:`broadcast_state` copies replica 0's
at build time (as DDP does), and again for buffers before evaluation, so the replicas evaluate
the model a checkpoint holds (each replica's BatchNorm statistics otherwise follow its own data).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradientAverager", "broadcast_state"]

#: default bucket size (DDP's default, 25 MiB)
BUCKET_BYTES = 25 * 2**20


def _buckets(grads: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, at most ``limit`` bytes per bucket
    (a larger gradient gets a bucket of its own)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = out[-1] if out else None
        if (
            last is None
            or size + nbytes > limit
            or (last[0].dtype, last[0].device) != (g.dtype, g.device)
        ):
            out.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return out


class GradientAverager:
    """Averages one stage's gradients over its replicas, bucketed and asynchronous.

    Args:
        group: the process group of the stage's ``replicas`` processes.
        replicas: D.
        bucket_bytes: the largest flattened bucket.
        wait: ``(work, what)`` -> waits for a collective (default ``work.wait()``); the
            strategy passes its watchdog so a failed replica is named, not waited on forever.

    Every replica must produce gradients for the same parameters (as DDP without
    ``find_unused_parameters``); a parameter whose gradient is None on one replica and not on
    another makes the buckets differ, which :meth:`finish` reports.
    """

    def __init__(
        self,
        group: Any,
        replicas: int,
        bucket_bytes: int = BUCKET_BYTES,
        wait: Any = None,
    ) -> None:
        if replicas < 2:
            raise ValueError(f"averaging needs at least 2 replicas, got {replicas}")
        self.group, self.replicas, self.bucket_bytes = group, replicas, bucket_bytes
        self._wait = wait
        self._pending: dict[
            tuple[int, int], list[tuple[Any, torch.Tensor, list[torch.Tensor]]]
        ] = {}

    def start(self, stage: int, update: int, params: Sequence[nn.Parameter]) -> None:
        """Begin averaging the gradients ``update`` will apply (they must be complete)."""
        grads = [p.grad for p in params if p.grad is not None]
        entries = []
        for bucket in _buckets(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            entries.append((work, flat, bucket))
        self._pending[stage, update] = entries

    def finish(self, stage: int, update: int) -> None:
        """Wait for :meth:`start`'s all-reduces and write the means into the gradients."""
        entries = self._pending.pop((stage, update), None)
        if entries is None:
            return
        for work, flat, bucket in entries:
            what = f"the gradient average of stage {stage}'s replicas for step {update + 1}"
            if self._wait is None:
                work.wait()
            else:
                self._wait(work, what)
            flat.div_(self.replicas)
            offset = 0
            for g in bucket:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n


@torch.no_grad()
def broadcast_state(module: nn.Module, group: Any, src: int, parameters: bool = True) -> None:
    """Copy replica 0's buffers (and parameters) of ``module`` to every replica in ``group``.

    Args:
        module: a stage's layers on this process.
        group: the stage's replica group.
        src: the global rank of replica 0's process of the stage.
        parameters: include the parameters (at build time), else buffers only.
    """
    tensors = list(module.buffers())
    if parameters:
        tensors = list(module.parameters()) + tensors
    for t in tensors:
        dist.broadcast(t.data if isinstance(t, nn.Parameter) else t, src=src, group=group)
