"""The cost model: one layout's step time (the schedule's streams replayed through their
dependencies) and memory per stage.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from pipemare.engine.link import Link, Links
from pipemare.engine.telemetry import Span, replay_timeline
from pipemare.model import partition
from pipemare.planner.measurements import LayerProfile, Overhead, Profile
from pipemare.planner.streams import _Streams, _streams
from pipemare.schedule.actions import Op, spec


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run the model on the devices, with its modelled time and memory.

    Attributes:
        schedule: the schedule.
        stages: P, devices per pipeline.
        replicas: D, data-parallel copies of the pipeline (P × D devices).
        microbatches: N, microbatches per minibatch on each replica.
        microbatch_size: samples per microbatch.
        balance: layers per stage.
        step_s: modelled seconds per optimiser step (one minibatch of
            ``replicas × microbatches × microbatch_size`` samples), in steady state.
        stage_s: per stage, its busy seconds per step: N forward and backward passes, the
            update and the gradient all-reduce across replicas.
        memory_bytes: per stage, modelled peak bytes on its device.
    """

    schedule: str
    stages: int
    replicas: int
    microbatches: int
    microbatch_size: int
    balance: tuple[int, ...]
    step_s: float
    stage_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        """The global batch: replicas × microbatches × microbatch size."""
        return self.replicas * self.microbatches * self.microbatch_size

    @property
    def samples_per_s(self) -> float:
        """Modelled throughput: the global batch over the modelled step time."""
        return self.batch_size / self.step_s if self.step_s > 0 else math.inf


class _Costs:
    """Prefix sums over the layers, so a stage's cost and memory take O(1) to model."""

    def __init__(
        self,
        layers: Sequence[LayerProfile],
        input_bytes: int,
        profile: Profile,
        microbatches: int,
        replicas: int,
        bandwidth: float | None,
    ) -> None:
        self.n, self.microbatches = len(layers), microbatches
        # ring all-reduce: each device sends and receives 2(D-1)/D of the gradient bytes
        ring = 2 * (replicas - 1) / replicas
        self.allreduce = ring / bandwidth if bandwidth and replicas > 1 else 0.0
        self.bandwidth = bandwidth
        self.out = [layer.output_bytes for layer in layers]
        self.inputs = [input_bytes, *self.out[:-1]]
        self.keeps_input = [layer.saves_input for layer in layers]
        self.keeps_output = [layer.saves_output for layer in layers]

        def prefix(values: Iterable[float]) -> list[float]:
            sums = [0.0]
            for v in values:
                sums.append(sums[-1] + v)
            return sums

        # per action, [fixed seconds, prefix sums of what each layer adds] on a delayed stage
        # and on the undelayed last one: a stage of k layers pays the fixed part once
        self._delayed = self._marginal(layers, profile.overhead, True)
        self._last = self._marginal(layers, profile.undelayed_overhead or profile.overhead, False)
        self.params = prefix(x.param_bytes for x in layers)
        self.grads = prefix(x.grad_bytes for x in layers)
        self.state = prefix(x.state_bytes for x in layers)
        self.saved = prefix(x.saved_bytes for x in layers)
        # an activation between two layers of one stage lives on if either side saves it
        self.inner = prefix(
            out * (self.keeps_output[i] or self.keeps_input[i + 1])
            for i, out in enumerate(self.out[:-1])
        )

    @staticmethod
    def _marginal(
        layers: Sequence[LayerProfile], overhead: Overhead, delayed: bool
    ) -> list[tuple[float, list[float]]]:
        fixed = (overhead.forward_s, overhead.backward_s, overhead.update_s)
        out = []
        for kind in range(3):
            sums = [0.0]
            for x in layers:
                sums.append(sums[-1] + x.times(delayed)[kind])
            out.append((fixed[kind], sums))
        return out

    def times(self, a: int, b: int) -> tuple[float, float, float]:
        """Forward, backward and update seconds (all-reduce included) of layers ``a..b-1``;
        the last stage's without the delay's work."""
        parts = self._last if b == self.n else self._delayed
        f, bw, u = (fixed + sums[b] - sums[a] for fixed, sums in parts)
        return f, bw, u + self.allreduce * (self.grads[b] - self.grads[a])

    def busy(self, a: int, b: int) -> float:
        f, bw, u = self.times(a, b)
        return self.microbatches * (f + bw) + u

    def link(self, b: int) -> float:
        """Seconds per step the link after layer ``b-1`` carries activations (gradients back)."""
        if b >= self.n or not self.bandwidth:
            return 0.0
        return self.microbatches * self.out[b - 1] / self.bandwidth

    def activation(self, a: int, b: int) -> float:
        """Bytes a stage of layers ``a..b-1`` keeps per microbatch in flight."""
        kept = self.inputs[a] if a > 0 or self.keeps_input[a] else 0
        last = self.out[b - 1] if b < self.n or self.keeps_output[b - 1] else 0
        return kept + self.saved[b] - self.saved[a] + self.inner[b - 1] - self.inner[a] + last

    def memory(self, a: int, b: int, in_flight: int, stashed: int) -> float:
        weights = self.params[b] - self.params[a]
        fixed = (
            weights * (1 + stashed) + self.grads[b] - self.grads[a] + self.state[b] - self.state[a]
        )
        return fixed + in_flight * self.activation(a, b)


def _family(schedule: str) -> tuple[bool, bool, bool]:
    sp = spec(schedule)
    return sp.flushes, sp.stashes, sp.corrected


def _check_schedule(profile: Profile, schedule: str | None) -> str:
    if schedule is None:
        return profile.schedule
    if _family(schedule) != _family(profile.schedule):
        raise ValueError(
            f"the profile was measured under schedule {profile.schedule!r}, whose engine costs "
            f"differ from {schedule!r}'s (corrections, weight stashing); profile again with "
            f"schedule={schedule!r}"
        )
    return schedule


def _replay(
    streams: _Streams,
    durations: Sequence[tuple[float, float, float]],
    links: Links | None,
) -> dict[int, dict[int, float]]:
    """Replay the streams with each stage's durations; per stage, when each update ended.

    Without ``links`` communication is free; with them (:class:`~pipemare.engine.link.Links`)
    a message leaves when its action ends, queues behind its link's earlier messages and
    arrives when the link delivers it; compute and transfers overlap. Either way the replay is
    :func:`pipemare.engine.telemetry.replay_timeline` itself, on synthetic spans.
    """
    names = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.UPDATE: "U"}
    spans: list[Span] = []
    for stage, op, index in streams.order:
        seconds = durations[stage]["FBU".index(names[op])]
        spans.append((stage, names[op], index, 0.0, seconds))
    replayed, _ = replay_timeline(spans, len(durations), links)
    return _update_ends(replayed)


def _update_ends(spans: Iterable[Span]) -> dict[int, dict[int, float]]:
    ends: dict[int, dict[int, float]] = defaultdict(dict)
    for stage, name, index, _, end in spans:
        if name == "U":
            ends[stage][index] = end
    return ends


def _period(ends: dict[int, dict[int, float]], first: int, last: int) -> float:
    """Seconds per minibatch between updates ``first`` and ``last``: the slowest stage's."""
    return max((e[last] - e[first]) / (last - first) for e in ends.values())


def steady_step_time(spans: Sequence[Span], num_stages: int, skip: int = 2) -> float:
    """Seconds per optimiser step of a measured run, as P devices would take it.

    Replays the spans with :func:`pipemare.engine.telemetry.replay_timeline` and measures, on every
    stage, the time between its update of the first recorded minibatch (plus ``skip``, to let
    the replay settle) and its last recorded update; the slowest stage's rate is the step time.
    :func:`evaluate` models the same quantity, so the two compare like with like.

    Raises:
        ValueError: fewer than ``skip + 2`` updates were recorded on some stage.
    """
    replayed, _ = replay_timeline(spans, num_stages)
    ends = _update_ends(replayed)
    common = set.intersection(*(set(e) for e in ends.values())) if ends else set()
    if len(ends) < num_stages or len(common) < skip + 2:
        raise ValueError(
            f"the spans hold {len(common)} updates on every stage; record at least {skip + 2} "
            "steps (attach Probe(timeline=True) for longer)"
        )
    ordered = sorted(common)
    return _period(ends, ordered[skip], ordered[-1])


def replayed_step_time(
    schedule: str,
    durations: Sequence[tuple[float, float, float]],
    microbatches: int,
    links: Sequence[Link] | None = None,
    message_bytes: Sequence[float] | None = None,
) -> float:
    """Seconds per optimiser step P devices take in steady state when every forward, backward
    and update of stage ``i`` takes ``durations[i]`` seconds.

    The schedule's action streams replayed through their dependencies, as :func:`evaluate`
    replays a modelled layout; a pure function of its arguments, so per-action times measured
    once give the same pipeline time every time they are replayed. Communication is free
    unless ``links`` (``links[i]`` joins stages ``i`` and ``i + 1``) and ``message_bytes``
    (what one microbatch carries across each, either way) are given: then each message
    crosses its link as :class:`~pipemare.engine.link.Links` says, overlapped with compute
    wherever the schedule has other work, exposed wherever a stage waits for it.

    Example:
        >>> replayed_step_time("async", [(1.0, 2.0, 0.5)] * 2, microbatches=1)
        3.5
        >>> replayed_step_time("gpipe", [(1.0, 2.0, 0.5)] * 2, microbatches=1)
        6.5
        >>> link = [Link(latency_s=0.1, bandwidth=10.0)]  # 0.1 s, then 0.1 s per byte
        >>> round(replayed_step_time("gpipe", [(1.0, 2.0, 0.5)] * 2, 1, link, [1.0]), 3)
        6.9
        >>> round(replayed_step_time("async", [(1.0, 2.0, 0.5)] * 2, 1, link, [1.0]), 3)
        3.5
        >>> slow = [Link(latency_s=0.5, bandwidth=1.0)]  # a round trip longer than the work
        >>> round(replayed_step_time("async", [(1.0, 2.0, 0.5)] * 2, 1, slow, [1.0]), 3)
        4.75
    """
    _check_whole("microbatches", microbatches)
    streams = _streams(schedule, len(durations), microbatches)
    replay = None
    if links is not None:
        if message_bytes is None or len(links) != len(durations) - 1:
            raise ValueError(
                f"a replay with links needs one link per pair of neighbouring stages "
                f"({len(durations) - 1}) and the bytes a microbatch carries across each"
            )
        replay = Links(links, message_bytes)
    return _period(_replay(streams, durations, replay), streams.first, streams.last)


def evaluate(
    profile: Profile,
    balance: Sequence[int],
    *,
    microbatches: int,
    microbatch_size: int,
    replicas: int = 1,
    schedule: str | None = None,
    bandwidth_bytes_per_s: float | None = None,
) -> Layout:
    """Model one layout: its steady-state step time and each stage's memory.

    A stage's forward (backward, update) seconds are the engine's fixed per-action seconds
    plus what each of its layers adds on top of them. The schedule's action streams run
    through :func:`pipemare.engine.telemetry.replay_timeline` with those durations; the step time is
    the slowest stage's time between updates once the pipeline is full. With replicas, each
    update first all-reduces the stage's gradients over a ring, ``2(D-1)/D × bytes /
    bandwidth`` seconds. With a bandwidth, activations and gradients cross each link in
    ``bytes / bandwidth`` seconds, one at a time, overlapping compute.

    Memory per stage: parameters, gradients, optimiser state and correction buffers, stashed
    weight versions (``pipedream``), and the activations autograd saves for one microbatch
    (the stage's input, what its layers save, its output) times the most microbatches the
    schedule keeps in flight on that stage. Workspace and allocator slack are not counted.

    Args:
        profile: from :func:`profile`.
        balance: layers per stage.
        microbatches: N.
        microbatch_size: samples per microbatch (the profile's sizes, or interpolated).
        replicas: D.
        schedule: default: the profile's.
        bandwidth_bytes_per_s: of the links between devices; None: communication is free
            (as in the simulator's own replay).

    Returns:
        The :class:`Layout`.
    """
    schedule = _check_schedule(profile, schedule)
    partition.check_balance(balance, profile.num_layers)
    _check_whole("microbatches", microbatches)
    _check_whole("replicas", replicas)
    layers, input_bytes = profile.at(microbatch_size)
    costs = _Costs(layers, input_bytes, profile, microbatches, replicas, bandwidth_bytes_per_s)
    return _modelled_layout(costs, schedule, list(balance), replicas, microbatch_size)


def _check_whole(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    ends = [sum(balance[: i + 1]) for i in range(len(balance))]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _modelled_layout(
    costs: _Costs, schedule: str, balance: list[int], replicas: int, microbatch_size: int
) -> Layout:
    stages, n = len(balance), costs.microbatches
    streams = _streams(schedule, stages, n)
    bounds = _bounds(balance)
    durations = [costs.times(a, b) for a, b in bounds]
    links = None
    if costs.bandwidth:
        sizes: list[float] = [costs.out[b - 1] for _, b in bounds[:-1]] or [0.0]
        links = Links([Link(0.0, costs.bandwidth)] * len(sizes), sizes)
    step = _period(_replay(streams, durations, links), streams.first, streams.last)
    memory = tuple(round(costs.memory(a, b, *streams.peaks[j])) for j, (a, b) in enumerate(bounds))
    busy = tuple(costs.busy(a, b) for a, b in bounds)
    return Layout(
        schedule, stages, replicas, n, microbatch_size, tuple(balance), step, busy, memory
    )
