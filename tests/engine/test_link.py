"""The link between stages: read from a string, simulated in the transport, replayed.

The simulated link holds each message until its send time plus the latency plus its bytes over
the bandwidth, one message after another; the replays use the same rule, so that a replay can
be checked against real processes over a slow link on one machine.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_distributed import SUPPORT, start_ranks

from pipemare import PipeMareStrategy
from pipemare.engine.link import Link, LinkClock, Links
from pipemare.planner.cost import replayed_step_time
from support import dist_worker


def test_a_link_is_read_in_bits_or_bytes_with_its_latency():
    assert Link.parse("1Gb/s@1ms") == Link(1e-3, 125e6)
    fast = Link.parse("10Gbps, 20us")
    assert (fast.latency_s, fast.bandwidth) == pytest.approx((20e-6, 1.25e9))
    assert Link.parse("400MB/s@5µs").bandwidth == 400e6
    assert Link.parse(Link(0.0, 1.0)) == Link(0.0, 1.0)
    for bad in ("1Gb/s", "fast", "1Gb/s@-1ms", "0Gb/s@1ms"):
        with pytest.raises(ValueError, match="link"):
            Link.parse(bad)
    with pytest.raises(ValueError, match="cannot read the link"):
        PipeMareStrategy(simulated_link="1Gb/s")


def test_a_link_delivers_one_message_after_another():
    now = [10.0]
    clock = LinkClock(Link(0.5, 100.0), clock=lambda: now[0])
    assert clock.deliver_at(100) == pytest.approx(11.5)  # 1 s on the wire, then 0.5 s
    assert clock.deliver_at(50) == pytest.approx(12.0)  # behind the first: leaves at 11
    now[0] = 20.0  # the link idle again
    assert clock.deliver_at(0) == pytest.approx(20.5)


def test_the_replay_exposes_a_link_where_the_schedule_waits_for_it():
    """A flushing schedule crosses the link twice per step on its critical path at P = 2,
    N = 1; an asynchronous one overlaps a link shorter than its work and is held back by one
    whose round trip is longer than the microbatches it keeps in flight."""
    stage = [(1.0, 2.0, 0.5)] * 2
    free = {s: replayed_step_time(s, stage, 1) for s in ("gpipe", "1f1b", "async")}
    for latency, bandwidth, nbytes in [(0.1, 10.0, 1.0), (0.05, 20.0, 2.0)]:
        crossing = latency + nbytes / bandwidth
        link = [Link(latency, bandwidth)]
        for schedule in ("gpipe", "1f1b"):
            step = replayed_step_time(schedule, stage, 1, link, [nbytes])
            assert step == pytest.approx(free[schedule] + 2 * crossing)
        assert replayed_step_time("async", stage, 1, link, [nbytes]) == pytest.approx(free["async"])
    slow = replayed_step_time("async", stage, 1, [Link(2.0, 1.0)], [1.0])
    assert slow > free["async"]
    with pytest.raises(ValueError, match="one link per pair"):
        replayed_step_time("async", stage, 1, [Link(0.0, 1.0)] * 2, [1.0, 1.0])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async", "pipemare"])
@pytest.mark.parametrize("stages, microbatches", [(2, 1), (3, 4), (4, 2)])
def test_each_message_costs_its_sender_and_receiver_their_cpu(schedule, stages, microbatches):
    """A link whose messages cost each side CPU replays as the same link without it under
    stages whose forwards and backwards take that much longer: a forward takes its input from
    the stage before and sends on, a backward the other way; the first and last stages pay
    for one message, a middle stage for two, and an update for none."""
    send, recv = 0.03, 0.05
    durations = [(1.0 + 0.1 * i, 2.0 - 0.2 * i, 0.5) for i in range(stages)]
    wire = [Link(0.01, 100.0)] * (stages - 1)
    costly = [Link(0.01, 100.0, send_s=send, recv_s=recv)] * (stages - 1)
    sizes = [1.0] * (stages - 1)

    def shifted(i: int) -> tuple[float, float, float]:
        f, b, u = durations[i]
        taken_f, sent_f = i > 0, i < stages - 1  # a forward's input, its output
        taken_b, sent_b = sent_f, taken_f  # a backward's: the other way
        return f + recv * taken_f + send * sent_f, b + recv * taken_b + send * sent_b, u

    by_hand = [shifted(i) for i in range(stages)]
    got = replayed_step_time(schedule, durations, microbatches, costly, sizes)
    want = replayed_step_time(schedule, by_hand, microbatches, wire, sizes)
    assert got == pytest.approx(want, rel=1e-12)
    assert got > replayed_step_time(schedule, durations, microbatches, wire, sizes)
    with pytest.raises(ValueError, match="CPU cannot be negative"):
        Link(0.0, 1.0, send_s=-1e-3)


def test_links_deliver_each_direction_in_series_and_the_directions_apart():
    links = Links([Link(1.0, 1.0), Link(0.0, 2.0)], [2.0, 4.0])
    assert links.arrival(0, True, 0.0) == 3.0
    assert links.arrival(0, True, 0.0) == 5.0  # waits for the first to leave the link
    assert links.arrival(0, False, 0.0) == 3.0  # the other direction is free
    assert links.arrival(1, True, 1.0) == 3.0


@pytest.fixture(scope="module")
def delayed(tmp_path_factory):
    """One launch of two processes: messages over a simulated link, then the real link
    measured."""
    out = tmp_path_factory.mktemp("link")
    start_ranks(2, SUPPORT / "link_worker.py", "--out", str(out), "--what", "delay", "measure")
    return out


@pytest.mark.distributed
@pytest.mark.xdist_group("link_launch")  # the tests sharing the launch: one worker
def test_a_simulated_link_holds_each_message_until_it_has_crossed(delayed):
    """Two processes: three 100 kB messages sent at once over 8 Mb/s (1 MB/s) with 50 ms of
    latency become receivable no sooner than 0.15, 0.25 and 0.35 s after they were sent (a
    lower bound only: the machine may be slower, never faster)."""
    sent = json.loads((delayed / "delay-rank0.json").read_text())["sent"]
    record = json.loads((delayed / "delay-rank1.json").read_text())
    assert record["values"] == [0.0, 1.0, 2.0]
    for k, got in enumerate(record["got"]):
        assert got - sent[0] >= 0.05 + 0.1 * (k + 1) - 1e-3


@pytest.mark.distributed
def test_training_over_a_simulated_link_gives_the_same_weights(tmp_path, one_thread):
    """The link delays messages; it changes nothing they carry: async and 1F1B over a slow
    simulated link end with the in-process simulator's weights."""
    start_ranks(
        2,
        SUPPORT / "link_worker.py",
        "--out",
        str(tmp_path),
        "--what",
        "train",
        "--link",
        "100Mb/s@2ms",
    )
    for schedule in ("async", "1f1b"):
        _, pipe, _ = dist_worker.train(schedule, 2, "inprocess")
        for rank in range(2):
            saved = torch.load(tmp_path / f"{schedule}-rank{rank}.pt")
            local = pipe.stage_modules[saved["stage"]].state_dict()
            for key, value in saved["state"].items():
                torch.testing.assert_close(value, local[key], rtol=0, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.xdist_group("link_launch")
def test_the_links_are_measured_alike_on_every_rank(delayed):
    seen = [json.loads((delayed / f"measure-rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0] == seen[1] and len(seen[0]) == 1
    latency, bandwidth, send_s, recv_s = seen[0][0]
    assert latency > 0 and bandwidth > 0
    # each side's thread does work for every message (a header, posts, a copy's bookkeeping)
    assert send_s > 0 and recv_s > 0
