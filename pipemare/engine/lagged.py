"""Each minibatch's results (loss, logged values), from the last stage to every process, lagged.

A step of a non-flushing pipeline ends before its own minibatch reaches the last stage; if
every step waited for it, the pipeline's forward latency would be paid every step. Instead,
step ``t`` reports the results of minibatch ``t - L``, where the lag ``L`` is the smallest
number of steps after which *every* stage has already received, from downstream, work that the
last stage did after finishing that minibatch (:func:`result_lag`, derived from the schedule).
The last stage publishes a minibatch's results the moment its loss is complete, so when a
process takes them they were sent before data it already received: taking them waits for
nothing but the message itself, and no collective runs per step.

Closed form: ``L = 0`` for flushing schedules (every stage finishes its minibatch within the
step) and ``L = ceil((P - 1) / N)`` for the non-flushing ones (stage 0 ends step ``t`` having
run the backward of microbatch ``(t + 1) N - P``).
"""

from __future__ import annotations

import collections
import functools
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipemare.engine.p2p import SendsInFlight
from pipemare.engine.watchdog import Watchdog, posting
from pipemare.schedule.actions import Op, stream

__all__ = ["DistributedResults", "LocalResults", "Results", "result_lag", "snapshot_lag"]


def _done_by_step_end(
    schedule: str, stages: int, microbatches: int, stage: int, fed: int, op: Op, warmup: int = 0
) -> set[int]:
    """Indices of the ``op`` actions ``stage`` has run when it stops for unfed data."""
    done: set[int] = set()
    for action in stream(schedule, stages, microbatches, stage, warmup=warmup):
        if action.op is Op.FORWARD and action.index >= fed:
            return done
        if action.op is op:
            done.add(action.index)
    raise AssertionError("unreachable: a stream always reaches an unfed forward")


@functools.cache  # pure, and asked for at every training step
def result_lag(schedule: str, stages: int, microbatches: int) -> int:
    """Steps between a minibatch's step and the step at which every process has its results.

    Derived by running each stage's action stream until it stops for want of data: minibatch
    ``k`` is known everywhere at step ``t`` once every stage has run the backward of ``k``'s last
    microbatch, which the last stage runs right after publishing ``k``'s results.

    Example:
        >>> result_lag("gpipe", 4, 2), result_lag("pipemare", 4, 2), result_lag("async", 8, 1)
        (0, 2, 7)
    """
    return _steady_lag(schedule, stages, microbatches, Op.BACKWARD)


@functools.cache
def snapshot_lag(schedule: str, stages: int, microbatches: int) -> int:
    """Steps after step ``t`` at whose end every stage has applied minibatch ``t``'s update.

    A :class:`~pipemare.engine.snapshot.Snapshot` of minibatch ``t`` is complete in every process by
    the end of step ``t + snapshot_lag``: derived, like :func:`result_lag`, by running each
    stage's action stream in steady state (a filling pipeline, after a start, a drain or T3's
    warm-up, is never later).

    Example:
        >>> snapshot_lag("1f1b", 4, 2), snapshot_lag("pipemare", 4, 2), snapshot_lag("async", 8, 1)
        (0, 2, 7)
    """
    return _steady_lag(schedule, stages, microbatches, Op.UPDATE)


def _steady_lag(schedule: str, stages: int, microbatches: int, op: Op) -> int:
    """Steps after step ``t`` until every stage has run minibatch ``t``'s last ``op`` (the
    backward of its last microbatch, or its update), in steady state."""
    n = microbatches
    t = stages + 2  # a step well past the fill, in steady state
    last = (lambda k: (k + 1) * n - 1) if op is Op.BACKWARD else (lambda k: k)
    lag = 0
    for stage in range(stages):
        done = _done_by_step_end(schedule, stages, n, stage, (t + 1) * n, op)
        finished = max((k for k in range(t + 1) if last(k) in done), default=-1)
        lag = max(lag, t - finished)
    return lag


class Results:
    """Minibatch results, published where the last stage runs and taken in order everywhere."""

    def __init__(self, start: int = 0) -> None:
        self.start = start  # the first minibatch published
        self.next = start  # the next minibatch to take

    def publish(self, minibatch: int, value: Any) -> None:
        raise NotImplementedError

    def _receive(self, minibatch: int) -> Any:
        raise NotImplementedError

    def take_through(self, minibatch: int) -> list[Any]:
        """The results of every minibatch not taken yet, up to and including ``minibatch``."""
        out = []
        while self.next <= minibatch:
            out.append(self._receive(self.next))
            self.next += 1
        return out


class LocalResults(Results):
    """Every stage in this process: results wait in a dictionary."""

    def __init__(self, start: int = 0) -> None:
        super().__init__(start)
        self._held: dict[int, Any] = {}

    def publish(self, minibatch: int, value: Any) -> None:
        self._held[minibatch] = value

    def _receive(self, minibatch: int) -> Any:
        return self._held.pop(minibatch)


_CAPACITY = 16384  # bytes of the message that is always posted; longer results send the rest
_HEAD = 16  # minibatch index and length, two int64 at the start of the message


class DistributedResults(Results):
    """One stage per process: the last stage's process sends, every other process receives.

    Results travel pickled in a gloo group of their own (CPU tensors, also under NCCL). The
    first ``_CAPACITY`` bytes go in a message whose receive is posted two minibatches ahead,
    so it arrives while the receiver computes; anything longer follows in a second group.

    With ``D`` copies of the pipeline each copy's last stage publishes to its own copy's
    processes; before that the last stages of all copies combine their values with ``merge``
    (in ``merge_group``), so every process of every copy sees the same results.

    Args:
        source: rank of the process running the last stage.
        start: the first minibatch this run publishes (after a resume, later than 0).
        ranks: the processes that receive (default: all); must include ``source``.
        merge_group: the gloo group of every copy's last-stage process (None: one copy).
        merge: combines the values of all copies, in copy order, into one.
        lag: the steps by which results are taken after they are published
            (:func:`result_lag`): the source keeps that many messages, and a few more, in
            flight to each receiver before it waits for the oldest to be delivered.
    """

    def __init__(
        self,
        source: int,
        start: int = 0,
        depth: int = 2,
        watchdog: Watchdog | None = None,
        ranks: Sequence[int] | None = None,
        merge_group: Any = None,
        merge: Callable[[list[Any]], Any] | None = None,
        lag: int = 0,
    ) -> None:
        super().__init__(start)
        self.watchdog = watchdog
        self.source, self.rank = source, dist.get_rank()
        self._groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
        everyone = range(dist.get_world_size()) if ranks is None else ranks
        self._peers = [r for r in everyone if r != source]
        self._merge_group, self._merge = merge_group, merge
        # a receive is posted when the result `depth` before it is taken, `lag` steps late
        self._sent = {p: SendsInFlight(p, lag + depth + 2, watchdog) for p in self._peers}
        self._posted: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._own: dict[int, Any] = {}  # the source's own results
        if self.rank != source:
            for _ in range(depth):
                self._post()

    def _post(self) -> None:
        buf = torch.empty(_CAPACITY, dtype=torch.uint8)
        with posting(self.watchdog, self.source, "posting a receive for its next results"):
            self._posted.append((dist.irecv(buf, src=self.source, group=self._groups[0]), buf))

    def publish(self, minibatch: int, value: Any) -> None:
        if self._merge_group is not None:
            parts: list[Any] = [None] * dist.get_world_size(self._merge_group)
            dist.all_gather_object(parts, value, group=self._merge_group)
            value = self._merge(parts) if self._merge is not None else parts[0]
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        message = torch.zeros(_CAPACITY, dtype=torch.uint8)
        message[:_HEAD].view(torch.int64)[:] = torch.tensor([minibatch, len(data)])
        first = data[: _CAPACITY - _HEAD]
        message[_HEAD : _HEAD + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        rest = data[_CAPACITY - _HEAD :]
        tail = torch.frombuffer(bytearray(rest), dtype=torch.uint8) if rest else None
        what = f"the results of minibatch {minibatch}"
        for peer in self._peers:
            with posting(self.watchdog, peer, f"sending {what}"):
                sends = [(dist.isend(message, dst=peer, group=self._groups[0]), message)]
                if tail is not None:
                    sends.append((dist.isend(tail, dst=peer, group=self._groups[1]), tail))
            self._sent[peer].add(sends, what)
        self._own[minibatch] = value

    def _receive(self, minibatch: int) -> Any:
        if self.rank == self.source:
            return self._own.pop(minibatch)
        work, buf = self._posted.popleft()
        self._wait(work, minibatch)
        self._post()
        got, length = buf[:_HEAD].view(torch.int64).tolist()
        if got != minibatch:
            raise RuntimeError(
                f"rank {self.rank} expected the results of minibatch {minibatch} from the last "
                f"stage but got minibatch {got}: the processes ran different step counts"
            )
        data = bytes(buf[_HEAD : _HEAD + min(length, _CAPACITY - _HEAD)].numpy())
        if length > _CAPACITY - _HEAD:
            tail = torch.empty(length - (_CAPACITY - _HEAD), dtype=torch.uint8)
            with posting(
                self.watchdog, self.source, f"posting a receive for minibatch {minibatch}"
            ):
                work = dist.irecv(tail, src=self.source, group=self._groups[1])
            self._wait(work, minibatch)
            data += bytes(tail.numpy())
        return pickle.loads(data)

    def _wait(self, work: Any, minibatch: int) -> None:
        if self.watchdog is None:
            work.wait()
        else:
            self.watchdog.wait(work, self.source, f"results of minibatch {minibatch}")

    def flush(self) -> None:
        """Wait until every published result has been delivered."""
        for sent in self._sent.values():
            sent.wait_all()
