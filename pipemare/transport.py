"""How stages exchange activations and gradients: in one process, or over torch.distributed.

Two channels connect neighbouring stages: ``ACT`` carries activations from stage ``i`` to
``i+1``, ``GRAD`` carries gradients from ``i+1`` to ``i``. Each channel is first-in first-out,
and every message carries its microbatch index, which the receiver checks.
"""

from __future__ import annotations

import abc
import collections
import datetime
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipemare.stage import tensors

__all__ = ["ACT", "GRAD", "DistributedTransport", "InProcessTransport", "Transport"]

ACT, GRAD = "act", "grad"


class Transport(abc.ABC):
    """Moves payloads (a tensor, or a tuple of tensors whose entries may be None) between stages."""

    #: how many stages the pipeline has
    num_stages: int
    #: stages that run in this process
    local_stages: tuple[int, ...]

    @abc.abstractmethod
    def send(self, src: int, dst: int, channel: str, microbatch: int, payload: Any) -> None:
        """Hand ``payload`` to stage ``dst`` without waiting for it to be received."""

    @abc.abstractmethod
    def ready(self, src: int, dst: int, channel: str) -> bool:
        """Whether :meth:`recv` would return at once (a blocking transport answers True)."""

    @abc.abstractmethod
    def recv(self, src: int, dst: int, channel: str, microbatch: int) -> Any:
        """The next payload from ``src`` on ``channel``, which must belong to ``microbatch``."""

    def flush(self) -> None:  # noqa: B027 - transports that deliver at once have nothing to wait for
        """Wait until everything sent has been delivered."""


def _mismatch(src: int, dst: int, channel: str, want: int, got: int) -> RuntimeError:
    return RuntimeError(
        f"stage {dst} expected {channel} of microbatch {want} from stage {src} but got "
        f"microbatch {got}: the stages run different schedules or step counts"
    )


class InProcessTransport(Transport):
    """Every stage in this process; payloads are passed by reference (no copy)."""

    def __init__(self, stages: int, device: torch.device | str | None = None) -> None:
        self.num_stages = stages
        self.local_stages = tuple(range(stages))
        self.device = torch.device(device) if device is not None else None
        self._queues: dict[tuple[int, int, str], collections.deque[tuple[int, Any]]] = (
            collections.defaultdict(collections.deque)
        )

    def send(self, src: int, dst: int, channel: str, microbatch: int, payload: Any) -> None:
        self._queues[src, dst, channel].append((microbatch, payload))

    def ready(self, src: int, dst: int, channel: str) -> bool:
        return bool(self._queues[src, dst, channel])

    def recv(self, src: int, dst: int, channel: str, microbatch: int) -> Any:
        got, payload = self._queues[src, dst, channel].popleft()
        if got != microbatch:
            raise _mismatch(src, dst, channel, microbatch, got)
        if self.device is not None:
            if isinstance(payload, torch.Tensor):
                return payload.to(self.device)
            payload = tuple(None if t is None else t.to(self.device) for t in payload)
        return payload

    def pending(self) -> int:
        """Messages sent and not yet received (zero once a pipeline has drained)."""
        return sum(len(q) for q in self._queues.values())


# Header: [microbatch, count (-1: one bare tensor), then per tensor: dtype code (-1 = None),
# ndim, dims...].
_HEADER = 128
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


def _encode(microbatch: int, payload: Any) -> list[int]:
    bare = isinstance(payload, torch.Tensor)
    items = tensors(payload)
    header = [microbatch, -1 if bare else len(items)]
    for t in items:
        if t is None:
            header += [-1, 0]
            continue
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send tensors of dtype {t.dtype} between stages")
        header += [_CODE[t.dtype], t.dim(), *t.shape]
    if len(header) > _HEADER:
        raise ValueError(
            f"a stage output of {len(items)} tensors with these shapes needs a "
            f"{len(header)}-entry header, more than {_HEADER}; return fewer or flatter tensors"
        )
    return header + [0] * (_HEADER - len(header))


def _decode(
    header: list[int],
) -> tuple[int, bool, list[tuple[torch.dtype, tuple[int, ...]] | None]]:
    microbatch, count, pos = header[0], header[1], 2
    specs: list[tuple[torch.dtype, tuple[int, ...]] | None] = []
    for _ in range(1 if count < 0 else count):
        code, ndim = header[pos], header[pos + 1]
        pos += 2
        if code < 0:
            specs.append(None)
            continue
        specs.append((_DTYPES[code], tuple(header[pos : pos + ndim])))
        pos += ndim
    return microbatch, count < 0, specs


def init_process_group(backend: str) -> None:
    """Initialise the default process group from the launcher's environment, if not done yet."""
    if dist.is_initialized():
        return
    missing = [
        k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"torch.distributed is not initialised and {', '.join(missing)} are not set; start "
            "one process per stage with a launcher (torchrun --nproc-per-node=P, Lightning, "
            "SLURM) or run all stages in one process with transport='inprocess'"
        )
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))


class DistributedTransport(Transport):
    """One stage per process over torch.distributed point-to-point messages.

    The backend follows the device: NCCL for CUDA, gloo otherwise. Activations and
    gradients travel in two separate process groups, so each communicator carries traffic
    in one direction only and every send meets its receive in order, which NCCL needs (its
    point-to-point calls between a pair of ranks share one stream) and gloo tolerates.

    Args:
        stages: number of stages; must equal the world size (the default).
        device: this process's device; CUDA selects NCCL.
        stage_of_rank: which stage each rank runs (default: rank ``r`` runs stage ``r``).
    """

    def __init__(
        self,
        stages: int | None = None,
        device: torch.device | str = "cpu",
        stage_of_rank: Sequence[int] | None = None,
    ) -> None:
        self.device = torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        init_process_group(backend)
        world, rank = dist.get_world_size(), dist.get_rank()
        stages = world if stages is None else stages
        if world != stages:
            raise ValueError(
                f"the world size is {world} but the pipeline has {stages} stages; run one "
                f"process per stage (e.g. torchrun --nproc-per-node={stages}) or set "
                f"stages={world}"
            )
        order = list(stage_of_rank) if stage_of_rank is not None else list(range(world))
        if sorted(order) != list(range(stages)):
            raise ValueError(f"stage_of_rank {order} must be a permutation of 0..{stages - 1}")
        self.num_stages = stages
        self._rank_of = {stage: r for r, stage in enumerate(order)}
        self.local_stages = (order[rank],)
        self._groups = {ACT: dist.new_group(backend=backend), GRAD: dist.new_group(backend=backend)}
        #: a group of its own for collectives the pipeline needs (gradient norms)
        self.collective_group = dist.new_group(backend=backend)
        self._sent: list[tuple[Any, torch.Tensor]] = []  # (work, tensor kept alive until sent)

    def rank_of(self, stage: int) -> int:
        return self._rank_of[stage]

    def send(self, src: int, dst: int, channel: str, microbatch: int, payload: Any) -> None:
        group, peer = self._groups[channel], self._rank_of[dst]
        header = torch.tensor(_encode(microbatch, payload), dtype=torch.int64, device=self.device)
        parts = [header] + [t.detach().contiguous() for t in tensors(payload) if t is not None]
        for t in parts:
            self._sent.append((dist.isend(t, dst=peer, group=group), t))
        self._sent = [(w, t) for w, t in self._sent if not w.is_completed()]

    def ready(self, src: int, dst: int, channel: str) -> bool:
        return True

    def recv(self, src: int, dst: int, channel: str, microbatch: int) -> Any:
        group, peer = self._groups[channel], self._rank_of[src]
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src=peer, group=group)
        got, bare, specs = _decode(header.tolist())
        if got != microbatch:
            raise _mismatch(src, dst, channel, microbatch, got)
        out: list[torch.Tensor | None] = []
        works: list[Any] = []
        for s in specs:
            if s is None:
                out.append(None)
                continue
            t = torch.empty(s[1], dtype=s[0], device=self.device)
            works.append(dist.irecv(t, src=peer, group=group))
            out.append(t)
        for w in works:
            w.wait()
        return out[0] if bare else tuple(out)

    def flush(self) -> None:
        for work, _ in self._sent:
            work.wait()
        self._sent.clear()
