"""Schedule generators: literal tables and rules, no processes."""

from __future__ import annotations

import itertools
from collections import deque

import pytest

from pipemare.schedule import actions as sch
from pipemare.schedule.actions import Op, drain_tail, generate, spec, stream


def names(plan):
    return " ".join(map(repr, plan))


def test_gpipe_table():
    assert [names(p) for p in generate("gpipe", 2, 3, 2)] == [
        "F0 F1 F2 B2 B1 B0 U0 F3 F4 F5 B5 B4 B3 U1",
        "F0 F1 F2 B2 B1 B0 U0 F3 F4 F5 B5 B4 B3 U1",
    ]


def test_1f1b_table():
    assert [names(p) for p in generate("1f1b", 3, 4, 1)] == [
        "F0 F1 F2 B0 F3 B1 B2 B3 U0",
        "F0 F1 B0 F2 B1 F3 B2 B3 U0",
        "F0 B0 F1 B1 F2 B2 F3 B3 U0",
    ]


@pytest.mark.parametrize("name", ["async", "pipemare", "pipedream"])
def test_non_flushing_table(name):
    # The table in schedule.py's docstring, drained after three minibatches.
    assert [names(p) for p in generate(name, 3, 2, 3)] == [
        "F0 F1 F2 B0 F3 B1 U0 F4 B2 F5 B3 U1 B4 B5 U2",
        "F0 F1 B0 F2 B1 U0 F3 B2 F4 B3 U1 F5 B4 B5 U2",
        "F0 B0 F1 B1 U0 F2 B2 F3 B3 U1 F4 B4 F5 B5 U2",
    ]


def test_warmup_runs_1f1b_then_fills_async():
    got = list(itertools.islice(stream("pipemare", 2, 1, 0, warmup=2), 10))
    assert names(got) == "F0 B0 U0 F1 B1 U1 F2 F3 B2 U2"


def test_restart_after_drain_refills():
    assert names(itertools.islice(stream("async", 3, 1, 0, start=4), 5)) == "F4 F5 F6 B4 U4"


def test_drain_tail_orders_backwards_and_updates():
    assert names(drain_tail([5, 3, 4], 2)) == "B3 U1 B4 B5 U2"


GRID = [(p, n) for p in (1, 2, 3, 4, 5, 8) for n in (1, 2, 3, 4, 7)]


@pytest.mark.parametrize("name", sch.SCHEDULES)
@pytest.mark.parametrize(("stages", "micro"), GRID)
def test_every_microbatch_forward_then_backward_then_update(name, stages, micro):
    minibatches = 4
    for plan in generate(name, stages, micro, minibatches):
        seen_f, seen_b, updates = {}, {}, []
        for t, a in enumerate(plan):
            if a.op is Op.FORWARD:
                assert a.index not in seen_f
                seen_f[a.index] = t
            elif a.op is Op.BACKWARD:
                assert a.index in seen_f and a.index not in seen_b, f"{a} before its forward"
                seen_b[a.index] = t
            else:
                ms = range(a.index * micro, (a.index + 1) * micro)
                assert all(m in seen_b for m in ms), f"{a} before its minibatch's backwards"
                updates.append(a.index)
        total = minibatches * micro
        assert sorted(seen_f) == sorted(seen_b) == list(range(total))
        assert updates == list(range(minibatches))


def _run_network(plans, stages):
    """Execute the plans as message-passing processes; return whether all finished."""
    queues = {(i, c): deque() for i in range(stages) for c in ("act", "grad")}
    pos = [0] * stages
    progressed = True
    while progressed:
        progressed = False
        for i, plan in enumerate(plans):
            while pos[i] < len(plan):
                a = plan[pos[i]]
                if a.op is Op.FORWARD and i > 0:
                    if not queues[i, "act"] or queues[i, "act"][0] != a.index:
                        break
                    queues[i, "act"].popleft()
                if a.op is Op.BACKWARD and i < stages - 1:
                    if not queues[i, "grad"] or queues[i, "grad"][0] != a.index:
                        break
                    queues[i, "grad"].popleft()
                if a.op is Op.FORWARD and i < stages - 1:
                    queues[i + 1, "act"].append(a.index)
                if a.op is Op.BACKWARD and i > 0:
                    queues[i - 1, "grad"].append(a.index)
                pos[i] += 1
                progressed = True
    return all(p == len(plan) for p, plan in zip(pos, plans, strict=True))


@pytest.mark.parametrize("name", sch.SCHEDULES)
@pytest.mark.parametrize(("stages", "micro"), GRID)
def test_stages_agree_on_message_order(name, stages, micro):
    # FIFO channels with in-order receives finish: no deadlock and no reordering.
    assert _run_network(generate(name, stages, micro, 5), stages)
    assert _run_network(generate(name, stages, micro, 5, warmup=2), stages)


@pytest.mark.parametrize(("stages", "micro"), GRID)
def test_flushing_schedules_have_nothing_in_flight_at_updates(stages, micro):
    for name in ("gpipe", "1f1b"):
        for plan in generate(name, stages, micro, 3):
            live = set()
            for a in plan:
                if a.op is Op.FORWARD:
                    live.add(a.index)
                elif a.op is Op.BACKWARD:
                    live.discard(a.index)
                else:
                    assert not live


@pytest.mark.parametrize(("stages", "micro"), GRID)
def test_non_flushing_pipeline_stays_full_across_minibatches(stages, micro):
    # After the fill, stage i always has P-i microbatches in flight right before a backward.
    for i, plan in enumerate(generate("async", stages, micro, 6)):
        live = set()
        for a in plan:
            if a.op is Op.FORWARD:
                live.add(a.index)
            elif a.op is Op.BACKWARD:
                if a.index < 6 * micro - (stages - 1 - i):  # not yet draining
                    assert len(live) == stages - i
                live.discard(a.index)


def test_1f1b_holds_fewer_activations_than_gpipe():
    def peak(plan):
        live = best = 0
        for a in plan:
            live += a.op is Op.FORWARD
            live -= a.op is Op.BACKWARD
            best = max(best, live)
        return best

    assert [peak(p) for p in generate("gpipe", 4, 8, 1)] == [8, 8, 8, 8]
    assert [peak(p) for p in generate("1f1b", 4, 8, 1)] == [4, 3, 2, 1]


def test_unknown_schedule_and_bad_sizes():
    with pytest.raises(ValueError, match="unknown schedule 'zb'; choose one of gpipe"):
        sch.spec("zb")
    with pytest.raises(ValueError, match="microbatches must be at least 1"):
        next(stream("async", 2, 0, 0))
    with pytest.raises(ValueError, match=r"stage 2 is outside 0\.\.1"):
        next(stream("async", 2, 1, 2))


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("pipemre", "pipemare"), ("GPipe", "gpipe"), ("1F1B", "1f1b"), ("asynch", "async")],
)
def test_a_misspelled_schedule_gets_a_did_you_mean(typo, meant):
    with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
        spec(typo)
