"""The strategy's runner: builds the pipeline at the first batch, drives it, owns what it leaves.

It owns the model adapter and the user's steps, the pipeline (built at the first batch: timing
the layers needs one), the lagged reports and evaluation results, the telemetry the monitors
asked for, and the checkpoints in flight with the state a loaded checkpoint still has to give
the pipeline. It is given what it needs, and reads nothing back from the strategy: the
strategy's arguments (:class:`PipelineOptions`, at construction), this process's place in the
run (:class:`Placement`, at setup) and the user's optimisers once Lightning made them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from pipemare.engine.errors import NonFiniteGradientError, NonFiniteLossError
from pipemare.engine.lagged import DistributedResults, LocalResults, Results, result_lag
from pipemare.engine.layout import RankLayout
from pipemare.engine.link import Link
from pipemare.engine.link_probe import measure_links
from pipemare.engine.microbatch import batch_size, scatter
from pipemare.engine.pipeline import Pipeline
from pipemare.engine.telemetry import Probe
from pipemare.engine.transport import DistributedTransport
from pipemare.lightning import checkpoint, checks
from pipemare.lightning.checkpoint import Checkpoints
from pipemare.lightning.evaluation import Evaluation
from pipemare.lightning.hooks import GradientHooks, HookLogs, overridden_hooks, overrides
from pipemare.lightning.packages import LightningPackage
from pipemare.lightning.shards import read_local
from pipemare.lightning.steps import (
    ModuleAdapter,
    UserSteps,
    closes_epoch,
    merge_published,
    read_first_training_batch,
    run_length,
    short_last_batches,
)
from pipemare.lines import text
from pipemare.model import cuts, partition
from pipemare.model.materialize import (
    has_meta,
    init_method,
    load_stage_weights,
    materialize,
    replace_parameters,
    warn_on_meta_state,
    with_data,
)
from pipemare.optim.chain import ChainedOptimizer, copies_of
from pipemare.planner.decide import (
    LeanBuild,
    PipelineOptions,
    RunFacts,
    RunPlan,
    decide,
    measurements_needed,
    microbatch_candidates,
    overheads_to_measure,
    trained_per_stage,
)
from pipemare.planner.measurements import ForwardContext, Overhead
from pipemare.planner.stage_memory import (
    StageMemory,
    check_fits,
    most_in_flight,
    saved_bytes_per_microbatch,
    state_bytes_per_byte,
)
from pipemare.schedule.delay import StageDelay, derive_delays

__all__ = ["PipelineOptions", "PipelineRunner", "Placement", "stepped"]


#: The engine's own seconds per action (forward, backward, update) and its forward's and
#: update's seconds per trained parameter, that advice and a flushing schedule's N are
#: replayed with, by (schedule, device, corrections, kind of optimiser, width of the dense
#: stand-in): they depend on the model only through its stages' size (pipelines of trivial
#: and of dense layers are timed), so the runs of a sweep, or fit then test, measure them
#: once per process.
OVERHEADS: dict[tuple[str, ...], Overhead] = {}


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """What of ``optimizer`` the engine's per-action cost depends on: each optimiser's type
    and its groups' settings but their rates (the timing runs at rate 0)."""
    parts = optimizer.optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return repr(
        [
            (
                type(o).__qualname__,
                [
                    sorted((k, repr(v)) for k, v in g.items() if k not in _NOT_KIND)
                    for g in o.param_groups
                ],
            )
            for o in parts
        ]
    )


_NOT_KIND = ("params", "lr", "initial_lr")


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the run, as the strategy's setup decided it.

    Attributes:
        distributed: each stage runs in a process of its own (else all in this one).
        stages: P where the processes fix it (one per process, or given); None in one
            process until the model is cut.
        layout: which ranks form each copy of the pipeline (None in one process).
        global_rank: this process's rank.
        device: this process's device.
        broadcast: the strategy's broadcast of a picklable object from a rank to all.
    """

    distributed: bool
    stages: int | None
    layout: RankLayout | None
    global_rank: int
    device: torch.device
    broadcast: Callable[[Any, int], Any]


def stepped(optimizers: Sequence[Any]) -> Any:
    """What the pipeline steps of ``optimizers`` (one or more): the one, or all chained."""
    return optimizers[0] if len(optimizers) == 1 else ChainedOptimizer(optimizers)


def _on_rank(pipe: Pipeline, stage: int) -> str:
    """The text ", rank r" for ``stage`` (-1: the last) with a process per stage, else ""."""
    if not isinstance(pipe.transport, DistributedTransport):
        return ""
    return f", rank {pipe.transport.rank_of(stage % pipe.num_stages)}"


class TrainingReports:
    """The training steps' lagged reports: the loss each step returns and the non-finite
    losses and gradients met on the way, raised on the step that reports them."""

    def __init__(self) -> None:
        #: where the last stage publishes each minibatch's loss and logs
        self.results: Results | None = None
        self.path = ""  # the Sequential's attribute path, naming parameters in errors
        self.last_loss = math.nan  # the latest minibatch loss reported
        self.returned = 0  # the step whose loss the latest training step returned
        # minibatch -> (stage, parameter names): updates skipped for non-finite gradients
        self.bad_grads: dict[int, tuple[int, list[str]]] = {}
        self.diverged = False  # a monitored run met a non-finite loss

    def start(self, results: Results, path: str) -> None:
        """A new pipeline publishes into ``results``."""
        self.results, self.path = results, path

    def step(
        self,
        pipe: Pipeline,
        steps: UserSteps,
        batch: Any,
        args: tuple,
        *,
        trainer: Any,
        lag: int,
        device: torch.device,
        monitored: bool,
    ) -> float:
        """Feed ``batch`` to the pipeline and return the latest loss reported (see the module).

        Args:
            monitored: a ConvergenceMonitor diagnoses a non-finite loss instead of the strategy.
        """
        steps.begin("training_step", batch, args)
        assert self.results is not None
        steps.results = self.results
        k = pipe.minibatches_fed
        pipe.step(batch)
        # Report what every process already has: minibatch k - L. Wait for more only at a
        # run's first step (Lightning needs a loss from every rank) and at an epoch's last
        # (so epoch aggregates cover exactly this epoch's minibatches).
        first = self.results.next == self.results.start
        upto = k if first or closes_epoch(trainer) else k - lag
        losses = steps.replay_through(upto, device)
        if losses:
            # the latest loss, or the first non-finite one caught up with (monitors see it)
            j = next((j for j, v in enumerate(losses) if not math.isfinite(v)), len(losses) - 1)
            self.last_loss = losses[j]
            self.returned = self.results.next - len(losses) + j + 1
            self._check_finite(pipe, losses, monitored)
        return self.last_loss

    def _check_finite(self, pipe: Pipeline, losses: list[float], monitored: bool) -> None:
        """Stop at a non-finite loss, on every process at the same step (the losses are the
        same everywhere); a ConvergenceMonitor, when attached, diagnoses it instead. Stop at
        non-finite gradients where the loss was finite, on the process that met them."""
        assert self.results is not None
        first = self.results.next - len(losses)  # the minibatch of losses[0]
        for k, loss in enumerate(losses, start=first):
            if not math.isfinite(loss):
                if not monitored:
                    raise NonFiniteLossError(k + 1, pipe.num_stages - 1, loss, _on_rank(pipe, -1))
                self.bad_grads.clear()  # the run diverged: the monitor decides from here on
                self.diverged = True
            bad = self.bad_grads.pop(k, None)
            if bad is not None and math.isfinite(loss):
                raise NonFiniteGradientError(k + 1, bad[0], bad[1], _on_rank(pipe, bad[0]))

    def record_nonfinite(self, stage: int, minibatch: int, names: list[str]) -> None:
        """The executor's ``on_nonfinite``: ``stage`` skipped ``minibatch``'s update."""
        # Raise when the minibatch's results arrive: a non-finite loss then stops every
        # process alike; a finite one means the backward itself overflowed.
        if self.diverged:
            return
        names = [f"{self.path}.{n}" for n in names]
        self.bad_grads.setdefault(minibatch, (stage, names))

    def check_unreported(self, pipe: Pipeline | None) -> None:
        """At the end of training: skipped updates of minibatches whose results never came."""
        if self.bad_grads:
            assert pipe is not None
            k, (stage, names) = min(self.bad_grads.items())
            raise NonFiniteGradientError(k + 1, stage, names, _on_rank(pipe, stage))


class GradStash:
    """Gradients kept aside while Lightning zeroes them after ``training_step``: a
    non-flushing pipeline carries partial gradients of in-flight minibatches across steps."""

    def __init__(self) -> None:
        self._kept: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    def stash(self, pipe: Pipeline) -> None:
        self._kept = []
        for i in pipe.local_stages:
            for p in pipe.optimizer.stage_parameters(i):
                self._kept.append((p, p.grad))
                p.grad = None

    def restore(self) -> None:
        for p, g in self._kept:
            p.grad = g
        self._kept = []


class PipelineRunner:
    """Runs the strategy's pipeline and keeps its state between Lightning's hooks.

    Args:
        options: the strategy's arguments.
        package: what comes from the strategy's Lightning package (its rank-zero logging).
        write: writes a complete checkpoint file (the Lightning base's ``save_checkpoint``).
        remove: removes a checkpoint file (the base's ``remove_checkpoint``).
        on_fatal: called when this process's heartbeat thread ends it.
        write_shards: writes this process's shard of a per-stage checkpoint (collective).
    """

    def __init__(
        self,
        options: PipelineOptions,
        package: LightningPackage,
        write: Callable[[dict[str, Any], str, Any], None],
        remove: Callable[[str], None],
        on_fatal: Callable[[], None],
        write_shards: Callable[[dict[str, Any], dict[str, Any], str], None] | None = None,
    ) -> None:
        self.options, self.package, self._on_fatal = options, package, on_fatal
        self._module: Any = None
        self._place: Placement | None = None
        self._forward_context: ForwardContext | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self.pipeline: Pipeline | None = None
        #: the cut the first pipeline chose; later rebuilds (after fit, for test) cut alike
        self.cut: list[int] | None = None
        self.adapter: ModuleAdapter | None = None
        self._steps: UserSteps | None = None
        self.reports = TrainingReports()
        self._evaluation = Evaluation()
        self._grads = GradStash()
        self._probes: dict[str, Any] = {}  # the telemetry settings the monitors asked for
        #: checkpoints in flight, and what a loaded one still has to give the pipeline
        self.checkpoints = Checkpoints(
            write, remove, package.rank_zero_warn, write_shards, self._shards_now
        )
        #: N once known (given, or ``"auto"`` decided at the first batch)
        self.microbatches: int | None = None
        #: the run's plan, decided at the first batch (later rebuilds keep its layout)
        self.plan: RunPlan | None = None
        #: a model built on the meta device, cut at setup with this process's stage made real
        self.built: LeanBuild | None = None
        #: every stage's memory as predicted at the first build of a fit (None before)
        self.memory: list[StageMemory] | None = None
        self._memory_said = False
        self._weights_read = False  # ``options.weights`` read into this process's stage
        self._meta_warnings: list[Any] = []  # hooks warning of a state dict with meta tensors
        self._pending_state: Mapping[str, Any] | None = None  # see keep_state_for_build
        #: the gradient hooks fired at the stages' updates, where any is overridden
        self.hooks: GradientHooks | None = None
        #: what the pipeline is planned from, and why not the first training batch (fit)
        self._sample = "the first training batch"

    # -- what the runner reads of the run ---------------------------------------------------

    @property
    def module(self) -> Any:
        """The LightningModule being run."""
        assert self._module is not None, "the strategy has not been set up by a Trainer yet"
        return self._module

    @property
    def place(self) -> Placement:
        """Where this process sits in the run."""
        assert self._place is not None, "the strategy has not been set up by a Trainer yet"
        return self._place

    @property
    def fitting(self) -> bool:
        """Whether the Trainer runs ``fit`` (not validate, test or predict)."""
        trainer = self._module.trainer if self._module is not None else None
        return trainer is not None and trainer.state.fn == "fit"

    @property
    def validates(self) -> bool:
        """Whether the run evaluates the model: anything but a fit, and a fit with a validation
        loader, a ``validation_step`` and batches to take (Lightning's own tests). A fit that
        does not is cut for training only, and the eval graphs are traced when something first
        evaluates (:meth:`trace_eval`)."""
        trainer = self._module.trainer if self._module is not None else None
        if trainer is None or trainer.state.fn != "fit":
            return True
        try:
            defined = trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined()
        except AttributeError:  # Lightning's internals moved: take it to validate
            return True
        return (
            defined
            and trainer.limit_val_batches != 0
            and overrides(self._module, "validation_step")
        )

    def trace_eval(self) -> None:
        """Before validate, test or predict: the eval graphs of a module cut for training
        only (a fit without validation), traced now; nothing to do otherwise."""
        adapter = self.adapter
        if adapter is not None and adapter.segmented and adapter.sequential is not None:
            adapter.sequential.trace_eval()  # type: ignore[operator]

    @property
    def sharded(self) -> bool:
        """Whether checkpoints are written as per-stage shards: as the option says, by default
        where each process holds only its own stage (a model built on the meta device, in
        several processes), since gathering it would bring the whole model into one process."""
        choice = self.options.save_distributed_checkpoint
        if choice is not None:
            return choice
        return self._place is not None and self._place.distributed and self.built is not None

    def _shards_now(self, path: str) -> bool:  # a method, not a lambda: spawn pickles the runner
        """Whether the checkpoint ``path`` is written as shards: a remote one is not unless
        asked for (shards need a filesystem every process shares)."""
        if "://" in path and self.options.save_distributed_checkpoint is None:
            return False
        return self.sharded

    @property
    def steps(self) -> UserSteps:
        """The user's steps, run per microbatch."""
        assert self._steps is not None, "the strategy has not been set up by a Trainer yet"
        return self._steps

    @property
    def stages(self) -> int | None:
        """P: the plan's once there is one (its only source from then on); before, where
        known: given, one per process, or one per layer of the Sequential."""
        if self.plan is not None:
            return self.plan.stages
        if self._place is not None and self._place.stages is not None:
            return self._place.stages
        if self.options.stages is not None:
            return self.options.stages
        seq = self.adapter.sequential if self.adapter else None
        return len(seq) if seq is not None else None

    @property
    def delays(self) -> tuple[StageDelay, ...] | None:
        """Every stage's delays, once P and N are known."""
        if self.stages is None or self.microbatches is None:
            return None
        return derive_delays(self.options.schedule, self.stages, self.microbatches)

    @property
    def lag(self) -> int | None:
        """Steps by which a step's reported results trail its minibatch, once P and N are
        known."""
        if self.stages is None or self.microbatches is None:
            return None
        return result_lag(self.options.schedule, self.stages, self.microbatches)

    # -- setup ------------------------------------------------------------------------------

    def setup(self, module: Any, place: Placement, forward_context: ForwardContext) -> None:
        """Find the module to pipeline and refuse, before anything runs, what cannot be cut.

        Args:
            module: the LightningModule.
            place: where this process sits in the run.
            forward_context: the precision plugin's context around each forward.
        """
        options = self.options
        self._module, self._place, self._forward_context = module, place, forward_context
        path, _ = cuts.find_pipelined(module, options.module)
        self.adapter = adapter = ModuleAdapter(
            module, path, options.split_points, options.dynamic_shapes
        )
        checks.check_split_points(adapter, options.split_points)
        self._check_cut()  # a module cut into segments is checked at the first batch
        adapter.check_no_outside_parameters()
        self._steps = UserSteps(module, adapter, forward_context)
        if isinstance(options.microbatches, int):
            self.microbatches = options.microbatches
        self.pipeline = None
        self.checkpoints.forget_loaded()  # optimiser states are restored after setup

    def attach_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The optimisers Lightning made from ``configure_optimizers`` (none outside fit)."""
        self._optimizers = list(optimizers)

    def place_model(self, device: torch.device) -> None:
        """Before Lightning builds the optimisers: move what lies outside the pipelined module
        to ``device``; the pipelined module's layers move when the pipeline is built, each
        process its own stage's only (the others go to the meta device).

        A model built on the meta device (``configure_model``, or
        ``trainer.init_module(empty_init=True)``) is cut and this process's stage given real
        storage, initialised, or left for ``weights`` to fill at the build: an
        ``nn.Sequential`` now, so that the optimisers hold the real parameters; a model of any
        other kind at the first batch, once traced on the meta device
        (:meth:`_make_stage_real`), its optimisers then given the real parameters.
        """
        adapter = self.adapter
        assert adapter is not None
        _move_outside(self.module, adapter.pipelined, device)
        if self.built is not None or not has_meta(adapter.pipelined):
            return  # not lean, or made real by an earlier run of this Trainer
        if self.options.balance == "auto":
            raise ValueError(
                f"balance='auto' profiles every layer of {adapter.what} in one process, and it "
                "was built on the meta device; pass balance='params', 'even' or a list of layer "
                "counts"
            )
        if adapter.sequential is not None:
            self._make_stage_real(adapter.sequential, device)

    def _make_stage_real(self, seq: nn.Sequential, device: torch.device) -> None:
        """Cut ``seq`` (the pipelined module built on the meta device, or its segments) by
        parameter counts unless told otherwise, and give this process's stage real,
        initialised storage; the optimisers built already take the real parameters."""
        adapter, stages = self.adapter, self.stages
        assert adapter is not None and stages is not None
        balance = self.options.balance
        if isinstance(balance, list):
            cut, why = list(balance), "as given"
        elif balance == "even":
            cut, why = partition.even_balance(len(seq), stages), "balance='even'"
        else:
            cut = partition.balance_by_cost(
                [sum(p.numel() for p in layer.parameters()) for layer in seq], stages
            )
            why = "by parameter counts" + (
                ": balance='time' needs every layer timed in one process, and no process holds "
                "every layer of a model built on the meta device"
                if balance == "time"
                else ""
            )
        place = self.place
        local = [place.layout.position(place.global_rank)[1]] if place.layout else range(stages)
        starts = [sum(cut[:i]) for i in range(len(cut) + 1)]
        layers = [seq[j] for i in local for j in range(starts[i], starts[i + 1])]
        # weights from a file or a loaded checkpoint replace the initialisation (which would
        # also reset buffers the checkpoint gave, e.g. BatchNorm's statistics)
        from_file = self.options.weights or self._pending_state is not None
        init = "none" if from_file else init_method(adapter.pipelined)
        if seq is adapter.pipelined:
            made = materialize(adapter.pipelined, layers, device, init)
        else:  # segments: the user's modules that own the stage's parameters are made real
            mine = {id(p): p for layer in layers for p in layer.parameters()}
            owners = [
                m
                for m in adapter.pipelined.modules()
                if any(id(p) in mine for p in m.parameters(recurse=False))
            ]
            made = materialize(adapter.pipelined, owners, device, init, only=mine.values())
            replace_parameters(seq, made)
        for optimizer in self._optimizers:  # built over the meta parameters
            for group in optimizer.param_groups:
                group["params"] = [made.get(id(p), p) for p in group["params"]]
        self._fill_pending_state(made)
        self.built = LeanBuild(tuple(cut), why, "file" if init == "none" else init)

    def keep_state_for_build(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's weights, loaded before this process's stage is real (a model traced
        on the meta device is made real at the first batch): filled in then."""
        self._pending_state = state

    def _fill_pending_state(self, made: Mapping[int, nn.Parameter]) -> None:
        state, self._pending_state = self._pending_state, None
        if state is None:
            return
        real = {id(p) for p in made.values()}
        mine = [
            (name, p)
            for name, p in self.module.named_parameters(remove_duplicate=False)
            if id(p) in real
        ]
        state = read_local(state, [name for name, _ in mine])  # one pass over shards
        missing = load_stage_weights(state, mine)
        if missing:
            raise ValueError(
                f"the checkpoint holds no value for {len(missing)} tensor(s) of this "
                f"process's stage ({', '.join(missing[:4])}); it was saved from another model"
            )

    def check_optimizer(self) -> None:
        """Refuse at setup an optimiser the pipeline cannot step at any N the run may take
        (given, or each ``"auto"`` may choose:
        :func:`~pipemare.planner.decide.microbatch_candidates`), where P is known; otherwise
        the pipeline's build refuses it at the first batch, still before any update."""
        stages = self._check_cut() if self.adapter and self.adapter.sequential else self.stages
        if not self._optimizers or stages is None:
            return
        options, refusals = self.options, []
        for n in microbatch_candidates(options, stages):
            try:
                checks.check_optimizer(
                    stepped(self._optimizers), options.schedule, stages, n, options.config
                )
            except (ValueError, TypeError) as refused:
                refusals.append(refused)
            else:
                return  # some N the run may take is served: its first batch decides
        raise refusals[0]

    def _check_cut(self) -> int | None:
        """P, after refusing a cut that cannot be made; None while the pipelined module waits
        to be cut into segments (at the first batch)."""
        adapter, options, place = self.adapter, self.options, self.place
        assert adapter is not None
        if adapter.sequential is None:
            return None
        return cuts.check_cut(
            adapter.what,
            adapter.sequential,
            options.balance,
            options.stages,
            place.stages,
            place.distributed,
        )

    def request_probe(self, **settings: Any) -> None:
        """Merge a monitor's telemetry settings: switches are or-ed, intervals take the
        shortest asked for; attached to the pipeline once there is one."""
        for key, value in settings.items():
            old = self._probes.get(key)
            if isinstance(value, bool):
                self._probes[key] = bool(old) or value
            elif value:
                self._probes[key] = min(old, value) if old else value
        if self.pipeline is not None:
            self._attach_probe(self.pipeline)

    def _attach_probe(self, pipe: Pipeline) -> None:
        if not self._probes:
            return
        if pipe.probe is None:
            pipe.probe = Probe()
        assert pipe.probe is not None
        pipe.probe.merge(**self._probes)

    # -- the pipeline, built at the first batch ----------------------------------------------

    def build_before_sanity_check(self) -> None:
        """At the start of fit's sanity check: plan and build the pipeline from the first
        training batch, which the training loop still feeds first
        (:func:`~pipemare.lightning.steps.read_first_training_batch`), so that no validation
        batch decides N, the cut or the corrections. Where the training data cannot be read
        ahead, the sanity check's first batch builds it, and the run's decisions say so."""
        if self.pipeline is not None or not self.fitting:
            return
        module = self.module
        modes = [(m, m.training) for m in module.modules()]
        # the sanity check runs under no_grad or inference mode, with the model in eval mode
        with torch.inference_mode(False), torch.enable_grad():
            first, why_not = read_first_training_batch(module.trainer)
            if first is None:
                self._sample = f"the sanity check's first validation batch: {why_not}"
                return
            batch = module._apply_batch_transfer_handler(
                first, device=self.place.device, dataloader_idx=0
            )
            module.train()
            try:
                with self.steps.manual.pipelined():
                    self.pipeline_for(batch, "training_step", (0,))
            finally:
                for m, training in modes:
                    m.training = training

    def pipeline_for(self, batch: Any, step: str, args: tuple) -> Pipeline:
        """The pipeline, built now from ``batch`` if there is none yet."""
        adapter = self.adapter
        assert adapter is not None
        if self.pipeline is None:
            self.plan = plan = decide(self.options, self._facts(batch, step, args))
            self.microbatches, self.cut = plan.microbatches, list(plan.balance)
            self.pipeline = pipe = self._build(plan)
            self._read_weights(pipe)
            if self.fitting and not self._memory_said:
                self._memory_said = True
                self.memory = self._predict_memory(pipe, batch, step, args)
            if self.built is not None:  # the holders of tied weights take their owner's
                pipe.ties.restart(pipe.minibatches_fed)
            if not self._meta_warnings and has_meta(self.module):
                self._meta_warnings = [
                    warn_on_meta_state(m, "trainer.strategy.gather()")
                    for m in {id(m): m for m in (self.module, adapter.pipelined)}.values()
                ]
            self.checkpoints.load_pending(pipe)
            self.announce()
            self.reports.start(self.results(pipe.minibatches_fed), adapter.path)
            pipe.executor.on_minibatch = lambda k, loss: self.steps.publish(k, float(loss))
            pipe.executor.on_nonfinite = self.reports.record_nonfinite
            self.hooks = self._gradient_hooks(pipe)
            self._attach_probe(pipe)
        if adapter.segmented and adapter.sequential is not None:
            adapter.sequential.train(adapter.pipelined.training)  # the graph traced in its mode
        return self.pipeline

    def _predict_memory(
        self, pipe: Pipeline, batch: Any, step: str, args: tuple
    ) -> list[StageMemory] | None:
        """Every stage's memory, predicted before the first step; printed on rank 0, and the
        run refused where a stage would not fit its device (:mod:`~pipemare.planner.stage_memory`).
        None where a stage could not be measured (a warning says why)."""
        adapter, place = self.adapter, self.place
        assert adapter is not None and adapter.sequential is not None
        seq = adapter.sequential
        layers = list(seq)
        with self.steps.discarding_logs(), torch.random.fork_rng(devices=[]):
            x = adapter.capture_input(step, scatter(batch, pipe.microbatches)[0], *args)
        ratio = state_bytes_per_byte(copies_of(self._user_optimizer(seq), seq.parameters()))
        starts = [sum(pipe.balance[:i]) for i in range(pipe.num_stages + 1)]
        mine: list[StageMemory] | None = []
        try:
            mine = self._stage_memory(pipe, layers, starts, x, ratio)
        except Exception as err:  # a layer the measurement cannot run: the run goes on
            self.package.rank_zero_warn(text("memory.not_predicted", error=err))
            mine = None
        every = mine or []
        if place.distributed and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            if any(part is None for part in gathered):
                return None
            every = sorted({m.stage: m for part in gathered for m in part}.values(), key=_stage)
        if mine is None:
            return None
        for m in every:
            self.package.rank_zero_info(text("memory.predicted", stage=m.describe()))
        limit, where = self._memory_limit()
        check_fits(every, limit, where)
        return every

    def _stage_memory(
        self, pipe: Pipeline, layers: list[nn.Module], starts: list[int], x: Any, ratio: float
    ) -> list[StageMemory]:
        """This process's stages' memory (see :meth:`_predict_memory`). The one microbatch run
        through each stage leaves no trace: the random streams and the stage's buffers (a
        BatchNorm's statistics) are as they were."""
        mine = []
        for i in pipe.local_stages:
            params = list(pipe.stage_modules[i].parameters())
            copies = {id(p) for p in pipe.ties.copies_on(i)}
            trained = sum(p.nbytes for p in params if p.requires_grad and id(p) not in copies)
            grads = sum(p.nbytes for p in params if p.requires_grad)
            module = pipe.stage_modules[i]
            kept = {k: b.clone() for k, b in module.named_buffers()}
            with torch.random.fork_rng(devices=[] if pipe.device.type == "cpu" else [pipe.device]):
                per_microbatch = saved_bytes_per_microbatch(
                    layers[: starts[i]],
                    list(module),
                    x,
                    self._forward_context,
                    inputs_only=pipe.stages[pipe.local_stages.index(i)].recompute,
                )
            with torch.no_grad():
                for k, b in module.named_buffers():
                    b.copy_(kept[k])
            flight = most_in_flight(
                self.options.schedule,
                pipe.num_stages,
                pipe.microbatches,
                i,
                pipe.settings.warmup_steps,
            )
            mine.append(
                StageMemory(
                    i,
                    sum(p.nbytes for p in params),
                    grads,
                    round(ratio * trained),
                    sum(c.keeps_copy(i) for c in pipe.optimizer.corrections) * trained,
                    flight * per_microbatch,
                    flight,
                )
            )
        return mine

    def _memory_limit(self) -> tuple[int | None, str]:
        """The bytes a stage may hold on this process's device: what CUDA has free plus what
        this process already holds there, or on a CPU the ``memory_limit`` given (none: no
        check)."""
        device = self.place.device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            held = torch.cuda.memory_allocated(device)
            return free + held, f"{device} has for this process (free plus what it holds)"
        limit = self.options.memory_limit
        return limit, f"given as memory_limit={limit}"

    def _read_weights(self, pipe: Pipeline) -> None:
        """At the first build, fill this process's stages from ``options.weights``, reading
        only their tensors (:func:`~pipemare.model.materialize.load_stage_weights`)."""
        path = self.options.weights
        if path is None or self._weights_read:
            return
        wanted = [  # a list: a tied weight's owner and its copy on another stage share a name
            (self.state_names(key), tensor)
            for i in pipe.local_stages
            for key, tensor in pipe.stage_modules[i].state_dict(keep_vars=True).items()
        ]
        assert self.adapter is not None
        tied: dict[int, list[str]] = {}  # a tie's names in the user's module
        for name, p in self.module.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(name)
        aliases = {name: names for names in tied.values() if len(names) > 1 for name in names}
        missing = load_stage_weights(
            path, wanted, strip=(f"{self.adapter.path}.",), aliases=aliases
        )
        adapters = _adapter_names(self.module)
        missing = [k for k in missing if not any(f".{a}." in k for a in adapters)]
        if missing:
            shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise ValueError(
                f"weights={path!r} holds no value for {len(missing)} tensor(s) of this "
                f"process's stage ({shown}); save the LightningModule's state_dict() (or the "
                "pipelined module's) from the model you start from"
            )
        self._weights_read = True

    def _facts(self, batch: Any, step: str, args: tuple) -> RunFacts:
        """What :func:`~pipemare.planner.decide.decide` needs: the module cut into segments
        from what the step passes it (a module that is not a Sequential), and the layers
        measured where the cut asks for it (on rank 0, so that every process cuts alike)."""
        adapter, place = self.adapter, self.place
        assert adapter is not None
        if adapter.sequential is None:
            with self.steps.discarding_logs(), torch.random.fork_rng(devices=[]):
                # a fit without validation in one process skips the eval trace (about half the
                # cut's time) until something evaluates; over processes each stage's weights may
                # have moved to its device by then, so both are traced at the cut as before
                eval_graph = self.validates or place.distributed
                # a list of layer counts counts the whole blocks' segments: they stay whole
                stages = (
                    None
                    if isinstance(self.options.balance, list)
                    else place.stages
                    if place.distributed
                    else self.options.stages
                )
                adapter.prepare(step, batch, *args, eval_graph=eval_graph, stages=stages)
            self._check_cut()
        seq = adapter.sequential
        assert seq is not None
        if self.built is None and has_meta(seq):  # traced on the meta device: cut it now
            self._make_stage_real(seq, place.device)
        previous = self.plan
        total, per_epoch = run_length(self.module.trainer) if self.fitting else (None, None)
        facts = RunFacts(
            model=adapter.model_facts(),
            rows=batch_size(batch),
            process_stages=place.stages if place.distributed else None,
            replicas=place.layout.replicas if place.layout is not None else 1,
            checkpointed=self.checkpoints.pending_layout,
            optimizer=self._user_optimizer(seq) if self._optimizers_given() else None,
            short_last_batches=tuple(short_last_batches(self.module.trainer))
            if self.fitting
            else (),
            fitting=self.fitting,
            total_steps=total,
            steps_per_epoch=per_epoch,
            previous=None
            if previous is None
            else (previous.stages, previous.microbatches, previous.balance),
            built=self.built,
            sample=self._sample if self.fitting else None,
        )
        wanted = measurements_needed(self.options, facts)
        if wanted is None:
            return facts
        kind, sizes = wanted
        measured = None
        if place.global_rank == 0:
            measured = self._measure(seq, kind, sizes, batch, step, args)
            if kind == "time":
                measured = (
                    measured,
                    self._overheads(
                        seq,
                        overheads_to_measure(self.options, facts),
                        trained_per_stage(self.options, facts),
                    ),
                )
        measured = place.broadcast(measured, 0)
        if kind == "time":
            (passes, sizes), overheads = measured
            links, why = self._links(sizes)
            return dataclasses.replace(
                facts,
                layer_passes=passes,
                overheads=overheads,
                layer_out_bytes=sizes,
                links=links,
                links_why=why,
            )
        return dataclasses.replace(facts, profile=measured)

    def _links(self, sizes: Mapping[int, tuple[int, ...]]) -> tuple[tuple[Link, ...] | None, str]:
        """The links between neighbouring stages' processes, for the replays: the simulated
        one where asked for, else each link's latency and bandwidth measured now between its
        two processes with a message of the largest activation measured; either way with what
        such a message costs each side's own thread through the transport, measured now
        (every process calls this alike). None in one process, where stages pass messages by
        reference."""
        place = self.place
        if not place.distributed or place.stages is None or place.stages < 2:
            return None, ""
        edges = place.stages - 1
        ranks = (
            list(place.layout.pipelines[0]) if place.layout is not None else list(range(edges + 1))
        )
        # what crosses a cut is a layer's output before the last layer (the last one's, the
        # logits, stays on the last stage)
        largest = max((max(out[:-1], default=0) for out in sizes.values()), default=0)
        links = measure_links(ranks, [max(largest, 4)] * edges, device=place.device)
        cpu = (
            f"; each message's CPU on either side measured now through the transport with "
            f"{largest / 1e6:.3g} MB (the largest activation measured), charged to the action "
            "that sends or takes it"
        )
        simulated = self.options.simulated_link
        if simulated is not None:
            why = (
                "simulated (simulated_link): each message is held until it would have crossed "
                "it; the real link beneath is faster" + cpu
            )
            return tuple(
                dataclasses.replace(simulated, send_s=link.send_s, recv_s=link.recv_s)
                for link in links
            ), why
        why = (
            f"measured now between each pair of neighbouring processes: the round trip of a "
            f"tiny message and of {largest / 1e6:.3g} MB (the largest activation measured); "
            "the replays below carry each microbatch's activations and gradients across them" + cpu
        )
        return tuple(links), why

    def _overheads(
        self, seq: nn.Sequential, schedules: tuple[str, ...], stage_params: int | None
    ) -> dict[str, Overhead]:
        """The engine's own seconds per action, and its forward's and update's per trained
        parameter on stages of about ``stage_params``, under each of ``schedules`` with the
        run's optimiser, on this device (:func:`~pipemare.planner.engine_overhead`): measured
        once per process for each schedule, kind of optimiser, corrections, device and size
        of stand-in stage (:data:`OVERHEADS`)."""
        from pipemare.planner import engine_overhead
        from pipemare.planner.timing import dense_width

        device = next((p.device for p in seq.parameters()), torch.device("cpu"))
        optimizer = self._user_optimizer(seq)
        factory = copies_of(optimizer, seq.parameters())
        kind = (
            str(device),
            repr(self.options.config),
            _optimizer_kind(optimizer),
            str(dense_width(stage_params)),
        )
        out = {}
        with self.steps.discarding_logs():
            for schedule in schedules:
                key = (schedule, *kind)
                if key not in OVERHEADS:
                    OVERHEADS[key] = engine_overhead(
                        schedule,
                        factory,
                        config=self.options.config,
                        device=device,
                        per_param=True,
                        stage_params=stage_params,
                    )
                out[schedule] = OVERHEADS[key]
        return out

    def _measure(
        self,
        seq: nn.Sequential,
        kind: str,
        wanted: tuple[int, ...],
        sample: Any,
        step: str,
        args: tuple,
    ) -> Any:
        """``"time"``: each layer's forward and backward seconds, and its output's bytes, on
        the first microbatch at each N of ``wanted``;
        ``"auto"``: the planner's profile of the layers (:mod:`pipemare.planner`) with the
        run's optimiser and corrections."""
        options, forward_context = self.options, self._forward_context
        assert self.adapter is not None and forward_context is not None
        out: dict[int, tuple[tuple[float, float], ...]] = {}
        sizes: dict[int, tuple[int, ...]] = {}
        with self.steps.discarding_logs(), torch.random.fork_rng(devices=[]):
            for n in wanted:
                microbatch = scatter(sample, n)[0]
                x = self.adapter.capture_input(step, microbatch, *args)
                if kind == "auto":
                    from pipemare.planner import profile

                    # a first build under validate runs in inference mode: profile with autograd
                    with (
                        torch.inference_mode(False),
                        torch.enable_grad(),
                        self._head(step, args) as head,
                    ):
                        x = tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, x)
                        return profile(
                            seq,
                            x,
                            target=microbatch if head is not None else None,
                            loss_fn=head,
                            optimizer=copies_of(self._user_optimizer(seq), seq.parameters()),
                            schedule=options.schedule,
                            config=options.config,
                            forward_context=forward_context,
                        )
                with forward_context():  # time what will run
                    out[batch_size(x)], sizes[batch_size(x)] = self._timed_step(
                        seq, x, microbatch, step, args
                    )
        return out, sizes

    def _timed_step(
        self, seq: nn.Sequential, x: Any, microbatch: Any, step: str, args: tuple
    ) -> tuple[tuple[tuple[float, float], ...], tuple[int, ...]]:
        """Each layer's forward and backward seconds on ``x``, with the user's training step
        around the model charged where it runs, once per microbatch: its code before the model
        to the first layer's forward, and its head (the loss, metrics and logs on the model's
        output) to the last layer's forward and backward; so the cut, N and the advice see the
        first and last stages' whole work. And each layer's output bytes. One forward through
        the layers serves all three (:func:`~pipemare.model.partition.time_layers`). The step
        runs on the first microbatch with its logs thrown away, what it changed on the module
        put back (:meth:`UserSteps.rehearsal`) and its random numbers forked
        (:meth:`_measure`). A step under manual optimisation, which steps its own optimisers,
        is not run again: its stages are charged their layers only."""
        assert self.adapter is not None
        adapter = self.adapter
        with self._head(step, args) as loss:
            head = None if loss is None else (lambda out: loss(out, microbatch))
            timed = partition.time_layers(seq, x, head=head)
            before = 0.0
            if loss is not None:
                before = partition.step_code_seconds(
                    lambda: adapter.capture_input(step, microbatch, *args), x
                )
        passes = list(timed.passes)
        if timed.head is not None:
            (first_f, first_b), *rest = passes
            passes = [(first_f + before, first_b), *rest]
            last_f, last_b = passes[-1]
            passes[-1] = (last_f + timed.head[0], last_b + timed.head[1])
        return tuple(passes), timed.out_bytes

    @contextlib.contextmanager
    def _head(self, step: str, args: tuple) -> Iterator[Callable[[Any, Any], torch.Tensor] | None]:
        """The last stage's loss on ``(output, microbatch)`` as the run computes it, to time at
        setup (:meth:`UserSteps.rehearsal`); None outside a training step, and under manual
        optimisation, whose step steps its own optimisers and is not run again."""
        if step != "training_step" or self.steps.manual.active:
            yield None
            return
        with self.steps.rehearsal(step, args) as loss:
            yield loss

    def _optimizers_given(self) -> bool:
        """Whether ``configure_optimizers`` returned optimisers of the model (Lightning's
        stand-in when it returns None holds none of the model's parameters)."""
        owned = {id(p) for p in self.module.parameters()}
        return any(
            id(p) in owned for o in self._optimizers for g in o.param_groups for p in g["params"]
        )

    def _user_optimizer(self, seq: nn.Sequential) -> torch.optim.Optimizer:
        """The optimiser ``configure_optimizers`` returned (several, under manual optimisation:
        chained), or a stand-in that never steps."""
        if self._optimizers_given():
            return stepped(self._optimizers)
        return torch.optim.SGD(seq.parameters(), lr=0.0)  # never stepped with a real rate

    def _build(self, plan: RunPlan) -> Pipeline:
        """The Pipeline over the Sequential as ``plan`` lays it out, with the Trainer's
        clipping."""
        assert self.adapter is not None and self.adapter.sequential is not None
        options, seq, steps = self.options, self.adapter.sequential, self.steps
        steps.shares = plan.weights  # the step's logs combine as the losses do
        return Pipeline(
            seq,
            self._user_optimizer(seq),
            steps.loss,
            stages=plan.stages,
            microbatches=plan.microbatches,
            schedule=options.schedule,
            balance=list(plan.balance),
            transport=self._transport(),
            device=self.place.device,
            input_fn=steps.input,
            target_fn=lambda mb: mb,
            microbatch_weights=plan.weights,
            forward_context=self._forward_context,
            recompute=plan.recompute,
            compile=False if plan.compile is None else plan.compile,
            measure_saved=True if self.options.measure_activations else None,
            settings=plan.settings,
            **self._clipping(),
        )

    def _gradient_hooks(self, pipe: Pipeline) -> GradientHooks | None:
        """The module's and the callbacks' gradient hooks, fired at each stage's update
        (:mod:`~pipemare.lightning.hooks`); None where none is overridden, or outside fit."""
        trainer = self.module.trainer
        names = overridden_hooks(self.module, trainer.callbacks)
        if not names or not self.fitting:
            return None
        place, group, keep = self.place, None, None
        if place.distributed and place.layout is not None:
            group = dist.new_group(backend="gloo")  # every rank builds its pipeline now
            keep = place.layout.pipelines[0]
        return GradientHooks(self.module, pipe, names, HookLogs(group, keep))

    def _clipping(self) -> dict[str, Any]:
        """The Trainer's gradient clipping as the pipeline's keyword (none outside fit). An
        overridden ``configure_gradient_clipping`` decides instead, at each update: the
        pipeline then exchanges the norms and clips only when asked (``math.inf``)."""
        trainer = self.module.trainer
        if self.fitting and "configure_gradient_clipping" in overridden_hooks(self.module, ()):
            return {"clip_grad_norm": math.inf}
        clip_val = trainer.gradient_clip_val if self.fitting else None
        algorithm = trainer.gradient_clip_algorithm or "norm"
        if not clip_val:
            return {}
        return {"clip_grad_norm" if algorithm == "norm" else "clip_grad_value": float(clip_val)}

    def _transport(self) -> Any:
        place = self.place
        if not place.distributed:
            return "inprocess"
        transport = DistributedTransport(
            place.stages,
            place.device,
            stall_timeout=self.options.stall_timeout,
            layout=place.layout,
            heartbeat_timeout=self.options.heartbeat_timeout,
            simulated_link=self.options.simulated_link,
        )
        # a process ended by its heartbeat thread first ends those it launched, as on an error
        transport.watchdog.reporter.on_fatal(self._on_fatal)
        return transport

    def announce(self) -> None:
        """Print the run's settings on rank 0: stages, cut, schedule and the corrections with
        their settings, then each decision taken on the user's behalf with its reason
        (:class:`~pipemare.optim.settings.RunSettings`); outside fit, those of the run that
        trained the loaded checkpoint (evaluation applies none)."""
        pipe, place, info = self.pipeline, self.place, self.package.rank_zero_info
        assert pipe is not None
        if place.layout is not None:
            info(place.layout.describe())
        where = "one per process" if place.distributed else "in one process"
        shown = {"stages": pipe.num_stages, "where": where, "balance": list(pipe.balance)}
        schedule, microbatches = self.options.schedule, self.microbatches
        decisions: list[str] = []
        if self.fitting:
            corrections = pipe.settings.describe() or "none"
            run = text(
                "run",
                **shown,
                schedule=schedule,
                microbatches=microbatches,
                corrections=corrections,
            )
            decisions = [str(d) for d in pipe.settings.decisions]
        elif self.checkpoints.trained is not None:
            trained = self.checkpoints.trained
            run = text(
                "run.checkpoint",
                **shown,
                schedule=trained["schedule"],
                microbatches=trained["microbatches"],
                corrections=trained["described"] or "none",
            )
            decisions = list(trained.get("settings", {}).get("decisions", []))
        else:
            run = text("run.evaluation", **shown, schedule=schedule, microbatches=microbatches)
        info(run)
        for line in decisions:
            info(text("decision", decision=line))

    def results(self, start: int) -> Results:
        """Where the last stage publishes results for every process
        (:mod:`pipemare.engine.lagged`)."""
        place = self.place
        if place.layout is None:
            return LocalResults(start)
        assert self.pipeline is not None
        transport = self.pipeline.transport
        assert isinstance(transport, DistributedTransport)
        last = transport.rank_of(transport.num_stages - 1)
        layout = place.layout
        merge_group = None
        if layout.replicas > 1:  # the copies' last stages combine their results first
            group = dist.new_group(list(layout.stage_groups[-1]), backend="gloo")  # every rank
            merge_group = group if place.global_rank == last else None
        return DistributedResults(
            last,
            start,
            watchdog=transport.watchdog,
            ranks=layout.pipelines[transport.replica],
            merge_group=merge_group,
            merge=merge_published,
            lag=self.lag or 0,
        )

    # -- the steps ---------------------------------------------------------------------------

    def train(self, batch: Any, args: tuple, *, monitored: bool) -> float:
        """Feed a training batch to the pipeline; the latest loss reported (lagged).

        Args:
            monitored: a callback diagnoses a non-finite loss instead of the strategy.
        """
        steps = self.steps
        with steps.manual.pipelined():  # under manual optimisation: see lightning.manual
            pipe = self.pipeline_for(batch, "training_step", args)
            loss = self.reports.step(
                pipe,
                steps,
                batch,
                args,
                trainer=self.module.trainer,
                lag=self.lag or 0,
                device=self.place.device,
                monitored=monitored,
            )
        if self.hooks is not None:
            self.hooks.after_step(self.place.device)
        self.write_due()  # checkpoints whose step reached every stage by now
        steps.manual.after_step(lambda: self._grads.stash(pipe))
        return loss

    def restore_grads(self) -> None:
        """Give back the in-flight gradients kept aside while Lightning zeroed them."""
        self._grads.restore()

    def evaluate(self, step: str, batch: Any, batch_idx: int, args: tuple) -> Any:
        """Run a validation, test or predict batch; the latest step output reported."""
        place = self.place
        pipe = self.pipeline_for(batch, step, (batch_idx, *args))
        ahead = pipe.num_stages - 1 if place.distributed else 0
        return self._evaluation.step(
            pipe,
            self.steps,
            step,
            batch,
            batch_idx,
            args,
            results=self.results,
            microbatches=pipe.microbatches,
            ahead=ahead,
            trainer=self.module.trainer,
            device=place.device,
        )

    def drain(self) -> None:
        """Finish every minibatch in flight: each stage's state is then final."""
        if self.pipeline is not None:
            self.pipeline.drain()
            self.pipeline.sync_buffers()  # the copies evaluate (and save) copy 0's buffers
            self.write_due()

    def finish_training(self) -> None:
        """At the end of fit: drain, and raise for skipped updates never reported."""
        self.drain()
        if self.hooks is not None:
            self.hooks.close()
        self.reports.check_unreported(self.pipeline)

    def consolidate(self) -> None:
        """At the end of a run: give every process the whole model again (as DDP leaves it),
        where it was built whole in every process; a model built on the meta device stays a
        stage per process (:meth:`gather` on request)."""
        self.drain()
        if self.built is not None:
            if self.pipeline is not None:
                self._keep_ties(self.pipeline)
            return
        self.gather()

    def gather(self) -> None:
        """Give this process the whole model: every stage's weights (collective: every
        process calls it). Needs the whole model to fit in each process."""
        self.drain()
        if self.place.distributed and self.pipeline is not None:
            checkpoint.consolidate(self.module, self.pipeline, self.state_names, self.place.device)
            self.pipeline = None  # its stages are no longer split; the next run rebuilds it
            self.built = None
            for hook in self._meta_warnings:
                hook.remove()
            self._meta_warnings = []

    def _keep_ties(self, pipe: Pipeline) -> None:
        """Where this process holds a copy of a tied weight whose owner's stage runs
        elsewhere, the user's module takes the copy's values in every place it holds the
        weight: the next run's cut finds the tie again, with real values on this process."""
        seq = self.adapter.sequential if self.adapter else None
        assert seq is not None
        for tie in pipe.ties.ties:
            mine = [s for s in tie.copies if s in pipe.local_stages]
            if tie.owner in pipe.local_stages or not mine:
                continue
            key, twin = tie.copies[mine[0]]  # a stage's layers keep the Sequential's names
            held = seq.get_parameter(key)
            replace_parameters(seq, {id(held): with_data(held, twin.detach())})

    # -- checkpoints: :class:`~pipemare.lightning.checkpoint.Checkpoints`, given this run --

    @property
    def state_names(self) -> checkpoint.StateNames:
        """A stage module's state-dict key -> the LightningModule's own key for it."""
        assert self.adapter is not None
        return self.adapter.state_key

    def module_state(self) -> dict[str, Any]:
        """The whole model's state (see :meth:`Checkpoints.module_state`)."""
        return self.checkpoints.module_state(self.module, self.pipeline, self.state_names)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        """Queue a checkpoint; it is written once its step reached every stage."""
        self.checkpoints.saves.save(checkpoint, filepath, storage_options, self.pipeline)
        self.write_due()

    def write_due(self) -> None:
        """Write the queued checkpoints whose step reached every stage by now."""
        if self.adapter is not None:
            self.checkpoints.saves.poll(self.module, self.pipeline, self.state_names)

    def load_optimizer_states(self, optimizers: Sequence[Any], states: Sequence[Any]) -> None:
        """Load the user's optimiser states now, and pipemare's part once the pipeline exists."""
        self.checkpoints.load_optimizer_states(optimizers, states)
        if self.pipeline is not None and self.checkpoints.load_pending(self.pipeline):
            results = self.reports.results
            if results is not None:  # the next minibatch to report moved with it
                results.start = results.next = self.pipeline.minibatches_fed


def _adapter_names(module: nn.Module) -> set[str]:
    """The attribute names under which ``peft``'s layers keep their adapters (``lora_A``,
    ``lora_B``, ...): a base model's file has none of their tensors, which keep the values
    ``peft`` gave them."""
    return {
        name
        for m in module.modules()
        for name in getattr(m, "adapter_layer_names", ())
        if isinstance(name, str)
    }


def _stage(m: StageMemory) -> int:
    return m.stage


def _move_outside(module: nn.Module, pipelined: nn.Module, device: torch.device) -> None:
    """Move ``module``'s parameters and buffers outside ``pipelined`` to ``device``: a subtree
    without it by its own ``to`` (a torchmetrics metric moves its states so), the modules
    above it by their own tensors only."""
    if module is pipelined:
        return
    if not any(m is pipelined for m in module.modules()):
        module.to(device)
        return
    with torch.no_grad():
        for p in module._parameters.values():
            if p is not None:
                p.data = p.data.to(device)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = b.to(device)
    if hasattr(module, "_device"):  # Lightning's device mixin: what ``module.device`` says
        object.__setattr__(module, "_device", device)
    for child in module.children():
        _move_outside(child, pipelined, device)
