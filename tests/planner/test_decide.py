"""The one decision point, fed plain facts: no model, Trainer or process group."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

from pipemare.engine.link import Link
from pipemare.optim.settings import RunSettings
from pipemare.planner.cost import replayed_step_time
from pipemare.planner.decide import (
    Advice,
    ModelFacts,
    PipelineOptions,
    RunFacts,
    RunPlan,
    decide,
    measurements_needed,
)
from pipemare.planner.measurements import Overhead
from pipemare.planner.reference import ReferenceQuality, measured_quality

SEQ = ModelFacts("Net.layers", layers=6, layer_params=(10, 10, 10, 10, 10, 50))
HF = ModelFacts(
    "GPT2LMHeadModel",
    layers=4,
    traced_seconds=1.25,
    cache_switched=True,
    config_use_cache=True,
    label_shift=1,
)


def _adamw() -> torch.optim.Optimizer:
    """The optimiser's groups are a fact: an AdamW over two groups of stand-in parameters."""
    groups = [
        {"params": [nn.Parameter(torch.zeros(2))]},
        {"params": [nn.Parameter(torch.zeros(1))]},
    ]
    return torch.optim.AdamW(groups, lr=1e-3)


def _passes(*times: float) -> tuple[tuple[float, float], ...]:
    """Each layer's (forward, backward) seconds: a third and two thirds of ``times``."""
    return tuple((t / 3, 2 * t / 3) for t in times)


def _said(plan: RunPlan) -> dict[str, str]:
    return {d.subject: f"{d.choice} ({d.reason})" for d in plan.decisions}


def test_plain_facts_give_the_whole_frozen_plan():
    """Layer times at the microbatch size the default layout runs, the batch's rows, the
    optimiser's groups, the process layout and the run's length: the whole plan comes back,
    frozen, with a reason for each choice taken on the user's behalf."""
    facts = RunFacts(
        SEQ,
        rows=32,
        process_stages=2,
        replicas=1,
        layer_passes={16: _passes(6.0, 6.0, 1.0, 1.0, 1.0, 1.0)},
        optimizer=_adamw(),
        total_steps=1000,
        steps_per_epoch=100,
        short_last_batches=((1, 97, 32),),
    )
    plan = decide(PipelineOptions(), facts)
    assert (plan.stages, plan.microbatches, plan.balance) == (2, 2, (2, 4))
    assert plan.compile is None and plan.weights is None
    assert isinstance(plan.settings, RunSettings)
    s = plan.settings
    assert (s.schedule, s.stages, s.microbatches, s.balance) == ("pipemare", 2, 2, (2, 4))
    assert s.total_steps == 1000 and s.horizon is not None
    said = _said(plan)
    assert said["stages"] == "P=2 (one per process)"
    assert said["microbatches"].startswith("N=2 (N = P: no microbatch more than one update stale")
    assert said["layers per stage"].startswith("[2, 4] (balance='time': from each layer's time")
    assert said["last batch"].startswith("1 sample(s) < N=2 (97 samples in batches of 32")
    assert said["weight_prediction"].startswith("on")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.microbatches = 3  # type: ignore[misc]
    # the same facts, the same plan: nothing read from a clock or a process
    again = decide(PipelineOptions(), facts)
    assert again.balance == plan.balance and again.decisions == plan.decisions


def test_layout_rows():
    """Each way the layout is chosen, as a row: (options, facts) -> (P, N, cut, reason)."""
    times = {8: _passes(1.0, 1.0, 1.0, 1.0, 1.0, 4.0), 16: _passes(*(1.0,) * 6)}
    rows = [
        # one process, P given, N auto: N = P, the cut from the times at 32 / 4 = 8 rows
        (dict(stages=4), dict(rows=32), (4, 4, (1, 2, 2, 1)), "balance='time'"),
        # one process, nothing given: one stage per layer
        ({}, dict(rows=32), (6, 6, (1,) * 6), "one layer per stage"),
        # a flushing schedule, N given: the cut from the passes at its microbatch size
        (dict(stages=2, schedule="1f1b", microbatches=2), dict(rows=32), (2, 2, (3, 3)), "'time'"),
        # N capped by a batch smaller than P
        (dict(stages=4, balance="even"), dict(rows=3), (4, 3, (2, 2, 1, 1)), "balance='even'"),
        (dict(stages=2, balance="params"), dict(rows=8), (2, 2, (5, 1)), "balance='params'"),
        (dict(stages=2, balance=[1, 5], microbatches=8), dict(rows=8), (2, 8, (1, 5)), None),
        # a checkpointed run's cut is kept for the same P
        (
            dict(stages=2),
            dict(rows=8, checkpointed={"stages": 2, "balance": [2, 4]}),
            (2, 2, (2, 4)),
            "as the checkpointed run cut it",
        ),
        # a rebuild (after fit, for test) keeps the first build's N and cut
        (dict(stages=2), dict(rows=5, previous=(2, 4, (1, 5))), (2, 4, (1, 5)), None),
    ]
    for options, fact, expected, why in rows:
        facts = RunFacts(SEQ, layer_passes=times, **fact)
        plan = decide(PipelineOptions(**options), facts)
        assert (plan.stages, plan.microbatches, plan.balance) == expected, options
        cut_said = _said(plan).get("layers per stage")
        assert (why is None and cut_said is None) or (why in (cut_said or "")), (options, cut_said)


def test_what_must_be_measured_is_said_before_measuring():
    facts = RunFacts(SEQ, rows=32)
    # the asynchronous default times its own N and every N 1F1B could run, to advise
    advising = ("time", (1, 2, 3, 4, 8, 16, 32))
    assert measurements_needed(PipelineOptions(stages=3), facts) == advising
    assert measurements_needed(PipelineOptions(stages=6), facts) == (
        "time",
        (1, 2, 4, 6, 8, 16, 32),
    )
    assert measurements_needed(PipelineOptions(stages=3, advise=False), facts) == ("time", (3,))
    norm = dataclasses.replace(facts, model=dataclasses.replace(SEQ, batch_statistics=True))
    assert measurements_needed(PipelineOptions(stages=3), norm) == ("time", (1, 2, 3, 4, 8, 16))
    evaluating = dataclasses.replace(facts, fitting=False)
    assert measurements_needed(PipelineOptions(stages=3), evaluating) == ("time", (3,))
    assert measurements_needed(PipelineOptions(stages=3, balance="auto"), facts) == ("auto", (3,))
    every_n = ("time", (1, 2, 4, 8, 16, 32))  # a flushing schedule's N: each divisor of 32
    assert measurements_needed(PipelineOptions(stages=3, schedule="gpipe"), facts) == every_n
    even = PipelineOptions(stages=3, schedule="1f1b", balance="even")
    assert measurements_needed(even, facts) == every_n  # N is chosen from them, not the cut
    for needless in (dict(stages=6), dict(stages=3, balance="params"), dict(balance=[3, 3])):
        assert measurements_needed(PipelineOptions(**needless, advise=False), facts) is None
    kept = dataclasses.replace(facts, checkpointed={"stages": 3, "balance": [2, 2, 2]})
    assert measurements_needed(PipelineOptions(stages=3, advise=False), kept) is None
    # the times must be those of the size the layout runs, not another
    with pytest.raises(ValueError, match=r"times on a microbatch of 11 rows; measured at \[8\]"):
        measured = dataclasses.replace(facts, layer_passes={8: _passes(*(1.0,) * 6)})
        decide(PipelineOptions(stages=3), measured)


def test_a_hugging_face_model_is_said_how_it_was_cut_called_and_weighted():
    facts = RunFacts(HF, rows=8, process_stages=2, optimizer=_adamw())
    plan = decide(PipelineOptions(balance="even"), facts)
    said = _said(plan)
    assert said["segments"] == (
        "4, traced and cut in 1.2 s (GPT2LMHeadModel is not an nn.Sequential: torch.export "
        "traced its forward at the first batch)"
    )
    assert said["use_cache"].startswith("False in GPT2LMHeadModel's calls")
    assert said["use_cache"].endswith("its config keeps use_cache=True)")
    assert said["microbatch weights"].startswith("each microbatch's share of the batch's counted")
    # a causal LM's labels shift by one: microbatch 0 counts 2 of 3 tokens, microbatch 1 all 3
    labels = torch.tensor([[1, 2, 3, -100]]), torch.tensor([[1, 2, 3, 4]])
    assert plan.weights is not None
    assert plan.weights([{"labels": labels[0]}, {"labels": labels[1]}]) == pytest.approx([0.4, 0.6])
    assert decide(PipelineOptions(balance="even", microbatch_weights="rows"), facts).weights is None
    compiled = dataclasses.replace(HF, user_compiled="torch.compile")
    plan = decide(PipelineOptions(balance="even"), dataclasses.replace(facts, model=compiled))
    assert plan.compile == {} and "was passed through torch.compile(...)" in _said(plan)["compile"]


def test_refusals_come_from_the_facts():
    with pytest.raises(ValueError, match="cannot be split into 4 microbatches"):
        decide(PipelineOptions(stages=4, microbatches=4, balance="even"), RunFacts(SEQ, rows=3))
    # evaluation: no optimiser, no last-batch check, the same layout
    plan = decide(PipelineOptions(stages=2, balance="even"), RunFacts(SEQ, rows=8, fitting=False))
    assert (plan.stages, plan.microbatches, plan.balance) == (2, 2, (3, 3))


def _flushing(times_at, rows=8, **options):
    """``1f1b`` with N left to it, the layers' passes at each N given by ``times_at(rows)``."""
    passes = {rows // n: times_at(rows // n) for n in (1, 2, 4, 8) if rows % n == 0}
    facts = RunFacts(SEQ, rows=rows, layer_passes=passes)
    return decide(PipelineOptions(stages=2, schedule="1f1b", **options), facts)


def test_1f1b_takes_more_microbatches_where_they_shrink_its_step():
    """Layers that cost their rows (compute-bound): every N costs the same work, and the
    bubble (P - 1)/(N + P - 1) shrinks as N grows, so the replay picks the finest split."""
    plan = _flushing(lambda rows: _passes(*[0.001 * rows] * 6))
    assert plan.microbatches == 8 and plan.balance == (3, 3)
    why = _said(plan)["microbatches"]
    assert why.startswith("N=8 (the fastest step of '1f1b' for a batch of 8, replayed from each")
    # 24 ms of work per stage, times (N + P - 1)/N: the bubble the replay derives
    assert "(N=1: 48 ms, N=2: 36 ms, N=4: 30 ms, N=8: 27 ms)" in why


def test_1f1b_keeps_one_microbatch_where_each_costs_the_same_whatever_its_rows():
    """Layers that cost a fixed time per call whatever the rows (dispatch-bound): each extra
    microbatch costs a whole pass, so N = 1 is the fastest."""
    plan = _flushing(lambda rows: _passes(*[0.001] * 6))
    assert plan.microbatches == 1
    assert _said(plan)["microbatches"].startswith("N=1 (the fastest step of '1f1b'")
    # given, N is the user's; with BatchNorm, one device's statistics keep N = 1
    assert _flushing(lambda rows: _passes(*[0.001 * rows] * 6), microbatches=2).microbatches == 2
    norm = dataclasses.replace(SEQ, batch_statistics=True)
    facts = RunFacts(norm, rows=8, layer_passes={8: _passes(*[1.0] * 6)})
    plan = decide(PipelineOptions(stages=2, schedule="gpipe"), facts)
    assert plan.microbatches == 1 and "has BatchNorm" in _said(plan)["microbatches"]


def _advised(passes, overhead=None, optimizer=None, **options) -> RunPlan:
    """The default schedule at P = 2 on a batch of 8, the layers timed at every N (AdamW
    unless another ``optimizer`` is given)."""
    facts = RunFacts(
        SEQ,
        rows=8,
        layer_passes={rows: passes(rows) for rows in (1, 2, 4, 8)},
        optimizer=optimizer or _adamw(),
        overheads={s: Overhead(*fixed) for s, fixed in (overhead or {}).items()},
    )
    return decide(PipelineOptions(stages=2, **options), facts)


def _replay(schedule, stage_passes, n, fixed=(0.0, 0.0, 0.0)):
    """The replay of two stages whose (forward, backward) are ``stage_passes``, by hand."""
    durations = [(fixed[0] + f, fixed[1] + b, fixed[2]) for f, b in stage_passes]
    return replayed_step_time(schedule, durations, n)


def test_the_advice_is_the_replay_of_the_measured_stages_and_names_the_sooner_schedule():
    """Compute-bound layers (their time follows their rows): the asynchronous step costs one
    pass over the batch, 1F1B's at its fastest N pays its bubble on top: pipemare steps sooner,
    by the ratio of the two replays, each computed here from the same stage times. The verdict
    on time to quality multiplies that ratio by the steps each reference task measured for
    AdamW's family at this P and N, read from the shipped data file."""
    plan = _advised(lambda rows: _passes(*[0.001 * rows] * 6))
    advice = plan.advice
    assert advice is not None and plan.microbatches == 2 and plan.balance == (3, 3)
    stage = lambda rows: (3 * 0.001 * rows / 3, 3 * 2 * 0.001 * rows / 3)  # noqa: E731
    want_own = _replay("pipemare", [stage(4)] * 2, 2)
    want_base = {n: _replay("1f1b", [stage(8 // n)] * 2, n) for n in (1, 2, 4, 8)}
    assert advice.step_s == pytest.approx(want_own)
    assert dict(advice.baseline_by_n) == pytest.approx(want_base)
    assert advice.baseline_n == 8 and advice.ratio == pytest.approx(want_own / want_base[8])
    assert advice.ratio < 0.95 and advice.steps_sooner == "pipemare"
    said = _said(plan)["advice"]
    assert said.startswith(f"{advice.verdict} (a step replayed from this model's layers")
    assert f"'pipemare' at N=2 {want_own * 1e3:.3g} ms" in said
    assert f"'1f1b' at its fastest N=8 {want_base[8] * 1e3:.3g} ms" in said
    assert f"{advice.ratio:.2f}x 1F1B's step" in said
    # beside the time, every reference task that measured AdamW's family at P = 2, N = 2
    assert advice.family == "adam" and advice.stages == 2
    assert advice.quality == measured_quality("pipemare", "adam", 2, 2) and advice.quality
    assert "quality from reference tasks, not this model" in said
    for reference in advice.quality:
        time = advice.time_ratio(reference)
        reached = "1F1B sooner" if time is None else f"{time:.2f}x 1F1B's time"
        assert f"{reference.label}, {reference.what}, {reference.seeds} seed" in said
        assert f"final loss {reference.loss_gap:+.1%} at equal steps; {reached}" in said
    # the way to run 1F1B is given exactly where the verdict does not name the run's schedule
    call = "PipeMareStrategy(stages=2, schedule='1f1b', microbatches=8)"
    assert advice.baseline_call == call
    assert (call in said) == (advice.names != "pipemare")


def test_the_advice_counts_the_engines_cost_per_action_and_can_favour_1f1b():
    """Layers that cost the same per call whatever its rows (dispatch-bound): N = P doubles
    the calls, and with the engine's own cost per action (higher under pipemare, whose
    corrections run at each action) 1F1B at N = 1 steps sooner. With an optimiser outside the
    measured families the quality is not measured: the advice says which steps sooner, says
    it is only that, and how to run 1F1B."""
    overhead = {"pipemare": (0.002, 0.002, 0.001), "1f1b": (0.001, 0.001, 0.001)}
    plain_sgd = lambda: torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)  # noqa: E731
    plan = _advised(lambda rows: _passes(*[0.003] * 6), overhead, optimizer=plain_sgd())
    advice = plan.advice
    assert advice is not None and advice.baseline_n == 1 and advice.steps_sooner == "1f1b"
    stage = (0.003, 0.006)
    want_own = _replay("pipemare", [stage] * 2, 2, overhead["pipemare"])
    want_base = _replay("1f1b", [stage] * 2, 1, overhead["1f1b"])
    assert advice.step_s == pytest.approx(want_own)
    assert advice.baseline_s == pytest.approx(want_base) and advice.ratio > 1
    assert advice.family is None and advice.quality == () and advice.sooner is None
    said = _said(plan)["advice"]
    assert said.startswith("1f1b steps sooner; quality not measured (")
    assert "quality not measured: no reference task ran 'pipemare' at P=2, N=2 with an " in said
    assert "only which steps sooner" in said
    call = "PipeMareStrategy(stages=2, schedule='1f1b', microbatches=1)"
    assert f"{call}, with the run's other arguments, runs 1F1B at its fastest N" in said
    # the engine's cost is what tips it: without it the two replays tie, to the run's schedule,
    # and then nothing tells the user to switch
    even = _advised(lambda rows: _passes(*[0.003] * 6), optimizer=plain_sgd())
    assert (
        even.advice.steps_sooner == "pipemare" and "PipeMareStrategy(" not in _said(even)["advice"]
    )


def _rows_facts(model: ModelFacts, overheads: dict[str, Overhead]) -> RunFacts:
    """A batch of 8 whose six layers each take a millisecond per row (forward a third),
    timed at every N, with AdamW and the engine costs ``overheads``."""
    return RunFacts(
        model,
        rows=8,
        layer_passes={rows: _passes(*[0.001 * rows] * 6) for rows in (1, 2, 4, 8)},
        optimizer=_adamw(),
        overheads=overheads,
    )


def test_the_replay_charges_each_stage_update_and_delayed_forward_by_the_parameters_it_trains():
    """A stage's update is the optimiser's and the corrections' arithmetic over the weights it
    trains, and a delayed stage's forward moves them (weight prediction): the replay adds the
    measured rates per trained parameter (frozen ones cost nothing) to the fixed costs, as the
    run at setup measured them. An asynchronous schedule's last stage has no delay: its
    forward pays no rate and its update its own; a flushing schedule's stages all pay alike."""
    frozen_head = dataclasses.replace(
        SEQ, layer_params=(100,) * 6, layer_trained=(100, 100, 100, 100, 100, 0)
    )
    overheads = {
        "pipemare": Overhead(0.001, 0.001, 0.002, 1e-5, 3e-6, undelayed_update_per_param_s=6e-6),
        "1f1b": Overhead(0.001, 0.001, 0.002, update_per_param_s=4e-6, forward_per_param_s=1e-6),
    }
    facts = _rows_facts(frozen_head, overheads)
    advice = decide(PipelineOptions(stages=2, balance="even"), facts).advice
    assert advice is not None
    stage = lambda rows: (3 * 0.001 * rows / 3, 3 * 2 * 0.001 * rows / 3)  # noqa: E731

    def replay(schedule, n):
        o = overheads[schedule]
        delayed = (True, True) if schedule == "1f1b" else (True, False)
        durations = [
            (
                o.forward_s + f + (o.forward_per_param_s * trained if late else 0.0),
                o.backward_s + b,
                o.update_s
                + (
                    o.update_per_param_s
                    if late or o.undelayed_update_per_param_s is None
                    else o.undelayed_update_per_param_s
                )
                * trained,
            )
            for (f, b), trained, late in zip([stage(8 // n)] * 2, (300, 200), delayed, strict=True)
        ]
        return replayed_step_time(schedule, durations, n)

    assert advice.step_s == pytest.approx(replay("pipemare", 2))
    assert dict(advice.baseline_by_n) == pytest.approx({n: replay("1f1b", n) for n in (1, 2, 4, 8)})
    # without the rates, the same facts replay a shorter step
    fixed_only = {s: Overhead(o.forward_s, o.backward_s, o.update_s) for s, o in overheads.items()}
    plain = decide(
        PipelineOptions(stages=2, balance="even"), dataclasses.replace(facts, overheads=fixed_only)
    ).advice
    assert plain is not None and plain.step_s < advice.step_s


#: six layers of equal parameters, in two tensors each, and the last three in twelve each
FEW_TENSORS = dataclasses.replace(SEQ, layer_trained=(10,) * 6, layer_tensors=(2,) * 6)
MANY_TENSORS = dataclasses.replace(FEW_TENSORS, layer_tensors=(2, 2, 2, 12, 12, 12))


def _advised_on_two_stages(model, overheads):
    """The advice of an even cut in two stages of ``model`` with the engine's ``overheads``."""
    advice = decide(PipelineOptions(stages=2, balance="even"), _rows_facts(model, overheads)).advice
    assert advice is not None
    return advice


def _replays_as(advised, replay):
    """Pipemare's step and 1F1B's at every N in ``advised``'s advice are ``replay``'s, for the
    stages of :data:`FEW_TENSORS` and of :data:`MANY_TENSORS`; more tensors, a longer step."""
    for model, tensors in ((FEW_TENSORS, (6, 6)), (MANY_TENSORS, (6, 36))):
        advice = advised(model)
        assert advice.step_s == pytest.approx(replay("pipemare", 2, tensors))
        assert dict(advice.baseline_by_n) == pytest.approx(
            {n: replay("1f1b", n, tensors) for n in (1, 2, 4, 8)}
        )
    assert advised(MANY_TENSORS).step_s > advised(FEW_TENSORS).step_s


def test_the_replay_charges_each_stage_update_by_the_tensors_it_trains():
    """An update is dispatched over each trained tensor (the optimiser's and the corrections'
    work per tensor, whatever its size): the replay charges the measured rate per tensor
    beyond a stage's first, the last stage of an asynchronous schedule at its own rate, and a
    stage of the same parameters in more tensors replays a longer step."""
    overheads = {
        "pipemare": Overhead(0.001, 0.001, 0.002, 0.0, 0.0, 0.0, 4e-4, 1e-4),
        "1f1b": Overhead(0.001, 0.001, 0.002, update_per_tensor_s=3e-4),
    }
    advised = functools.partial(_advised_on_two_stages, overheads=overheads)

    def replay(schedule, n, tensors):
        o = overheads[schedule]
        stage = (0.001 * (8 // n), 2 * 0.001 * (8 // n))
        rates = [o.update_per_tensor_s, o.undelayed_update_per_tensor_s or o.update_per_tensor_s]
        if schedule == "1f1b":
            rates = [o.update_per_tensor_s] * 2
        durations = [
            (o.forward_s + stage[0], o.backward_s + stage[1], o.update_s + rate * (count - 1))
            for rate, count in zip(rates, tensors, strict=True)
        ]
        return replayed_step_time(schedule, durations, n)

    _replays_as(advised, replay)
    # the tensors unknown: one a stage, no rate charged
    unknown = advised(dataclasses.replace(FEW_TENSORS, layer_tensors=()))
    assert unknown.step_s == pytest.approx(replay("pipemare", 2, (1, 1)))


def test_the_replay_charges_each_stage_pass_by_the_tensors_it_trains():
    """pipemare's forward keeps each weight's version and moves each weight for weight
    prediction, a few microseconds a tensor: the replay charges each forward and backward the
    measured rate per tensor beyond a stage's first, each schedule at its own, so a stage of
    the same parameters in more tensors replays a longer step; before, only the update was
    charged per tensor and the passes replayed alike."""
    overheads = {
        "pipemare": Overhead(
            0.001, 0.001, 0.002, forward_per_tensor_s=2e-4, backward_per_tensor_s=5e-5
        ),
        "1f1b": Overhead(
            0.001, 0.001, 0.002, forward_per_tensor_s=1e-5, backward_per_tensor_s=5e-5
        ),
    }
    advised = functools.partial(_advised_on_two_stages, overheads=overheads)

    def replay(schedule, n, tensors):
        o = overheads[schedule]
        stage = (0.001 * (8 // n), 2 * 0.001 * (8 // n))
        durations = [
            (
                o.forward_s + o.forward_per_tensor_s * (count - 1) + stage[0],
                o.backward_s + o.backward_per_tensor_s * (count - 1) + stage[1],
                o.update_s,
            )
            for count in tensors
        ]
        return replayed_step_time(schedule, durations, n)

    _replays_as(advised, replay)


def test_a_layout_the_references_did_not_measure_is_said_to_be_not_measured():
    """AdamW's family at an N no reference task ran: where the family was measured is said."""
    passes = lambda rows: _passes(*[0.001 * rows] * 6)  # noqa: E731
    assert measured_quality("pipemare", "adam", 2, 8) == ()
    plan = _advised(passes, microbatches=8)
    assert plan.advice.quality == () and plan.advice.verdict.endswith("; quality not measured")
    said = _said(plan)["advice"]
    assert "no reference task ran 'pipemare' at P=2, N=8 with the adam family (measured at " in said
    assert "P=2 N=2" in said


def _reference(steps: int, steps_ratio: float | None, task: str = "t") -> ReferenceQuality:
    """A reference cell of pipemare at P = 4, N = 4 on a task of ``steps``."""
    return ReferenceQuality(
        task,
        "a task",
        steps,
        1e-3,
        "adamw",
        "adam",
        "pipemare",
        4,
        4,
        2,
        0.01,
        steps_ratio,
        "how",
        "where",
    )


def _advice(step_ratio: float, *references: ReferenceQuality) -> Advice:
    base = {1: 0.5, 4: 0.25, 8: 0.125}  # binary fractions: a ratio of 0.5 is exactly that
    return Advice("pipemare", 4, step_ratio * 0.125, 8, 0.125, base, 4, "adam", references)


def test_the_verdict_is_the_time_to_quality_not_the_step():
    """Time to quality = the step ratio × the reference's steps ratio: a step half of 1F1B's
    loses to 1F1B where the references needed 2.5 times the steps; a reference where the run
    never reached the quality counts for 1F1B; a tie counts for the run's schedule."""
    slow_to_quality = _advice(0.5, _reference(800, 2.5))
    assert slow_to_quality.steps_sooner == "pipemare"
    assert slow_to_quality.time_ratio(slow_to_quality.quality[0]) == pytest.approx(1.25)
    assert slow_to_quality.sooner == slow_to_quality.names == "1f1b"
    assert slow_to_quality.verdict == "1f1b reaches the quality sooner"
    never = _advice(0.5, _reference(800, None), _reference(300, None))
    assert never.time_ratio(never.quality[0]) is None
    assert never.verdict == "1f1b reaches the quality sooner"
    both = _advice(0.5, _reference(800, 1.5), _reference(300, 1.9))
    assert both.sooner == "pipemare" and both.verdict == "pipemare reaches the quality sooner"
    assert _advice(0.5, _reference(800, 2.0)).sooner == "pipemare"  # 0.5 x 2.0: a tie
    unmeasured = _advice(1.2)
    assert unmeasured.sooner is None and unmeasured.names == "1f1b"
    assert unmeasured.verdict == "1f1b steps sooner; quality not measured"


def test_where_the_references_disagree_the_verdict_names_neither_and_leads_with_the_longest():
    """A long run that reaches the quality and a short one that never does: no schedule is
    named, the longest run's answer leads, and both are in the reasons."""
    advice = _advice(0.7, _reference(300, None, "short"), _reference(2400, 0.97, "long"))
    assert advice.sooner is None and advice.names is None
    assert advice.longest == advice.quality[1]
    assert [advice.sooner_on(r) for r in advice.quality] == ["1f1b", "pipemare"]
    assert advice.verdict == (
        "depends on the task and run length; on the longest reference run, long (2,400 steps), "
        "pipemare reaches the quality sooner"
    )


def test_the_replays_carry_each_message_across_the_links_found_at_setup():
    """With the links between the processes known, both schedules' replays carry each
    microbatch's activation (the bytes of the last layer before the cut) and its gradient
    across them. A slow link lengthens 1F1B's step by the crossings on its critical path; at
    P = 2, N = 2 it lengthens the asynchronous one's too: a microbatch's round trip, two
    crossings included, is longer than the two microbatches in flight cover. The run says
    which links it replayed and how it found them."""
    passes = lambda rows: _passes(*[0.001 * rows] * 6)  # noqa: E731
    link = Link.parse("1Gb/s@1ms")
    facts = RunFacts(
        SEQ,
        rows=8,
        layer_passes={rows: passes(rows) for rows in (1, 2, 4, 8)},
        layer_out_bytes={rows: (1000 * rows,) * 6 for rows in (1, 2, 4, 8)},
        links=(link,),
        links_why="simulated",
        optimizer=_adamw(),
    )
    plan = decide(PipelineOptions(stages=2), facts)
    advice, free = plan.advice, _advised(passes).advice
    assert advice is not None and free is not None and plan.balance == (3, 3)
    stage = lambda rows: [(0.001 * rows, 0.002 * rows, 0.0)] * 2  # noqa: E731
    assert advice.step_s == pytest.approx(
        replayed_step_time("pipemare", stage(4), 2, [link], [4000])
    )
    for n in (1, 2, 4, 8):
        want = replayed_step_time("1f1b", stage(8 // n), n, [link], [1000 * (8 // n)])
        assert advice.baseline_by_n[n] == pytest.approx(want)
        assert want > free.baseline_by_n[n]
    # one microbatch's F on both stages, B on both, and two crossings: the step is that round
    # trip, for it keeps two microbatches (the step's two) in flight
    round_trip = 2 * 0.004 + 2 * 0.008 + 2 * link.seconds(4000)
    assert advice.step_s == pytest.approx(round_trip) and advice.step_s > free.step_s
    assert _said(plan)["links"] == "0-1: 1 Gb/s at 1 ms (simulated)"
    assert "links" not in _said(_advised(passes))


def test_no_advice_where_it_is_not_asked_for_or_means_nothing():
    passes = lambda rows: _passes(*[0.001 * rows] * 6)  # noqa: E731
    assert _advised(passes, advise=False).advice is None
    assert _advised(passes, schedule="1f1b").advice is None  # a flushing schedule: N is chosen
    assert "advice" not in _said(_advised(passes, advise=False))
    facts = RunFacts(SEQ, rows=8, layer_passes={4: passes(4)}, fitting=False)
    assert decide(PipelineOptions(stages=2), facts).advice is None  # evaluation


def test_a_resumed_run_keeps_the_microbatches_its_checkpoint_chose():
    """An ``"auto"`` N chosen from timings (a flushing schedule's fastest replayed step) must
    not move under a resume: a checkpoint of the same schedule and P gives its N back, said
    so, and nothing is timed for it; another layout, or a batch too small for it, decides
    afresh."""
    rows = 8
    passes = {rows // n: _passes(*[0.001 * (rows // n)] * 6) for n in (1, 2, 4, 8)}
    saved = {"stages": 2, "balance": [3, 3], "schedule": "1f1b", "microbatches": 2}
    options = PipelineOptions(stages=2, schedule="1f1b", balance="even")
    fresh = decide(options, RunFacts(SEQ, rows=rows, layer_passes=passes))
    assert fresh.microbatches == 8  # rows-bound layers: the finest split steps fastest
    kept = RunFacts(SEQ, rows=rows, checkpointed=saved)
    assert measurements_needed(options, kept) is None
    plan = decide(options, kept)
    assert plan.microbatches == 2
    assert _said(plan)["microbatches"] == (
        "N=2 (as the checkpointed run chose it, so that the resumed run trains as it did)"
    )
    for other in ({"stages": 4}, {"schedule": "gpipe"}, {"microbatches": 16}):
        facts = RunFacts(SEQ, rows=rows, layer_passes=passes, checkpointed={**saved, **other})
        assert decide(options, facts).microbatches == 8
    # N given is the user's, whatever the checkpoint ran
    given = PipelineOptions(stages=2, schedule="1f1b", balance="even", microbatches=4)
    assert decide(given, kept).microbatches == 4
