"""The in-process engine: payload shapes, dtypes, many stages, prediction, clear errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipemare import SCHEDULES, DistributedTransport, Pipeline
from support.models import sgd_pipeline


def mse(out, target):
    return ((out - target) ** 2).mean()


class Split(nn.Module):
    """Returns a tuple of differently shaped tensors (and an integer mask)."""

    def forward(self, x):
        return x[:, :4].reshape(-1, 2, 2), x[:, 4:], (x[:, :1] > 0).long()


class Join(nn.Module):
    def forward(self, parts):
        a, b, mask = parts
        return torch.cat([a.flatten(1), b * mask], dim=1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tuple_payloads_and_parameterless_stages(schedule):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), Split(), Join(), nn.ReLU(), nn.Linear(8, 2))
    pipe = sgd_pipeline(net, mse, lr=0.1, stages=5, microbatches=2, schedule=schedule)
    before = net[0].weight.detach().clone()
    for _ in range(4):
        pipe.step((torch.randn(6, 3), torch.randn(6, 2)))
    pipe.drain()
    assert not torch.equal(before, net[0].weight)  # gradients crossed the tuple stages
    assert pipe.predict(torch.randn(6, 3)).shape == (6, 2)


@pytest.mark.parametrize("schedule", ["1f1b", "pipemare"])
def test_bf16_model(schedule):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    ).to(torch.bfloat16)
    pipe = sgd_pipeline(net, mse, lr=0.2, stages=3, microbatches=2, schedule=schedule)
    x = torch.randn(32, 4, dtype=torch.bfloat16)
    y = x.float().sum(1, keepdim=True).tanh().to(torch.bfloat16)
    losses = [float(pipe.step((x, y))) for _ in range(30)]
    pipe.drain()
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    assert losses[-1] < 0.7 * losses[0]


def test_bf16_autocast_forward_context():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    seen = []
    net[1].register_forward_hook(lambda m, i, o: seen.append(i[0].dtype))
    pipe = sgd_pipeline(
        net,
        mse,
        lr=0.1,
        stages=2,
        forward_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    )
    pipe.step((torch.randn(4, 4), torch.randn(4, 1)))
    pipe.drain()
    assert seen and seen[0] == torch.bfloat16  # bf16 activations crossed the stage boundary
    assert net[0].weight.dtype == torch.float32


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + 0.5 * torch.tanh(self.lin(x))


def test_32_stages_in_one_process_learn():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 24), *[Residual(24) for _ in range(30)], nn.Linear(24, 1))
    pipe = Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.01), mse, stages=32)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=gen)
    y = torch.sin(x.sum(1, keepdim=True))
    losses = [float(pipe.step((x, y))) for _ in range(150)]
    pipe.drain()
    assert [s.in_flight for s in pipe.stages] == [0] * 32
    assert pipe.delays[0].forward == 31
    assert sum(losses[-10:]) < 0.6 * sum(losses[:10])


def test_default_stages_is_one_per_layer():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    pipe = Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.1), mse)
    assert pipe.num_stages == 3 and pipe.balance == [1, 1, 1]


def test_dropout_draws_per_stage_streams():
    # Each stage has its own random stream, so dropout masks do not depend on how the
    # stages interleave; two identical pipelines give identical weights.
    def run():
        torch.manual_seed(5)
        net = nn.Sequential(
            nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 1)
        )
        pipe = Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.1), mse, stages=3, seed=11)
        torch.manual_seed(99)  # the global stream does not matter
        for _ in range(5):
            pipe.step((torch.ones(8, 4), torch.ones(8, 1)))
        pipe.drain()
        return [p.detach().clone() for p in net.parameters()]

    for a, b in zip(run(), run(), strict=True):
        assert torch.equal(a, b)


# -- errors ----------------------------------------------------------------------------------


def test_more_stages_than_layers():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with pytest.raises(
        ValueError, match="cannot cut 2 layers into 3 stages: every stage needs at least one layer"
    ):
        Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.1), mse, stages=3)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_microbatches_must_be_a_positive_integer(bad):
    net = nn.Sequential(nn.Linear(2, 1))
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1"):
        Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.1), mse, stages=1, microbatches=bad)


def test_model_must_be_sequential():
    net = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(
        TypeError,
        match=r"must be a torch\.nn\.Sequential so it can be cut into stages, got ModuleList",
    ):
        Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.1), mse)  # type: ignore[arg-type]


def test_stage_output_must_be_tensor_or_tuple_of_tensors():
    class Bad(nn.Module):
        def forward(self, x):
            return {"x": x}

    net = nn.Sequential(nn.Linear(2, 2), Bad(), nn.Linear(2, 1))
    pipe = Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.1), mse, stages=3)
    with pytest.raises(
        TypeError,
        match="stage 1's output is a dict; between stages only a Tensor or a tuple of Tensors",
    ):
        pipe.step((torch.randn(2, 2), torch.randn(2, 1)))


def test_a_batch_smaller_than_n_updates_as_one_device():
    """3 samples at N = 4: a sample per microbatch and one weightless copy; the update and
    the loss are the batch's own, and a batch of full size follows as usual."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pipe = sgd_pipeline(net, mse, lr=0.1, stages=3, microbatches=4, schedule="gpipe")
    for rows in (3, 8):
        x, y = torch.randn(rows, 2), torch.randn(rows, 1)
        loss = pipe.step((x, y))
        want = mse(ref(x), y)
        opt.zero_grad()
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach())
        for a, b in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_unknown_schedule():
    net = nn.Sequential(nn.Linear(2, 1))
    with pytest.raises(ValueError, match="unknown schedule 'interleaved'"):
        Pipeline(net, torch.optim.SGD(net.parameters(), lr=0.1), mse, schedule="interleaved")


def test_world_size_must_match_stage_count(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    with pytest.raises(
        ValueError,
        match=r"world size is 1 but the pipeline has 2 stages; run one process per stage \(e\.g\. "
        r"torchrun --standalone --nproc-per-node=2\)",
    ):
        DistributedTransport(stages=2)


def test_distributed_transport_without_launcher(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        DistributedTransport(stages=2)


@pytest.mark.parametrize("schedule", ["pipemare", "pipedream", "1f1b"])
def test_state_dict_resume_equals_uninterrupted(schedule):
    import copy

    gen = torch.Generator().manual_seed(4)
    data = [(torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)) for _ in range(8)]

    def build(net):
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        return Pipeline(net, opt, mse, stages=3, microbatches=2, schedule=schedule, seed=3)

    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(4, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1)
    )
    a_net = copy.deepcopy(base)
    a = build(a_net)
    for i, b in enumerate(data):
        if i == 4:
            a.drain()  # the interrupted run saved here, which drains
        a.step(b)
    a.drain()

    b_net = copy.deepcopy(base)
    b = build(b_net)
    for batch in data[:4]:
        b.step(batch)
    saved = copy.deepcopy(
        {"pipe": b.state_dict(), "opt": b.optimizer.state_dict(), "w": b_net.state_dict()}
    )
    c_net = copy.deepcopy(base)
    c_net.load_state_dict(saved["w"])
    c = build(c_net)
    c.optimizer.load_state_dict(saved["opt"])
    c.load_state_dict(saved["pipe"])
    for batch in data[4:]:
        c.step(batch)
    c.drain()
    assert c.minibatches_fed == 8
    for p, q in zip(a_net.parameters(), c_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_replayed_timeline_overlaps_stages_and_respects_dependencies():
    from pipemare.engine.telemetry import Probe, replay_timeline, summarize_spans

    class TickingProbe(Probe):
        """A clock that advances one unit per reading: durations by construction, so the
        replay does not depend on how loaded the machine is."""

        ticks = 0.0

        def now(self) -> float:
            self.ticks += 1.0
            return self.ticks

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    results = {}
    for schedule in ("gpipe", "async"):
        pipe = sgd_pipeline(net, mse, lr=0.0, stages=4, microbatches=4, schedule=schedule)
        pipe.probe = TickingProbe(timeline=True)
        for _ in range(6):
            pipe.step((torch.randn(64, 32), torch.randn(64, 32)))
        spans, makespan = replay_timeline(pipe.probe.take_spans(), 4)
        ends = {(s, n, i): e for s, n, i, _, e in spans if n in ("F", "B")}
        for s, n, i, start, _ in spans:  # every forward waits for the previous stage's
            if n == "F" and s > 0:
                assert start >= ends[(s - 1, "F", i)] - 1e-12
            if n == "B" and s < 3:
                assert start >= ends[(s + 1, "B", i)] - 1e-12
        compute = sum(e - b for _, n, _, b, e in spans if n in ("F", "B", "U"))
        assert compute / 4 < makespan < compute  # stages overlap, but not perfectly
        stats = summarize_spans(spans, makespan)
        results[schedule] = sum(v["utilization"] for v in stats.values()) / 4
    assert results["async"] > results["gpipe"]


def test_an_unread_probe_holds_nothing_per_step_and_still_names_the_first_nonfinite():
    """A probe nobody reads for many steps (a monitor that never asks for non-finite outputs)
    holds no more tensors after 280 steps than after 100, and a later reader still learns
    where the first non-finite output was."""
    from pipemare.engine.errors import NonFiniteGradientError
    from pipemare.engine.telemetry import Probe
    from support.memory import live_tensors

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    pipe = sgd_pipeline(net, mse, lr=0.0, stages=3, microbatches=2, schedule="async")
    pipe.probe = Probe(delays=True)
    live = {}
    with pytest.raises(NonFiniteGradientError):  # the NaN reaches the gradients a step later
        for step in range(300):
            x = torch.randn(4, 8)
            if step == 290:
                x[0, 0] = float("nan")
            pipe.step((x, torch.randn(4, 8)))
            if step in (100, 280):
                live[step] = live_tensors()
    assert live[280] == live[100]
    assert pipe.probe.first_nonfinite()[0] == 290 * 2
