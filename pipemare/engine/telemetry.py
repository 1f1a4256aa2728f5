"""What the engine records for monitoring: action timings, weight versions, gradient norms,
weight discrepancy and non-finite outputs. Core code: callbacks read it and decide what to log.

A pipeline has no probe unless a monitor attaches one (``pipeline.probe = Probe(...)``), so an
unmonitored run pays one ``None`` check per action. Timestamps are this process's monotonic
clock shifted to the epoch, so traces from several processes on one machine line up.
"""

from __future__ import annotations

import array
import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from pipemare.engine.link import Links

__all__ = ["DiscrepancySample", "Probe", "Span", "replay_timeline", "summarize_spans"]

# (stage, name, index, start, end): name is "F", "B", "U", "recv" or "send"
Span = tuple[int, str, int, float, float]
_NAMES = ("F", "B", "U", "recv", "send")
_KINDS = {name: i for i, name in enumerate(_NAMES)}
_NONE_BAD = torch.iinfo(torch.int64).max  # no non-finite output seen (see Probe.forward)


@dataclasses.dataclass(frozen=True)
class DiscrepancySample:
    """Relative distance between the weights a microbatch's forward and backward used.

    ``corrected`` is between what the two passes actually used (the forward's live or predicted
    weights; the backward's T2 estimate, stashed version or live weights); ``uncorrected`` is
    between the live weights at the forward and at the backward, what no correction would give.
    """

    stage: int
    microbatch: int
    delay: int
    corrected: float
    uncorrected: float


class Probe:
    """Collects telemetry from the executor and the stages of this process.

    Args:
        timeline: record the span of every action, receive and send.
        delays: record the weight versions each microbatch's passes used.
        grad_norm_every: compute each stage's gradient norm at the updates of every n-th
            minibatch (0: never).
        discrepancy_every: every n-th minibatch, copy each stage's weights at the forward of
            its first microbatch and compare them at its backward (0: never).
        max_spans: record at most this many spans (later ones are not recorded).
    """

    def __init__(
        self,
        timeline: bool = False,
        delays: bool = False,
        grad_norm_every: int = 0,
        discrepancy_every: int = 0,
        max_spans: int = 200_000,
    ) -> None:
        self.timeline, self.record_delays = timeline, delays
        self.grad_norm_every, self.discrepancy_every = grad_norm_every, discrepancy_every
        self.max_spans = max_spans
        # Spans and delays are kept in flat typed arrays: no Python object per event, so a long
        # logging window does not slow the garbage collector down.
        self._span_ints = array.array("q")  # stage, kind, index per span
        self._span_times = array.array("d")  # start, end per span
        self._delays = array.array("q")  # stage, microbatch, τ_fwd, τ_bkwd per backward
        self.grad_norms: dict[tuple[int, int], float] = {}  # (stage, minibatch) -> L2 norm
        self.discrepancy: list[DiscrepancySample] = []
        # (stage, microbatch) -> (weights the forward ran with, live weights at the forward)
        self._snapshots: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        # Per stage, on its device, the first microbatch whose forward output summed to NaN or
        # Inf (_NONE_BAD: none yet): kept up to date by a few kernels per minibatch, with no
        # synchronisation and one scalar per stage however long nobody reads it.
        self._bad_since: dict[int, torch.Tensor] = {}
        self._first_bad: dict[int, int] = {}
        self._offset = time.time() - time.perf_counter()
        self.microbatches = 1

    def now(self) -> float:
        return time.perf_counter() + self._offset

    def record(self, stage: int, name: str, index: int, start: float) -> None:
        """A span from ``start`` (:meth:`now`) until now, if the timeline is on."""
        if self.timeline and len(self._span_times) < 2 * self.max_spans:
            self._span_ints.extend((stage, _KINDS[name], index))
            self._span_times.extend((start, self.now()))

    # -- events from the executor ------------------------------------------------------------

    def _sampled(self, microbatch: int) -> bool:
        n = self.discrepancy_every
        return n > 0 and microbatch >= 0 and microbatch % (n * self.microbatches) == 0

    @torch.no_grad()
    def forward(self, stage: Any, microbatch: int, output: Any) -> None:
        """After ``stage`` ran the forward of ``microbatch``."""
        if self._sampled(microbatch):
            plain = [p.detach().clone() for p in stage.module.parameters()]
            # what the forward ran with: the live weights, or weight prediction's
            used = stage.predicted_weights(microbatch) or plain
            self._snapshots[stage.index, microbatch] = (used, plain)
        # Only the first microbatch of a minibatch: enough to tell the step and the stage where
        # outputs first went non-finite (an earlier stage's forward of that microbatch runs
        # before any update could bring NaN back to it).
        if (
            microbatch >= 0
            and microbatch % self.microbatches == 0
            and stage.index not in self._first_bad
        ):
            total = _sum(output)
            if total is not None:
                bad = torch.where(torch.isfinite(total), _NONE_BAD, microbatch)
                seen = self._bad_since.get(stage.index)
                self._bad_since[stage.index] = bad if seen is None else torch.minimum(seen, bad)

    @torch.no_grad()
    def backward(self, stage: Any, microbatch: int, fwd_version: int) -> None:
        """Right before ``stage``'s backward of ``microbatch``, forwarded at ``fwd_version``."""
        if self.record_delays:
            k = microbatch // self.microbatches
            bkwd = fwd_version if stage.stashes else stage.version
            self._delays.extend((stage.index, microbatch, k - fwd_version, k - bkwd))
        snapshots = self._snapshots.pop((stage.index, microbatch), None)
        if snapshots is None:
            return
        snapshot, plain = snapshots
        params = list(stage.module.parameters())
        if not params:
            return
        live = [p.detach() for p in params]
        used = [stage.weight_at(p, fwd_version) for p in params]
        scale = _norm(live) or 1.0
        self.discrepancy.append(
            DiscrepancySample(
                stage.index,
                microbatch,
                stage.version - fwd_version,
                _distance(snapshot, used) / scale,
                _distance(plain, live) / scale,
            )
        )

    def grad_norm_due(self, minibatch: int) -> bool:
        return self.grad_norm_every > 0 and minibatch % self.grad_norm_every == 0

    @torch.no_grad()
    def update(self, stage: int, minibatch: int, params: Iterable[nn.Parameter]) -> None:
        """Right before ``stage``'s update of ``minibatch`` (gradients complete, unclipped)."""
        if self.grad_norm_due(minibatch):
            self.grad_norms[stage, minibatch] = _norm(
                [p.grad for p in params if p.grad is not None]
            )

    # -- reading -----------------------------------------------------------------------------

    def first_nonfinite(self) -> dict[int, int]:
        """Per stage, the first microbatch whose forward output held NaN or Inf (if any did).

        Where divergence started: the earliest such microbatch, and the lowest stage that had a
        non-finite output for it (later microbatches see the damage spread to other stages).
        Reading synchronises with each stage's device once; monitors call it at their logging
        interval.
        """
        for stage, bad in self._bad_since.items():
            first = int(bad)
            if first != _NONE_BAD and stage not in self._first_bad:
                self._first_bad[stage] = first
        return dict(self._first_bad)

    def take_spans(self) -> list[Span]:
        """The spans recorded since the last call (and forget them)."""
        ints, times = self._span_ints, self._span_times
        spans = [
            (
                ints[j],
                _NAMES[ints[j + 1]],
                ints[j + 2],
                times[2 * (j // 3)],
                times[2 * (j // 3) + 1],
            )
            for j in range(0, len(ints), 3)
        ]
        self._span_ints, self._span_times = array.array("q"), array.array("d")
        return spans

    def take_delays(self) -> list[tuple[int, int, int, int]]:
        """``(stage, microbatch, τ_fwd, τ_bkwd)`` of every backward since the last call."""
        d = self._delays
        self._delays = array.array("q")
        return [(d[j], d[j + 1], d[j + 2], d[j + 3]) for j in range(0, len(d), 4)]

    def take_grad_norms(self) -> dict[tuple[int, int], float]:
        norms, self.grad_norms = self.grad_norms, {}
        return norms

    def take_discrepancy(self) -> list[DiscrepancySample]:
        samples, self.discrepancy = self.discrepancy, []
        return samples

    def merge(self, **settings: Any) -> None:
        """Switch more recording on (monitors ask for what they need)."""
        self.timeline |= bool(settings.get("timeline", False))
        self.record_delays |= bool(settings.get("delays", False))
        for name in ("grad_norm_every", "discrepancy_every"):
            asked = int(settings.get(name, 0))
            current = getattr(self, name)
            if asked and (not current or asked < current):
                setattr(self, name, asked)


def _sum(value: Any) -> torch.Tensor | None:
    """The sum of a payload's floating-point tensors (NaN/Inf if any element was), in float32+."""
    if isinstance(value, torch.Tensor):
        tensors = [value]
    elif isinstance(value, tuple):
        tensors = [t for t in value if isinstance(t, torch.Tensor)]
    else:
        return None
    sums = [
        t.detach().sum(dtype=torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None)
        for t in tensors
        if t.is_floating_point()
    ]
    if not sums:
        return None
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors))


def _distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return math.sqrt(
        sum(float((x.float() - y.float()).pow(2).sum()) for x, y in zip(a, b, strict=True))
    )


def summarize_spans(spans: Sequence[Span], wall: float) -> dict[int, dict[str, float]]:
    """Per stage: seconds computing, communicating and idle over ``wall`` seconds, and utilisation.

    Compute is the time inside forward, backward and update actions minus the receives and
    sends nested in them; idle is what is left of the wall time.
    """
    stats: dict[int, dict[str, float]] = {}
    for stage, name, _, start, end in spans:
        s = stats.setdefault(stage, {"compute": 0.0, "comm": 0.0})
        if name in ("recv", "send"):
            s["comm"] += end - start
            s["compute"] -= end - start
        else:
            s["compute"] += end - start
    for s in stats.values():
        s["idle"] = max(wall - s["compute"] - s["comm"], 0.0)
        s["utilization"] = s["compute"] / wall if wall > 0 else 0.0
    return stats


def replay_timeline(
    spans: Sequence[Span], num_stages: int, links: Links | None = None
) -> tuple[list[Span], float]:
    """Replay the actions recorded in one process as if every stage had a device of its own.

    Each stage runs its actions in the recorded order, each taking its measured compute time; a
    forward waits for the previous stage's forward of the same microbatch, a backward for the
    next stage's backward. Without ``links`` communication is free; with them
    (:class:`~pipemare.engine.link.Links`) the output of a forward or backward leaves when the
    action ends and arrives when its link delivers it, in series behind that link's earlier
    messages, while the sender computes on; each action also pays its messages' own CPU on
    both sides (:meth:`~pipemare.engine.link.Links.cpu_s`). This is how the simulator
    estimates a real pipeline's utilisation from one process.

    Returns:
        The replayed spans and the makespan. Receives and sends (in one process they are queue
        operations) appear as zero-length marks at the start and end of their action.
    """
    # A receive or send is recorded when it ends, before the action that contains it.
    comm = [0.0] * num_stages
    marks: list[list[tuple[str, int]]] = [[] for _ in range(num_stages)]
    actions: list[tuple[int, str, int, float, list[tuple[str, int]]]] = []
    for stage, name, index, start, end in spans:
        if name in ("recv", "send"):
            comm[stage] += end - start
            marks[stage].append((name, index))
            continue
        actions.append((stage, name, index, end - start - comm[stage], marks[stage]))
        comm[stage], marks[stage] = 0.0, []
    ready: dict[tuple[str, int, int], float] = {}  # (action, microbatch, receiving stage)
    free = [0.0] * num_stages
    out: list[Span] = []
    last = num_stages - 1
    for stage, name, index, dur, comms in actions:
        start = free[stage]
        if name == "F" and stage > 0:
            start = max(start, ready.get(("F", index, stage), 0.0))
        if name == "B" and stage < last:
            start = max(start, ready.get(("B", index, stage), 0.0))
        end = start + max(dur, 0.0) + (links.cpu_s(stage, name) if links is not None else 0.0)
        if name == "F" and stage < last:
            sent = end if links is None else links.arrival(stage, True, end)
            ready[("F", index, stage + 1)] = sent
        if name == "B" and stage > 0:
            sent = end if links is None else links.arrival(stage - 1, False, end)
            ready[("B", index, stage - 1)] = sent
        free[stage] = end
        out.extend((stage, c, i, start, start) for c, i in comms if c == "recv")
        out.append((stage, name, index, start, end))
        out.extend((stage, c, i, end, end) for c, i in comms if c == "send")
    return out, max(free) if out else 0.0
