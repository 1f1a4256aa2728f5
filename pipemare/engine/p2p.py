"""Point-to-point messages between two ranks: receives posted ahead of need, sends that mirror
them, and receive buffers recycled once the receiver is done with them."""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist

from pipemare.engine import wire
from pipemare.engine.errors import out_of_order
from pipemare.engine.payload import tensors
from pipemare.engine.watchdog import Watchdog

__all__ = ["Inbox", "Outbox"]


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether nothing but ``t`` refers to its storage (no view, leaf or pending send)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # pragma: no cover - a torch without the query never recycles
        return False
    return bool(count(t.untyped_storage()._cdata) <= 2)  # t's reference and the query's own


class _Slot:
    """A message posted for ahead of need: its header and, in the expected shapes, its tensors."""

    def __init__(self, expected: tuple[int, ...] | None, header: torch.Tensor) -> None:
        self.expected = expected
        self.header = header
        self.buffers: list[torch.Tensor | None] = []
        self.works: list[Any] = []


class Inbox:
    """Everything one stage receives from one neighbour on one channel.

    Receives are posted ``depth`` messages ahead, each in the shapes of the message ``depth``
    before it (shapes are learned from the headers, so a steady stream allocates nothing and
    its data can arrive while the receiver computes: gloo moves a message only once its
    receive is posted). The sender knows which shapes each posted receive expects, and when
    a message's shapes differ it first fills the posted receive with a throwaway of the
    expected shapes, then sends the real tensors on a third group that is never posted ahead.
    """

    def __init__(
        self, peer: int, groups: tuple[Any, Any, Any], device: torch.device, watchdog: Watchdog
    ) -> None:
        self.peer, self.groups, self.device, self.watchdog = peer, groups, device, watchdog
        self._slots: collections.deque[_Slot] = collections.deque()
        self._pool: dict[tuple[int, ...], list[list[torch.Tensor | None]]] = {}
        self._lent: dict[int, tuple[tuple[int, ...], list[torch.Tensor | None]]] = {}

    def post(self, expected: tuple[int, ...] | None) -> None:
        header_group, payload_group, _ = self.groups
        slot = _Slot(expected, torch.empty(wire.HEADER, dtype=torch.int64, device=self.device))
        slot.works.append(dist.irecv(slot.header, src=self.peer, group=header_group))
        if expected is not None:
            free = self._pool.get(expected)
            slot.buffers = free.pop() if free else wire.buffers(expected, self.device)
            for t in slot.buffers:
                if t is not None:
                    slot.works.append(dist.irecv(t, src=self.peer, group=payload_group))
        self._slots.append(slot)

    def take(self, src: int, dst: int, channel: str, microbatch: int) -> Any:
        slot = self._slots.popleft()
        what = f"{channel} of microbatch {microbatch}"
        for work in slot.works:
            self.watchdog.wait(work, self.peer, what)
        header = slot.header.tolist()
        got, signature = header[0], tuple(header[1:-1])
        self.watchdog.heard(self.peer, got, completed=header[-1])
        if got != microbatch:
            raise out_of_order(src, dst, channel, microbatch, got)
        buffers = slot.buffers
        if signature != slot.expected:  # the posted tensors got a throwaway; fetch the real ones
            if slot.expected is not None:
                self._pool.setdefault(slot.expected, []).append(slot.buffers)
            buffers = wire.buffers(signature, self.device)
            works: list[Any] = [
                dist.irecv(t, src=self.peer, group=self.groups[2]) for t in buffers if t is not None
            ]
            for work in works:
                self.watchdog.wait(work, self.peer, what)
        self.post(signature)
        self._lent[microbatch] = (signature, buffers)
        return buffers[0] if header[1] < 0 else tuple(buffers)

    def release(self, microbatch: int) -> None:
        entry = self._lent.pop(microbatch, None)
        if entry is not None and all(t is None or _sole_owner(t) for t in entry[1]):
            self._pool.setdefault(entry[0], []).append(entry[1])


class Outbox:
    """What one stage sends to one neighbour on one channel, mirroring the receiver's posts."""

    def __init__(self, peer: int, groups: tuple[Any, Any, Any], depth: int) -> None:
        self.peer, self.groups = peer, groups
        # the shapes the receiver's posted receive for the next message expects
        self._expected: collections.deque[tuple[int, ...] | None] = collections.deque(
            [None] * depth
        )

    def send(
        self, microbatch: int, payload: Any, device: torch.device, completed: int = 0
    ) -> list[Any]:
        """Post the message's sends; returns ``(work, tensor)`` pairs to keep until delivered."""
        header_group, payload_group, extra_group = self.groups
        header = wire.encode(microbatch, payload, completed)
        signature = tuple(header[1:-1])
        expected = self._expected.popleft()
        self._expected.append(signature)
        head = torch.tensor(header, dtype=torch.int64, device=device)
        parts = [t.detach().contiguous() for t in tensors(payload) if t is not None]
        out = [(dist.isend(head, dst=self.peer, group=header_group), head)]
        group = payload_group
        if signature != expected:
            if expected is not None:
                for t in wire.buffers(expected, device):
                    if t is not None:
                        out.append((dist.isend(t, dst=self.peer, group=payload_group), t))
            group = extra_group
        out += [(dist.isend(t, dst=self.peer, group=group), t) for t in parts]
        return out
