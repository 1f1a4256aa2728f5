"""Point-to-point messages between two ranks: receives posted ahead of need, sends that mirror
them and are let go once delivered, and receive buffers recycled once the receiver is done
with them."""

from __future__ import annotations

import collections
import time
from typing import Any

import torch
import torch.distributed as dist

from pipemare.engine import wire
from pipemare.engine.errors import out_of_order
from pipemare.engine.link import LinkClock
from pipemare.engine.payload import tensors
from pipemare.engine.watchdog import Watchdog, posting

__all__ = ["Inbox", "Outbox", "SendsInFlight", "channel_groups"]

_SPARE = 2  # receive buffers kept per shape beyond the ``depth`` posted ones


def channel_groups(backend: str) -> tuple[Any, Any, Any]:
    """The three process groups one channel's messages travel in: headers, payloads in the
    shapes the posted receive expects, payloads in new shapes (see :class:`Inbox`). Every rank
    of the job makes them alike."""
    return (
        dist.new_group(backend=backend),
        dist.new_group(backend=backend),
        dist.new_group(backend=backend),
    )


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
        if expected is not None:
            free = self._pool.get(expected)
            slot.buffers = free.pop() if free else wire.buffers(expected, self.device)
        # only the posts: an allocation's error (out of memory) is this process's, not the peer's
        with posting(self.watchdog, self.peer, "posting a receive for its next message"):
            slot.works.append(dist.irecv(slot.header, src=self.peer, group=header_group))
            if expected is not None:
                for t in slot.buffers:
                    if t is not None:
                        slot.works.append(dist.irecv(t, src=self.peer, group=payload_group))
        self._slots.append(slot)

    def take(
        self, src: int, dst: int, channel: str, microbatch: int, post_next: bool = True
    ) -> Any:
        """The next message, which must be ``microbatch``'s; then (``post_next``) a receive is
        posted for a later one in its shapes. Without it the stream's last messages leave no
        receive posted behind them."""
        slot = self._slots.popleft()
        what = f"{channel} of microbatch {microbatch}"
        for work in slot.works:
            self.watchdog.wait(work, self.peer, what)
        header = slot.header.tolist()
        got, signature = header[0], wire.signature(header)
        self.watchdog.heard(self.peer, got, completed=header[-1])
        if got != microbatch:
            raise out_of_order(src, dst, channel, microbatch, got)
        hold = wire.deliver_at(header) - time.time()
        if hold > 0:  # a simulated link has not delivered it yet
            time.sleep(hold)
        buffers = slot.buffers
        if signature != slot.expected:  # the posted tensors got a throwaway; fetch the real ones
            if slot.expected is not None:
                self._recycle(slot.expected, slot.buffers)
            buffers = wire.buffers(signature, self.device)
            with posting(self.watchdog, self.peer, f"posting a receive for the {what}"):
                works: list[Any] = [
                    dist.irecv(t, src=self.peer, group=self.groups[2])
                    for t in buffers
                    if t is not None
                ]
            for work in works:
                self.watchdog.wait(work, self.peer, what)
        if post_next:
            self.post(signature)
        self._lent[microbatch] = (signature, buffers)
        return buffers[0] if header[1] < 0 else tuple(buffers)

    def release(self, microbatch: int) -> None:
        entry = self._lent.pop(microbatch, None)
        if entry is not None and all(t is None or _sole_owner(t) for t in entry[1]):
            self._recycle(entry[0], entry[1])

    def _recycle(self, signature: tuple[int, ...], buffers: list[torch.Tensor | None]) -> None:
        """Keep ``buffers`` for a later receive of ``signature``'s shapes, up to a few per
        shape: each message whose shapes differ from its posted receive's leaves one more
        behind, so with shapes that change (sequences of varying length) an unbounded pool
        would grow by one for every change."""
        free = self._pool.setdefault(signature, [])
        if len(free) < _SPARE:
            free.append(buffers)


class SendsInFlight:
    """The messages sent to one peer and not known to be delivered, oldest first, each with
    the tensors its sends read (which must stay alive until then).

    A message is let go once it is known to be delivered: NCCL reports that by itself
    (``is_completed``), but gloo reports a send complete only after ``wait()``, even long
    after the receiver has the data. So at most ``window`` messages stay in flight: the
    oldest beyond them is waited for, which returns at once when, as in a running pipeline,
    the receiver took it long ago, and otherwise holds the sender back until the receiver
    has caught up to within ``window`` messages (never a wait per step, never a flush).

    Args:
        peer: the receiving rank.
        window: messages kept in flight before the oldest is waited for.
        watchdog: names the peer if a wait outlasts its deadline (None: wait unwatched).
    """

    def __init__(self, peer: int, window: int, watchdog: Watchdog | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.peer, self.window, self.watchdog = peer, window, watchdog
        self._messages: collections.deque[tuple[list[tuple[Any, torch.Tensor]], str]] = (
            collections.deque()
        )

    def add(self, sends: list[tuple[Any, torch.Tensor]], what: str) -> None:
        """One message's ``(work, tensor)`` pairs, described by ``what`` in a timeout's error."""
        self._messages.append((sends, what))
        while self._messages and all(w.is_completed() for w, _ in self._messages[0][0]):
            self._messages.popleft()
        while len(self._messages) > self.window:
            self._wait_oldest()

    def wait_all(self) -> None:
        """Wait until every message has been delivered."""
        while self._messages:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        sends, what = self._messages.popleft()
        for work, _ in sends:
            if self.watchdog is None:
                work.wait()
            else:
                self.watchdog.wait(work, self.peer, f"receipt of {what}")

    def __len__(self) -> int:
        return len(self._messages)


class Outbox:
    """What one stage sends to one neighbour on one channel, mirroring the receiver's posts.

    The receiver posts each receive when it takes the message ``depth`` before (see
    :class:`Inbox`), so a send completes only then; the outbox keeps ``depth + 2`` messages
    in flight (:class:`SendsInFlight`) and waits for older ones only when the receiver has
    fallen more than ``2 depth + 2`` messages behind.

    With ``link`` (a simulated link's clock, :class:`~pipemare.engine.link.LinkClock`) each
    message carries the time its bytes would have crossed that link, and the receiver holds it
    until then; the send itself is not delayed.
    """

    def __init__(
        self,
        peer: int,
        groups: tuple[Any, Any, Any],
        depth: int,
        watchdog: Watchdog | None = None,
        channel: str = "message",
        link: LinkClock | None = None,
    ) -> None:
        self.peer, self.groups, self.channel, self.link = peer, groups, channel, link
        # the shapes the receiver's posted receive for the next message expects
        self._expected: collections.deque[tuple[int, ...] | None] = collections.deque(
            [None] * depth
        )
        #: the messages sent and not known to be delivered
        self.in_flight = SendsInFlight(peer, depth + 2, watchdog)

    def send(self, microbatch: int, payload: Any, device: torch.device, completed: int = 0) -> None:
        """Post the message's sends; its tensors are kept until it is delivered."""
        header_group, payload_group, extra_group = self.groups
        parts = [t.detach().contiguous() for t in tensors(payload) if t is not None]
        deliver = 0.0
        if self.link is not None:
            deliver = self.link.deliver_at(sum(t.numel() * t.element_size() for t in parts))
        header = wire.encode(microbatch, payload, completed, deliver)
        signature = wire.signature(header)
        expected = self._expected.popleft()
        self._expected.append(signature)
        head = torch.tensor(header, dtype=torch.int64, device=device)
        what = f"the {self.channel} of microbatch {microbatch}"
        # the posted receive expected other shapes: it gets throwaway tensors of those first
        filler = [] if signature == expected or expected is None else wire.buffers(expected, device)
        group = payload_group if signature == expected else extra_group
        with posting(self.in_flight.watchdog, self.peer, f"sending {what}"):  # the posts only
            out = [(dist.isend(head, dst=self.peer, group=header_group), head)]
            out += [
                (dist.isend(t, dst=self.peer, group=payload_group), t)
                for t in filler
                if t is not None
            ]
            out += [(dist.isend(t, dst=self.peer, group=group), t) for t in parts]
        self.in_flight.add(out, what)
