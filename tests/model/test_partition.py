"""Cutting a Sequential into stages: balances by parameters and by measured cost."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pipemare import Pipeline
from pipemare.model import partition


def mse(out, target):
    return ((out - target) ** 2).mean()


def test_balance_by_params():
    net = nn.Sequential(
        nn.Linear(100, 100), nn.Linear(100, 100), nn.Linear(100, 2), nn.Linear(2, 2)
    )
    pipe = Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.1), mse, stages=2, balance="params")
    assert pipe.balance == [1, 3]
    # ties (the ReLU costs nothing) go to the most even split
    net = nn.Sequential(
        nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 2), nn.ReLU(), nn.Linear(2, 2)
    )
    assert partition.balance_by_params(net, 2) == [2, 3]


@pytest.mark.parametrize(
    ("costs", "stages", "expected"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([5, 1, 1, 1, 1, 1], 2, [1, 5]),
        ([1, 2, 3, 4, 5], 3, [3, 1, 1]),
        ([0, 0, 0], 3, [1, 1, 1]),
    ],
)
def test_balance_by_cost_minimises_the_slowest_stage(costs, stages, expected):
    assert partition.balance_by_cost(costs, stages) == expected


class _Clock:
    """A clock that only the layers below move: each forward adds its layer's cost, and a
    pause adds ``pause`` seconds to each of ``calls`` consecutive forwards from the
    ``start``-th on (the process held off its core while a layer ran)."""

    def __init__(self, start: int, calls: int, pause: float) -> None:
        self.now, self.calls, self.window, self.pause = 0.0, 0, range(start, start + calls), pause

    def read(self) -> float:
        return self.now

    def forward(self, cost: float) -> None:
        self.now += cost + (self.pause if self.calls in self.window else 0.0)
        self.calls += 1


class _Costly(nn.Module):
    """Scales its input; its forward and backward move the clock by their costs."""

    def __init__(self, clock: _Clock, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.clock, self.forward_s, self.backward_s = clock, forward_s, backward_s
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.forward(self.forward_s)
        y = x * self.scale
        if y.requires_grad:
            y.register_hook(lambda grad: self._backward())
        return y

    def _backward(self) -> None:
        self.clock.now += self.backward_s


#: a GPT's segments cut in two: the embedding and the head cheap, four equal blocks between
COSTS = [(0.2, 0.1), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (0.3, 0.2)]


def _timed(monkeypatch, start: int, calls: int) -> nn.Sequential:
    """The layers of :data:`COSTS` on a clock paused from the ``start``-th forward on."""
    clock = _Clock(start, calls, pause=4.0)
    reads = {"perf_counter": clock.read, "thread_time": clock.read}  # whichever it reads
    monkeypatch.setattr(
        partition, "time", SimpleNamespace(**reads, get_clock_info=time.get_clock_info)
    )
    return nn.Sequential(*(_Costly(clock, f, b) for f, b in COSTS))


@pytest.mark.parametrize("calls", [1, 3, 6])
def test_a_pause_over_consecutive_runs_moves_no_layers_time_and_no_cut(monkeypatch, calls):
    """Wherever a pause over ``calls`` consecutive forwards falls in the measurement, every
    layer's time is its own cost and the cut stays even. Timing each layer's runs back to back
    (the median of three), a pause over three of them made that layer several times slower
    and cut [4, 2]: what a busy machine did to a GPT's cut from one run to the next."""
    x = torch.ones(2, 3)
    for start in range(len(COSTS) * 5):  # every forward of the measurement
        passes = partition.layer_passes(_timed(monkeypatch, start, calls), x)
        assert [t for p in passes for t in p] == pytest.approx([t for c in COSTS for t in c]), start
        assert partition.balance_by_time(_timed(monkeypatch, start, calls), x, 2) == [3, 3]


def test_a_layer_is_timed_by_its_typical_run_not_its_fastest(monkeypatch):
    """One round of runs 0.5 s quicker than the rest (a lucky moment: warm caches, a faster
    core) leaves every layer's time at its usual cost: the replays built on these times
    predict a run's typical step, as the engine's own costs are medians too. The fastest run
    would have taken each forward 0.5 s under its cost."""
    x = torch.ones(2, 3)
    layers = len(COSTS)
    # the forwards that give each layer its input, the warm-up round, then the first timed one
    clock = _Clock(start=2 * layers, calls=layers, pause=-0.5)
    reads = {"perf_counter": clock.read, "thread_time": clock.read}
    monkeypatch.setattr(
        partition, "time", SimpleNamespace(**reads, get_clock_info=time.get_clock_info)
    )
    model = nn.Sequential(*(_Costly(clock, f, b) for f, b in COSTS))
    passes = partition.layer_passes(model, x)
    assert [f for f, _ in passes] == pytest.approx([f for f, _ in COSTS])


def test_on_one_cpu_thread_a_layer_is_timed_by_its_own_work_not_the_time_it_waited():
    """A layer that waits 50 ms in every run (as a process held off its core would) is timed
    at its own work on the CPU with one thread: the thread's CPU time."""

    class Waits(nn.Linear):
        def forward(self, x):
            time.sleep(0.05)
            return super().forward(x)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ((forward, backward),) = partition.layer_passes(
            nn.Sequential(Waits(4, 4)), torch.ones(2, 4)
        )
    finally:
        torch.set_num_threads(threads)
    assert 0 < forward < 0.025 and 0 < backward < 0.025


def test_the_head_is_timed_into_the_models_output_and_leaves_the_rest_as_it_was(monkeypatch):
    """What the last stage computes after its layers (a training step's loss) is timed by its
    forward and by its backward into the model's output: the typical run of each, not one
    slowed by a pause. Its backward gives no gradient to a parameter it uses outside the
    model, and the model's buffers (BatchNorm's statistics) are as before."""
    clock = _Clock(start=2 + 2, calls=1, pause=3.0)  # the layers' one forward, warm-up, 1st run
    reads = {"perf_counter": clock.read, "thread_time": clock.read}
    monkeypatch.setattr(
        partition, "time", SimpleNamespace(**reads, get_clock_info=time.get_clock_info)
    )
    model = nn.Sequential(_Costly(clock, 1.0, 1.0), nn.BatchNorm1d(3))
    statistics = [b.clone() for b in model.buffers()]
    outside = nn.Parameter(torch.ones(3))
    head_cost = _Costly(clock, 0.25, 0.5)  # the loss's forward and backward
    sample = torch.randn(4, 3)

    def head(out):
        return (head_cost(out) * outside).sum()

    forward, backward = partition.head_passes(head, model, sample)
    assert (forward, backward) == pytest.approx((0.25, 0.5))
    assert outside.grad is None and head_cost.scale.grad is None
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), statistics, strict=True))
    calls = []
    assert partition.step_code_seconds(lambda: calls.append(clock.forward(0.125)), sample) == (
        pytest.approx(0.125)
    )
    assert len(calls) == 6  # a warm-up and five timed


def test_one_forward_through_the_layers_serves_their_times_their_sizes_and_the_head(monkeypatch):
    """Setup times the layers, measures what each sends across a cut and times the step's head
    on the model's output at every N it weighs: from one forward through the layers without
    autograd, where calling the three one after another ran three (a whole forward of the
    microbatch each, at N = 1 the whole batch's). The figures are the three's, the head's
    backward reaches the output only, and the model's buffers are as before."""
    clock = _Clock(start=0, calls=0, pause=0.0)
    reads = {"perf_counter": clock.read, "thread_time": clock.read}
    monkeypatch.setattr(
        partition, "time", SimpleNamespace(**reads, get_clock_info=time.get_clock_info)
    )
    untimed = []  # the forwards each layer runs without autograd

    class Counted(_Costly):
        def forward(self, x):
            if not torch.is_grad_enabled():
                untimed.append(self)
            return super().forward(x)

    model = nn.Sequential(*(Counted(clock, f, b) for f, b in COSTS), nn.BatchNorm1d(3))
    statistics = [b.clone() for b in model.buffers()]
    outside = nn.Parameter(torch.ones(3))
    head_cost = _Costly(clock, 0.25, 0.5)
    x = torch.randn(4, 3)

    def head(out):
        return (head_cost(out) * outside).sum()

    timed = partition.time_layers(model, x, head=head)
    assert len(untimed) == len(COSTS)  # each layer once
    assert [t for p in timed.passes[:-1] for t in p] == pytest.approx([t for c in COSTS for t in c])
    assert timed.head == pytest.approx((0.25, 0.5))
    assert outside.grad is None and head_cost.scale.grad is None
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), statistics, strict=True))
    untimed.clear()
    apart = (
        partition.layer_passes(model, x),
        partition.layer_out_bytes(model, x),
        partition.head_passes(head, model, x),
    )
    assert len(untimed) == 3 * len(COSTS)
    assert [t for p in timed.passes for t in p] == pytest.approx([t for p in apart[0] for t in p])
    assert list(timed.out_bytes) == apart[1] == [4 * 3 * 4] * len(model)
    assert timed.head == pytest.approx(apart[2])
    assert partition.time_layers(model, x).head is None
