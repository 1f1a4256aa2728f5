"""The one decision point: what a pipelined run does and why, from plain facts.

The strategy stores what the user asked (:class:`PipelineOptions`); at the first batch its
runner measures and reads what the run is made of (:class:`RunFacts`: the layers' times at the
microbatch sizes the candidate layouts would run, the planner's profile, the first batch's
rows, the model's kind, the optimiser, the process layout, the run's length) and hands both
to :func:`decide`, which needs no model, Trainer or process group. It returns one frozen
:class:`RunPlan`: P, N, the cut, compilation, how microbatch losses are weighted and the run's
settings (:class:`~pipemare.optim.settings.RunSettings`: the corrections, T1's horizon and every
decision with its reason), printed at the run's start and stored in its checkpoints. The
runner executes it and decides nothing.

Every layout default lives here:

- P: given, one per process, or in one process one per layer;
- N (``microbatches="auto"``): as the checkpointed run of the same schedule and P ran it;
  else on a schedule that never flushes :func:`auto_microbatches` (N = P); on ``gpipe`` and
  ``1f1b`` the divisor of the batch whose step, replayed from each layer's measured forward
  and backward at that N, is the fastest (N = 1 for a model with BatchNorm, whose statistics
  microbatches would change);
- the cut: as the checkpointed run cut it, given, even, by parameters, by measured time
  (:data:`~pipemare.model.partition.TIME_TOLERANCE`) or the planner's
  (:func:`~pipemare.planner.search.best_cut`);
- the microbatches' weights: a Hugging Face model's label tokens, else rows;
- the calls of a module cut into segments (the key/value cache switched off);
- a last batch smaller than N.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pipemare.engine.layout import divisors
from pipemare.engine.link import Link
from pipemare.engine.microbatch import check_splits, token_shares
from pipemare.model import partition
from pipemare.optim.config import PipeMareConfig
from pipemare.optim.settings import Decision, RunSettings, resolve
from pipemare.planner.cost import replayed_step_time
from pipemare.planner.measurements import Overhead, Profile
from pipemare.planner.reference import ReferenceQuality, measured_layouts, measured_quality
from pipemare.planner.search import best_cut
from pipemare.schedule.actions import spec

__all__ = [
    "Advice",
    "LeanBuild",
    "ModelFacts",
    "PipelineOptions",
    "RunFacts",
    "RunPlan",
    "auto_microbatches",
    "decide",
    "measurements_needed",
    "microbatch_candidates",
    "microbatches_to_measure",
    "optimizer_family",
    "overheads_to_measure",
    "trained_per_stage",
]

#: how each microbatch's loss is weighted: a function from the microbatches to their shares
Weights = Callable[[list[Any]], list[float]]


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """The strategy's arguments as given (see :class:`~pipemare.PipeMareStrategy`):
    ``"auto"`` and None still mean "decide at the first batch"."""

    stages: int | None = None
    microbatches: int | str = "auto"
    schedule: str = "pipemare"
    balance: list[int] | str = "time"
    config: PipeMareConfig | None = None
    module: str | None = None
    split_points: list[str] | None = None
    dynamic_shapes: str = "auto"
    recompute: bool = False
    #: ``torch.compile``'s options for each stage (None: not compiled unless the user's
    #: module was)
    compile: dict[str, Any] | None = None
    microbatch_weights: str | Weights = "auto"
    stall_timeout: float = 300.0
    heartbeat_timeout: float | None = 30.0
    simulated_link: Link | None = None
    #: time the user's layers at every N 1F1B could run and say which schedule reaches the
    #: quality sooner (:class:`Advice`)
    advise: bool = True
    #: a file of one device's weights each process reads its own stage's tensors from
    weights: str | None = None
    #: bytes a stage may hold on a CPU (a CUDA device's are read from it); None: unchecked
    memory_limit: int | None = None
    #: checkpoints as per-stage shards (True), one file of the whole model (False), or None:
    #: shards where each process holds only its own stage (a model built on the meta device)
    save_distributed_checkpoint: bool | None = None
    #: count the bytes each stage's in-flight microbatches keep (a Python hook per saved tensor)
    measure_activations: bool = False


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the pipelined model is, as far as the decisions need it.

    Attributes:
        what: its name in messages (``"Net.layers"``, ``"GPT2LMHeadModel"``).
        layers: layers of the Sequential the pipeline cuts (segments, for a traced module).
        traced_seconds: for a module that is not a Sequential, how long tracing and cutting it
            into segments took; None for a Sequential.
        eval_traced: its eval-mode graph was traced with the train one (else when something
            first evaluates: a fit in one process that does not validate).
        cache_switched: its segments' calls get ``use_cache=False``.
        config_use_cache: its config's own ``use_cache``, kept as it is (None: no such field).
        label_shift: for a Hugging Face model, how its loss shifts the labels (1: a causal LM,
            0: other); None for other models.
        user_compiled: how the user compiled it (``"torch.compile"``, ``"compile()"``), or None.
        layer_params: parameters of each layer, for ``balance="params"``.
        layer_trained: the parameters of each layer that train (``requires_grad``): what a
            stage's update works on.
        layer_tensors: the tensors of each layer that train: what a stage's update is
            dispatched over (empty: not known, and charged as one a stage).
        batch_statistics: it normalises over its batch (BatchNorm), so microbatches change
            what it computes (read from the user's module, not the cut: a traced model's
            segments hold plain modules where its BatchNorms were).
        gradient_checkpointing: a module in it has Hugging Face's gradient checkpointing on
            (``model.gradient_checkpointing_enable()``).
        halved: why its blocks were cut in two as well as around, or "" where they were not.
    """

    what: str
    layers: int
    traced_seconds: float | None = None
    eval_traced: bool = True
    cache_switched: bool = False
    config_use_cache: bool | None = None
    label_shift: int | None = None
    user_compiled: str | None = None
    layer_params: tuple[int, ...] = ()
    layer_trained: tuple[int, ...] = ()
    layer_tensors: tuple[int, ...] = ()
    batch_statistics: bool = False
    gradient_checkpointing: bool = False
    halved: str = ""


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What was measured or read before the pipeline is built: plain values only.

    Attributes:
        model: what the pipelined model is.
        rows: samples in the first batch.
        process_stages: P where the processes fix it (one stage per process, or ``stages``
            given with several processes); None in one process.
        replicas: D, data-parallel copies of the pipeline.
        layer_passes: seconds of each layer's forward and of its backward pass, keyed by the
            rows of the microbatch they were measured on (:func:`microbatches_to_measure`), for
            ``balance="time"`` and a flushing schedule's ``"auto"`` N. In a training run the
            first layer's forward carries the step's code before the model, and the last
            layer's passes its head (the loss, metrics and logs on the model's output), which
            run on those stages once per microbatch.
        profile: the planner's profile of the layers, for ``balance="auto"``.
        checkpointed: the layout of the run a checkpoint continues (``stages``, ``balance``).
        optimizer: the user's optimiser (its parameter groups decide the corrections' "auto"
            settings); None where there is none (evaluation).
        total_steps: the run's optimiser steps, where known.
        steps_per_epoch: optimiser steps per epoch, where known.
        short_last_batches: ``(last, samples, batch size)`` of each training loader whose last
            batch is smaller than the others.
        fitting: whether the run trains (evaluation applies no corrections).
        previous: ``(stages, microbatches, balance)`` of this run's earlier pipeline (a rebuild
            after fit, for test, runs the same layout); None at the first build.
        overheads: per schedule, the engine's own seconds per forward, backward and update
            action whatever the layers, per trained parameter in an update and in a delayed
            stage's forward, and per trained tensor in an update, a forward and a backward
            (:func:`~pipemare.planner.engine_overhead`): a replay adds the fixed seconds to
            each stage's layers and charges the rates times the parameters and tensors the
            stage trains (:attr:`ModelFacts.layer_trained`, :attr:`ModelFacts.layer_tensors`);
            a schedule without one replays the layers alone.
        built: the model was built on the meta device and each process made only its own
            stage real at setup (:class:`LeanBuild`): the cut was taken then, and no process
            holds every layer to time.
        sample: in a fit, the batch the plan was made from (the first training batch, read
            before the sanity check), with why where it is another; None outside fit.
        layer_out_bytes: bytes of each layer's output, keyed like :attr:`layer_passes`: what a
            microbatch carries across a cut after that layer (its gradient, the same size,
            comes back).
        links: the links between neighbouring stages' processes (``links[i]`` joins stages
            ``i`` and ``i + 1``), measured at setup or simulated; the replays carry each
            message across them. None: communication taken as free (one process).
        links_why: how :attr:`links` were found.
    """

    model: ModelFacts
    rows: int
    process_stages: int | None = None
    replicas: int = 1
    layer_passes: Mapping[int, tuple[tuple[float, float], ...]] = dataclasses.field(
        default_factory=dict
    )
    profile: Profile | None = None
    checkpointed: Mapping[str, Any] | None = None
    optimizer: torch.optim.Optimizer | None = None
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    short_last_batches: tuple[tuple[int, int, int], ...] = ()
    fitting: bool = True
    previous: tuple[int, int, tuple[int, ...]] | None = None
    overheads: Mapping[str, Overhead] = dataclasses.field(default_factory=dict)
    built: LeanBuild | None = None
    sample: str | None = None
    layer_out_bytes: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    links: tuple[Link, ...] | None = None
    links_why: str = ""


@dataclasses.dataclass(frozen=True)
class LeanBuild:
    """A model built on the meta device, cut at setup, each process's stage made real there.

    Attributes:
        balance: layers per stage, as cut at setup.
        why: how the cut was chosen.
        init: how this process's stage got its values: ``"reset_parameters"`` (each module's
            own), ``"init_weights"`` (the model's hook) or ``"file"`` (one device's weights,
            read a stage at a time).
    """

    balance: tuple[int, ...]
    why: str
    init: str

    def decisions(self) -> list[Decision]:
        """What the lean build decided, for the run's first lines."""
        how = {
            "reset_parameters": "each module's reset_parameters()",
            "init_weights": "the model's init_weights(), run over every stage's layers (the "
            "other stages' on the meta device, where it does nothing)",
            "file": "read from the weights file, this stage's tensors only",
        }[self.init]
        return [
            Decision(
                "build",
                "each process holds only its own stage",
                "the model was built on the meta device (configure_model or "
                "init_module(empty_init=True)); this process gave real storage to its own "
                f"stage's layers only, initialised by {how}",
            ),
            Decision(
                "advice",
                "not measured",
                "timing every layer needs the whole model in one process, which a model built "
                "on the meta device never has",
            ),
        ]


@dataclasses.dataclass(frozen=True)
class Advice:
    """Which schedule reaches the quality sooner on this model and device: the run's step and
    1F1B's at its fastest N, replayed from the layers measured here, and the steps to quality
    measured on reference tasks.

    The steps a schedule needs to reach one device's quality cannot be measured before the
    model trains, so they are read from reference tasks (:mod:`pipemare.planner.reference`):
    on each, the run's time to quality as a multiple of 1F1B's is :attr:`ratio` times the
    reference's ``steps_ratio`` (1F1B computes one device's steps, so its own is 1). The rule:

    - no reference measured the run's schedule with its optimiser family at its P and N: the
      advice says only which schedule steps sooner, and that the quality is not measured;
    - every reference names the same schedule: that one reaches the quality sooner;
    - they disagree (a short run and a long one can: staleness delays the escape from an early
      plateau, which a long run makes up): no schedule is named; the verdict says it depends
      on the task and run length and leads with the longest reference run (real training runs
      longer still), and every reference's figures are printed.

    A reference on which the schedule never came within 1% counts for 1F1B; a tie counts for
    the run's schedule.

    Attributes:
        schedule: the run's schedule, at N = ``microbatches``.
        microbatches: the run's N.
        step_s: its step, replayed.
        baseline_n: 1F1B's fastest N for the batch.
        baseline_s: 1F1B's step at that N, replayed.
        baseline_by_n: 1F1B's replayed step at each N it could run.
        stages: P.
        family: the optimiser's family (:func:`optimizer_family`); None where it has none.
        quality: the reference cells of this schedule, family, P and N, the longest run first;
            empty where none was measured.
        baseline_call: the strategy that runs 1F1B at its fastest N with this run's P and cut,
            as a user would write it.
    """

    schedule: str
    microbatches: int
    step_s: float
    baseline_n: int
    baseline_s: float
    baseline_by_n: Mapping[int, float]
    stages: int
    family: str | None = None
    quality: tuple[ReferenceQuality, ...] = ()
    baseline_call: str = ""

    @property
    def ratio(self) -> float:
        """The run's step as a multiple of 1F1B's at its fastest N."""
        return self.step_s / self.baseline_s

    @property
    def steps_sooner(self) -> str:
        """The schedule whose step is shorter (the run's on a tie)."""
        return self.schedule if self.ratio <= 1.0 else "1f1b"

    def time_ratio(self, reference: ReferenceQuality) -> float | None:
        """The run's time to quality as a multiple of 1F1B's, with ``reference``'s steps
        (None: the schedule never reached the quality there)."""
        if reference.steps_ratio is None:
            return None
        return self.ratio * reference.steps_ratio

    def sooner_on(self, reference: ReferenceQuality) -> str:
        """The schedule that reaches the quality sooner with ``reference``'s steps."""
        time = self.time_ratio(reference)
        return self.schedule if time is not None and time <= 1.0 else "1f1b"

    @property
    def sooner(self) -> str | None:
        """The schedule every reference says reaches the quality sooner; None where none was
        measured or they disagree."""
        named = {self.sooner_on(r) for r in self.quality}
        return named.pop() if len(named) == 1 else None

    @property
    def names(self) -> str | None:
        """The schedule the verdict names: the one reaching the quality sooner where the
        references measured it, else the one stepping sooner; None where they disagree."""
        return self.sooner if self.quality else self.steps_sooner

    @property
    def longest(self) -> ReferenceQuality | None:
        """The reference with the longest run (the first of them on a tie), or None."""
        return max(self.quality, key=lambda r: r.steps, default=None)

    @property
    def verdict(self) -> str:
        """What the run's first lines say (the advice's choice)."""
        if not self.quality:
            return f"{self.steps_sooner} steps sooner; quality not measured"
        if self.sooner is not None:
            return f"{self.sooner} reaches the quality sooner"
        longest = self.longest
        assert longest is not None
        return (
            f"depends on the task and run length; on the longest reference run, "
            f"{longest.label}, {self.sooner_on(longest)} reaches the quality sooner"
        )


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What the run does, decided once by :func:`decide`.

    Attributes:
        stages: P.
        microbatches: N.
        balance: layers per stage.
        compile: ``torch.compile``'s options for each stage, or None (not compiled).
        weights: each microbatch's share of its batch's loss (None: by rows).
        settings: the schedule, layout and corrections with every decision and its reason.
        advice: which schedule reaches the quality sooner on this model and device (None where
            the run does not say: a flushing schedule, evaluation, ``advise=False``,
            ``balance="auto"``).
        recompute: every stage but the last keeps only its inputs and reruns its forward at
            backward time (asked for, or Hugging Face's gradient checkpointing honoured).
    """

    stages: int
    microbatches: int
    balance: tuple[int, ...]
    compile: dict[str, Any] | None
    weights: Weights | None
    settings: RunSettings
    advice: Advice | None = None
    recompute: bool = False

    @property
    def decisions(self) -> tuple[Decision, ...]:
        """Every choice taken on the user's behalf, with its reason, in the order printed."""
        return self.settings.decisions


def auto_microbatches(schedule: str, stages: int, rows: int | None = None) -> tuple[int, Decision]:
    """``microbatches="auto"``: N for ``schedule`` at P = ``stages``, with the decision's reason.

    On a schedule that never flushes, stage ``i`` runs a microbatch on weights
    ``ceil((P - 1 - i - r)/N)`` updates old (:mod:`pipemare.schedule.delay`); N = P is the
    smallest N that keeps every stage's mean delay, ``(P - 1 - i)/N``, under one update and none
    above one. N = 1 is the worst measured default (issue 40: a GPT at P = 2 and N = 1 ends
    +17% over one device, +2.8% at N = 2; docs/results.md). ``rows``, the samples of the run's
    first batch, caps N: every microbatch keeps a sample (a smaller last batch does not: copies
    of weight 0 fill its slots, :func:`~pipemare.engine.microbatch.scatter_filled`).
    A flushing schedule has no delay to bound: here it gets N = 1, which :func:`decide` keeps
    only where it cannot replay the candidates (BatchNorm, the planner's cut); elsewhere it takes
    the N whose replayed step is fastest.

    Example:
        >>> auto_microbatches("pipemare", 4)[0], auto_microbatches("pipemare", 8, rows=6)[0]
        (4, 6)
        >>> auto_microbatches("1f1b", 4)[1].choice
        'N=1'
    """
    if spec(schedule).flushes:
        why = (
            "a flushing schedule has no delay to bound; pass microbatches=N to shrink its "
            "bubble (P-1)/(N+P-1)"
        )
        return 1, Decision("microbatches", "N=1", why)
    if stages <= 1:
        return 1, Decision("microbatches", "N=1", "one stage: no delay")
    n = stages if rows is None else max(1, min(stages, rows))
    late = (stages - 1) / n
    worst = math.ceil((stages - 1) / n)
    bound = (
        f"the r-th microbatch of a step reaches stage i on weights ceil((P-1-i-r)/N) updates "
        f"old: at most {worst}, {late:.2g} on average at the first stage"
    )
    why = (
        f"N = P: no microbatch more than one update stale ({bound}); N = 1 would make them up "
        "to P - 1 updates stale"
    )
    if n < stages:
        why = (
            f"as many as the smallest batch's {rows} sample(s) allow (N = P = {stages} would "
            f"keep every microbatch within one update): {bound}"
        )
    return n, Decision("microbatches", f"N={n}", why)


def _stages(options: PipelineOptions, facts: RunFacts) -> tuple[int, list[Decision]]:
    """P, and how it was chosen where the user left it open."""
    if facts.process_stages is not None:
        stages = facts.process_stages
    elif options.stages is not None:
        stages = options.stages
    else:
        stages = facts.model.layers
    if options.stages is not None:
        return stages, []
    per = "process" if facts.process_stages is not None else "layer of the pipelined model"
    return stages, [Decision("stages", f"P={stages}", f"one per {per}")]


def _microbatches(
    options: PipelineOptions, facts: RunFacts, stages: int
) -> tuple[int, list[Decision]]:
    """N: as given, as this run's earlier pipeline ran it, or ``"auto"`` chosen for P and the
    first batch: for a flushing schedule, by replaying the measured passes at each N."""
    if facts.previous is not None:
        return facts.previous[1], []
    if isinstance(options.microbatches, int):
        return options.microbatches, []
    saved = _checkpointed_microbatches(options, facts, stages)
    if saved is not None:
        return saved
    if _replays(options, facts, stages):
        return _fastest_microbatches(options, facts, stages)
    if spec(options.schedule).flushes and stages > 1 and facts.built is not None:
        return _unmeasured_flushing(facts.rows, stages)
    n, decision = auto_microbatches(options.schedule, stages, facts.rows)
    if spec(options.schedule).flushes and stages > 1 and facts.model.batch_statistics:
        why = (
            f"{facts.model.what} has BatchNorm, which normalises over what it is given: N = 1 "
            "keeps one device's batch statistics (pass microbatches=N to shrink the bubble)"
        )
        decision = Decision("microbatches", "N=1", why)
    return n, [decision]


def _checkpointed_microbatches(
    options: PipelineOptions, facts: RunFacts, stages: int
) -> tuple[int, list[Decision]] | None:
    """``"auto"`` N in a run that continues a checkpoint of the same schedule and P: the N that
    run chose (a flushing schedule's came from timings, which a resume could read otherwise);
    None elsewhere, or where the first batch is smaller than it."""
    saved = facts.checkpointed
    if not saved or not isinstance(options.microbatches, str):
        return None
    same = saved.get("stages") == stages and saved.get("schedule") == options.schedule
    n = saved.get("microbatches")
    if not (same and isinstance(n, int) and 1 <= n <= facts.rows):
        return None
    why = "as the checkpointed run chose it, so that the resumed run trains as it did"
    return n, [Decision("microbatches", f"N={n}", why)]


def _unmeasured_flushing(rows: int, stages: int) -> tuple[int, list[Decision]]:
    """A flushing schedule's N where no process can time every layer (a lean build): the
    largest divisor of the batch up to 2P, whose bubble (P-1)/(N+P-1) is then at most a third.

    Example:
        >>> _unmeasured_flushing(32, 4)[0], _unmeasured_flushing(6, 4)[0]
        (8, 6)
    """
    n = max(d for d in divisors(rows) if d <= 2 * stages)
    why = (
        "not timed: no process holds every layer of a model built on the meta device; the "
        f"largest divisor of the batch up to 2P, a bubble of (P-1)/(N+P-1) = "
        f"{(stages - 1) / (n + stages - 1):.0%} (pass microbatches=N to choose)"
    )
    return n, [Decision("microbatches", f"N={n}", why)]


def _replays(options: PipelineOptions, facts: RunFacts, stages: int) -> bool:
    """Whether ``"auto"`` N is the fastest replayed one: a flushing schedule (its bubble
    shrinks with N, its actions multiply) over several stages, whose model keeps no batch
    statistics, cut other than by the planner (which models its own N), at its first build,
    continuing no checkpoint of the same layout (whose N it keeps)."""
    return (
        isinstance(options.microbatches, str)
        and spec(options.schedule).flushes
        and stages > 1
        and not facts.model.batch_statistics
        and options.balance != "auto"
        and facts.previous is None
        and facts.built is None
        and _checkpointed_microbatches(options, facts, stages) is None
    )


def _replayed_steps(
    options: PipelineOptions,
    facts: RunFacts,
    stages: int,
    schedule: str,
    ns: Sequence[int],
) -> dict[int, float]:
    """Each N's step under ``schedule``, replayed
    (:func:`~pipemare.planner.cost.replayed_step_time`): the layers cut at that N as the
    options cut them, each stage's forward and backward the sums of its layers' measured at
    that N's microbatch plus the engine's own seconds per action
    (:attr:`RunFacts.overheads`), its update the engine's fixed cost plus its rate per
    parameter times the parameters the stage trains and its rate per tensor times the tensors
    (the optimiser's and the corrections' arithmetic and dispatch: once a step whatever N; an
    asynchronous schedule's last stage, which has no delay, at its own rates), and a delayed
    stage's forward (every stage but an asynchronous schedule's last) the forward's rate per
    parameter on top (weight prediction: once a microbatch), and every stage's forward and
    backward their rates per tensor (the engine's work on each weight around a pass). Where
    :attr:`RunFacts.links` are known, each microbatch's activations and gradients cross them
    (the bytes of the last layer before each cut); otherwise communication is free."""
    overhead = facts.overheads.get(schedule, Overhead(0.0, 0.0, 0.0))
    trained = facts.model.layer_trained
    tensors = facts.model.layer_tensors
    # the last stage of an asynchronous schedule runs without delay: nothing to predict
    delayed = stages if spec(schedule).flushes else stages - 1
    replayed = {}
    for n in ns:
        cut, _ = _layers_per_stage(options, facts, stages, n)
        rows = microbatch_rows(facts.rows, n)
        passes = _passes_at(facts, rows)
        bounds = [0, *itertools.accumulate(cut)]
        durations = []
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            forward, backward, update = overhead.charge(
                sum(trained[a:b]), i < delayed, sum(tensors[a:b]) if tensors else 1
            )
            stage = passes[a:b]
            durations.append(
                (forward + sum(f for f, _ in stage), backward + sum(b_ for _, b_ in stage), update)
            )
        out = facts.layer_out_bytes.get(rows)
        if facts.links is not None and out is not None and len(facts.links) == stages - 1:
            sizes = [out[b - 1] for b in bounds[1:-1]]
            replayed[n] = replayed_step_time(schedule, durations, n, facts.links, sizes)
        else:
            replayed[n] = replayed_step_time(schedule, durations, n)
    return replayed


def _links(facts: RunFacts, stages: int) -> list[Decision]:
    """The links the replays carry messages across, where they were found."""
    if facts.links is None or len(facts.links) != stages - 1 or not facts.layer_out_bytes:
        return []
    shown = "; ".join(f"{i}-{i + 1}: {link}" for i, link in enumerate(facts.links))
    return [Decision("links", shown, facts.links_why)]


def _shown(replayed: Mapping[int, float]) -> str:
    return ", ".join(f"N={n}: {t * 1e3:.3g} ms" for n, t in sorted(replayed.items()))


def _fastest_microbatches(
    options: PipelineOptions, facts: RunFacts, stages: int
) -> tuple[int, list[Decision]]:
    """The N, among the divisors of the first batch, whose replayed step is the fastest
    (:func:`_replayed_steps`). Ties go to the smaller N."""
    replayed = _replayed_steps(options, facts, stages, options.schedule, divisors(facts.rows))
    best = min(replayed, key=lambda n: (replayed[n], n))
    why = (
        f"the fastest step of {options.schedule!r} for a batch of {facts.rows}, replayed from each "
        f"layer's measured forward and backward at each N ({_shown(replayed)})"
    )
    return best, [Decision("microbatches", f"N={best}", why)]


def optimizer_family(optimizer: torch.optim.Optimizer | None) -> str | None:
    """``"adam"`` (every group has Adam's betas), ``"muon"`` (Muon or Muon + AdamW),
    ``"sgdm"`` (SGD with momentum), or None."""
    if optimizer is None:
        return None
    name = type(optimizer).__name__.lower()
    groups = optimizer.param_groups
    if "muon" in name:
        return "muon"
    if groups and all("betas" in g for g in groups):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD) and all(g.get("momentum", 0) > 0 for g in groups):
        return "sgdm"
    return None


def _advises(options: PipelineOptions, facts: RunFacts, stages: int) -> bool:
    """Whether the run's first lines say which schedule steps sooner: an asynchronous
    schedule that trains over several stages, asked to, its layers timed (not the planner's
    profile), at its first build."""
    return (
        options.advise
        and facts.fitting
        and not spec(options.schedule).flushes
        and stages > 1
        and options.balance != "auto"
        and facts.previous is None
        and facts.built is None
    )


def _advice(
    options: PipelineOptions, facts: RunFacts, stages: int, microbatches: int
) -> tuple[Advice | None, list[Decision]]:
    """The run's step against 1F1B's at its fastest N, both replayed from the layers measured
    here (at each N whose microbatch was measured: :func:`microbatches_to_measure` asks for
    every divisor of the batch), with the steps to quality the reference tasks measured for
    this schedule, optimiser family, P and N; the verdict follows :class:`Advice`'s rule."""
    measured = [
        n for n in divisors(facts.rows) if microbatch_rows(facts.rows, n) in facts.layer_passes
    ]
    own_measured = microbatch_rows(facts.rows, microbatches) in facts.layer_passes
    if not (_advises(options, facts, stages) and own_measured and measured):
        return None, []
    schedule = options.schedule
    own = _replayed_steps(options, facts, stages, schedule, (microbatches,))[microbatches]
    base = _replayed_steps(options, facts, stages, "1f1b", measured)
    best = min(base, key=lambda n: (base[n], n))
    family = optimizer_family(facts.optimizer)
    advice = Advice(
        schedule,
        microbatches,
        own,
        best,
        base[best],
        base,
        stages,
        family,
        measured_quality(schedule, family, stages, microbatches),
        _baseline_call(options, stages, best),
    )
    why = (
        "a step replayed from this model's layers and its training step's code around them, "
        f"as measured on this device: {schedule!r} at "
        f"N={microbatches} {own * 1e3:.3g} ms, '1f1b' at its fastest N={best} "
        f"{base[best] * 1e3:.3g} ms ({_shown(base)}): {advice.ratio:.2f}x 1F1B's step; "
        + _quality_said(advice)
    )
    if advice.names != schedule:
        why += (
            f"; {advice.baseline_call}, with the run's other arguments, runs 1F1B at its fastest N"
        )
    return advice, [Decision("advice", advice.verdict, why)]


def _baseline_call(options: PipelineOptions, stages: int, microbatches: int) -> str:
    """The strategy a user writes to run 1F1B at ``microbatches`` with this run's P and cut.

    Example:
        >>> _baseline_call(PipelineOptions(), 4, 8)
        "PipeMareStrategy(stages=4, schedule='1f1b', microbatches=8)"
        >>> _baseline_call(PipelineOptions(balance=[3, 1]), 2, 1)
        "PipeMareStrategy(stages=2, schedule='1f1b', microbatches=1, balance=[3, 1])"
    """
    args = [f"stages={stages}", "schedule='1f1b'", f"microbatches={microbatches}"]
    if options.balance != PipelineOptions.balance:
        args.append(f"balance={options.balance!r}")
    return f"PipeMareStrategy({', '.join(args)})"


def _quality_said(advice: Advice) -> str:
    """The steps to quality behind the verdict: each reference task's, or why there is none."""
    schedule, family = advice.schedule, advice.family
    where = f"{schedule!r} at P={advice.stages}, N={advice.microbatches}"
    if not advice.quality:
        if family is None:
            missing = f"{where} with an optimiser outside the measured families"
        else:
            layouts = measured_layouts(schedule, family)
            at = ", ".join(f"P={p} N={n}" for p, n in layouts)
            missing = f"{where} with the {family} family" + (
                f" (measured at {at})" if at else f" (nor {schedule!r} with it anywhere)"
            )
        return (
            f"quality not measured: no reference task ran {missing}, so which schedule reaches "
            "the quality sooner is not known, only which steps sooner"
        )
    each = []
    for r in advice.quality:
        time = advice.time_ratio(r)
        steps = "never within 1%" if r.steps_ratio is None else f"{r.steps_ratio:.2f}x the steps"
        reached = "1F1B sooner" if time is None else f"{time:.2f}x 1F1B's time"
        each.append(
            f"{r.label}, {r.what}, {r.seeds} seed{'s' * (r.seeds != 1)}: {steps}, final loss "
            f"{r.loss_gap:+.1%} at equal steps; {reached}"
        )
    said = (
        f"quality from reference tasks, not this model: the steps {where} with the {family} "
        "family took to come within 1% of one device's final validation loss, over one "
        f"device's (1F1B computes one device's steps), times the step ratio: {'. '.join(each)}"
    )
    if advice.sooner is None:
        said += "; the reference tasks disagree: it depends on the task and run length"
    return said


def _passes_at(facts: RunFacts, rows: int) -> tuple[tuple[float, float], ...]:
    """The layers' measured (forward, backward) seconds on a microbatch of ``rows``."""
    passes = facts.layer_passes.get(rows)
    if passes is None:
        raise ValueError(
            f"the decisions need the layers' times on a microbatch of {rows} rows; measured at "
            f"{sorted(facts.layer_passes)}"
        )
    return passes


def microbatches_to_measure(options: PipelineOptions, facts: RunFacts) -> tuple[int, ...]:
    """The N of each candidate layout, whose first microbatch the layers are timed on (the
    runner measures there and passes the times as :attr:`RunFacts.layer_passes`).

    Example:
        >>> facts = RunFacts(ModelFacts("Net.layers", layers=6), rows=8)
        >>> microbatches_to_measure(PipelineOptions(stages=4, advise=False), facts)
        (4,)
        >>> microbatches_to_measure(PipelineOptions(stages=4), facts)  # advice: 1F1B's too
        (1, 2, 4, 8)
        >>> microbatches_to_measure(PipelineOptions(stages=4, schedule="1f1b"), facts)
        (1, 2, 4, 8)
    """
    stages, _ = _stages(options, facts)
    if _replays(options, facts, stages):
        return divisors(facts.rows)
    own = _microbatches(options, facts, stages)[0]
    if _advises(options, facts, stages):
        # BatchNorm cannot train on one row: 1F1B's candidates keep two or more
        least = 2 if facts.model.batch_statistics else 1
        candidates = [n for n in divisors(facts.rows) if facts.rows // n >= least]
        return tuple(sorted({*candidates, *([own] if own <= facts.rows else [])}))
    return (own,)


def overheads_to_measure(options: PipelineOptions, facts: RunFacts) -> tuple[str, ...]:
    """The schedules whose engine seconds per action (:attr:`RunFacts.overheads`) a
    replay needs: the run's own, for a flushing schedule's ``"auto"`` N, and 1F1B's too where
    the run says which steps sooner."""
    stages, _ = _stages(options, facts)
    if _replays(options, facts, stages):
        return (options.schedule,)
    if _advises(options, facts, stages):
        return (options.schedule, "1f1b")
    return ()


def trained_per_stage(options: PipelineOptions, facts: RunFacts) -> int | None:
    """About the parameters a stage trains (the model's over P): the size the engine's costs
    per parameter are measured at (:func:`~pipemare.planner.engine_overhead`); None where
    the layers' trained parameters are not known.

    Example:
        >>> facts = RunFacts(ModelFacts("Net.layers", layers=4, layer_trained=(5, 5, 5, 1)), 8)
        >>> trained_per_stage(PipelineOptions(stages=2), facts)
        8
    """
    if not facts.model.layer_trained:
        return None
    stages, _ = _stages(options, facts)
    return sum(facts.model.layer_trained) // max(stages, 1)


def microbatch_candidates(options: PipelineOptions, stages: int) -> tuple[int, ...]:
    """Every N the run may take at P = ``stages`` before its first batch is seen: the given
    one, or each ``"auto"`` may choose (the first batch's rows can cap it anywhere below P),
    the uncapped choice first.

    Example:
        >>> microbatch_candidates(PipelineOptions(), 3)
        (3, 1, 2)
        >>> microbatch_candidates(PipelineOptions(schedule="gpipe"), 3)
        (1,)
    """
    if isinstance(options.microbatches, int):
        return (options.microbatches,)
    uncapped = auto_microbatches(options.schedule, stages)[0]
    return (uncapped, *(n for n in range(1, uncapped) if n != uncapped))


def measurements_needed(
    options: PipelineOptions, facts: RunFacts
) -> tuple[str, tuple[int, ...]] | None:
    """What the runner must measure before :func:`decide` can choose N and cut the layers:
    ``("time", Ns)`` each layer's forward and backward on the first microbatch at each N,
    ``("auto", Ns)`` the planner's profile there; None where neither needs a measurement
    (N given, fixed or the checkpointed run's, and the cut given, even, by parameters, one
    layer per stage, or as an earlier pipeline or the checkpointed run cut it).

    Example:
        >>> facts = RunFacts(ModelFacts("Net.layers", layers=6), rows=32)
        >>> measurements_needed(PipelineOptions(stages=2, advise=False), facts)
        ('time', (2,))
        >>> measurements_needed(PipelineOptions(stages=2, balance="even", advise=False), facts)
        >>> measurements_needed(PipelineOptions(stages=2, balance="even"), facts)
        ('time', (1, 2, 4, 8, 16, 32))
    """
    stages, _ = _stages(options, facts)
    if _replays(options, facts, stages) or _advises(options, facts, stages):
        # N, or the advice, is chosen from the passes, whatever the cut
        return "time", microbatches_to_measure(options, facts)
    balance, saved = options.balance, facts.checkpointed
    if facts.previous is not None or facts.built is not None or not isinstance(balance, str):
        return None
    if (saved and saved["stages"] == stages) or stages == facts.model.layers:
        return None
    if balance not in ("time", "auto"):
        return None
    return balance, microbatches_to_measure(options, facts)


def microbatch_rows(rows: int, microbatches: int) -> int:
    """Rows of the first of ``microbatches`` microbatches of a batch of ``rows``."""
    return -(-rows // microbatches)


def _layers_per_stage(
    options: PipelineOptions, facts: RunFacts, stages: int, microbatches: int
) -> tuple[list[int], list[Decision]]:
    """Layers per stage: as an earlier pipeline of this run or the run a checkpoint continues
    cut them, given, or chosen now, and why where the user left it open."""
    balance, layers = options.balance, facts.model.layers
    if facts.previous is not None:  # a rebuild (after fit, for test) cuts as the first build
        return list(facts.previous[2]), []
    if facts.built is not None:  # cut at setup, where each process made its stage real
        return list(facts.built.balance), [
            _cut_said(facts.built.balance, facts.built.why),
            *facts.built.decisions(),
        ]
    saved = facts.checkpointed
    if isinstance(balance, str) and saved and saved["stages"] == stages:
        return list(saved["balance"]), [
            _cut_said(saved["balance"], "as the checkpointed run cut it")
        ]
    if not isinstance(balance, str):
        return list(balance), []
    if stages == layers:
        cut, why = partition.even_balance(layers, stages), "one layer per stage"
    elif balance == "even":
        cut, why = partition.even_balance(layers, stages), "balance='even'"
    elif balance == "params":
        cut = partition.balance_by_cost(facts.model.layer_params, stages)
        why = "balance='params'"
    elif balance == "auto":
        if facts.profile is None:
            raise ValueError("balance='auto' needs the planner's profile of the layers")
        cut = best_cut(facts.profile, stages, microbatches, options.schedule)
        why = "balance='auto': the planner's cut from a profile of the layers"
    else:
        passes = _passes_at(facts, microbatch_rows(facts.rows, microbatches))
        times = [forward + backward for forward, backward in passes]
        cut = partition.balance_by_cost(times, stages, tolerance=partition.TIME_TOLERANCE)
        why = (
            "balance='time': from each layer's time on the first microbatch, the most even cut "
            f"whose slowest stage is within {partition.TIME_TOLERANCE:.0%} of the fastest cut's"
        )
    return cut, [_cut_said(cut, why)]


def _cut_said(cut: Sequence[int], why: str) -> Decision:
    return Decision("layers per stage", str(list(cut)), why)


def _segments(model: ModelFacts) -> list[Decision]:
    """How a module that is not a Sequential was cut, and what its calls get that the user's
    step does not pass."""
    if model.traced_seconds is None:
        return []
    out = [
        Decision(
            "segments",
            f"{model.layers}, traced and cut in {model.traced_seconds:.1f} s",
            f"{model.what} is not an nn.Sequential: torch.export traced its forward at the "
            "first batch"
            + (
                ""
                if model.eval_traced
                else " in train mode; this fit does not validate, so eval mode is traced when "
                "something first evaluates"
            )
            + (f"; {model.halved}" if model.halved else ""),
        )
    ]
    if not model.cache_switched:
        return out
    kept = model.config_use_cache
    why = (
        "a key/value cache for generation cannot travel between stages and training does not "
        "read it" + (f"; its config keeps use_cache={kept}" if kept is not None else "")
    )
    return [*out, Decision("use_cache", f"False in {model.what}'s calls", why)]


def _recompute(options: PipelineOptions, model: ModelFacts) -> tuple[bool, list[Decision]]:
    """Whether stages recompute: as asked, or where the model has Hugging Face's gradient
    checkpointing on. Its per-layer checkpoints do not survive the trace (torch.export inlines
    them: the traced stage would keep every activation), so the run honours it per stage."""
    if options.recompute or not model.gradient_checkpointing:
        return options.recompute, []
    why = (
        f"{model.what} has Hugging Face's gradient checkpointing on "
        "(gradient_checkpointing_enable()); its per-layer checkpoints do not survive the "
        "trace, so pipemare recomputes per stage instead (recompute=True)"
    )
    choice = "on: every stage but the last keeps its input only and reruns at backward time"
    return True, [Decision("recompute", choice, why)]


def _compiled(
    options: PipelineOptions, model: ModelFacts
) -> tuple[dict[str, Any] | None, list[Decision]]:
    """``torch.compile``'s options for each stage (None: not compiled), and the decision."""
    asked, user = options.compile, model.user_compiled
    if asked is None and not user:
        return None, []
    shown = ", ".join(f"{k}={v!r}" for k, v in (asked or {}).items()) or "its defaults"
    choice = f"each stage's forward, torch.compile with {shown}"
    if user:
        call = "torch.compile(...)" if user == "torch.compile" else f"{model.what}.compile()"
        why = (
            f"{model.what} was passed through {call}; a compiled whole cannot be cut, so each "
            "stage is compiled instead"
            + ("" if asked else " (compile={...} on the strategy chooses the options)")
        )
    else:
        why = "asked; the backward still sees the schedule's weights, with no weight copies"
    return asked or {}, [Decision("compile", choice, why)]


def _weights(options: PipelineOptions, model: ModelFacts) -> tuple[Weights | None, list[Decision]]:
    """How each microbatch's loss is weighted (None: by rows), and the decision."""
    asked = options.microbatch_weights
    tokens = "each microbatch's share of the batch's counted label tokens"
    if callable(asked):
        name = getattr(asked, "__name__", type(asked).__name__)
        return asked, [Decision("microbatch weights", f"from {name}", "microbatch_weights")]
    if asked == "rows":
        return None, []
    if asked == "tokens":
        why = "microbatch_weights='tokens': a loss that averages over the labels not -100"
        return token_shares(), [Decision("microbatch weights", tokens, why)]
    if model.label_shift is None:
        return None, []
    why = (
        "a Hugging Face loss averages over the label tokens that are not -100 (padding), "
        "so the minibatch's loss and gradient are one device's"
    )
    return token_shares(shift=model.label_shift), [Decision("microbatch weights", tokens, why)]


def _short_batches(facts: RunFacts, microbatches: int) -> list[Decision]:
    """Refuse training batches smaller than N; say how a smaller last batch runs."""
    check_splits(facts.rows, microbatches)
    decided = []
    for last, n, size in facts.short_last_batches:
        if last < microbatches:
            why = (
                f"{n} samples in batches of {size}: it runs a sample per microbatch, the "
                f"{microbatches - last} left are copies of weight 0 (nothing of theirs reaches "
                "the gradient or the logs); drop_last=True skips it"
            )
            decided.append(Decision("last batch", f"{last} sample(s) < N={microbatches}", why))
    return decided


def _stand_in() -> torch.optim.Optimizer:
    """An optimiser that never steps, for a run without one (evaluation)."""
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def _planned_from(facts: RunFacts) -> list[Decision]:
    """In a fit, the batch N, the cut and the measurements were taken from."""
    if facts.sample is None:
        return []
    what, _, why = facts.sample.partition(": ")
    return [
        Decision(
            "planned from",
            what,
            why or "read before the sanity check and still fed first to training_step",
        )
    ]


def _checkpoints(options: PipelineOptions, facts: RunFacts) -> list[Decision]:
    """How a fit's checkpoints are written: per-stage shards or one file, and why."""
    if not facts.fitting:
        return []
    shards, one = "per-stage shards, each process writing its own", "one file of the whole model"
    asked = options.save_distributed_checkpoint
    if asked is not None:
        return [Decision("checkpoints", shards if asked else one, "save_distributed_checkpoint")]
    if facts.built is not None and facts.process_stages is not None:
        why = (
            "no process holds the whole model (built on the meta device), and a file of it "
            "would gather it into one; `pipemare consolidate` makes one file from the shards"
        )
        return [Decision("checkpoints", shards, why)]
    holds = (
        "one process runs every stage"
        if facts.process_stages is None
        else ("every process built the whole model")
    )
    why = f"{holds}, so collecting it adds no new peak; save_distributed_checkpoint=True shards"
    return [Decision("checkpoints", one, why)]


def decide(options: PipelineOptions, facts: RunFacts) -> RunPlan:
    """The whole run's plan from what was asked and what was measured (see the module).

    Args:
        options: the strategy's arguments.
        facts: what the runner measured and read.

    Raises:
        ValueError: what was asked cannot run with these facts (a batch smaller than N, a
            correction the optimiser cannot serve), with what to do.

    Example:
        >>> facts = RunFacts(ModelFacts("Net.layers", layers=4), rows=8,
        ...                  layer_passes={4: ((0.3, 0.7),) * 3 + ((1.0, 2.0),)})
        >>> plan = decide(PipelineOptions(stages=2), facts)
        >>> plan.microbatches, plan.balance
        (2, (3, 1))
    """
    stages, decided = _stages(options, facts)
    microbatches, n_decided = _microbatches(options, facts, stages)
    cut, cut_decided = _layers_per_stage(options, facts, stages, microbatches)
    compiled, compile_decided = _compiled(options, facts.model)
    recompute, recompute_decided = _recompute(options, facts.model)
    weights, weights_decided = _weights(options, facts.model)
    short = _short_batches(facts, microbatches) if facts.fitting else []
    advice, advised = _advice(options, facts, stages, microbatches)
    layout = [
        *_planned_from(facts),
        *_segments(facts.model),
        *recompute_decided,
        *compile_decided,
        *weights_decided,
        *n_decided,
        *short,
        *decided,
        *cut_decided,
        *_links(facts, stages),
        *advised,
        *_checkpoints(options, facts),
    ]
    optimizer = facts.optimizer if facts.optimizer is not None else _stand_in()
    settings = resolve(
        options.config,
        optimizer,
        schedule=options.schedule,
        stages=stages,
        microbatches=microbatches,
        replicas=facts.replicas,
        balance=cut,
        total_steps=facts.total_steps,
        steps_per_epoch=facts.steps_per_epoch,
        layout=layout,
    )
    return RunPlan(stages, microbatches, tuple(cut), compiled, weights, settings, advice, recompute)
