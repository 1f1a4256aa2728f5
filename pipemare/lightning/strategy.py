"""Lightning strategy: ``Trainer(strategy="pipemare")`` pipelines an unchanged LightningModule.

The strategy is glue between Lightning's hooks and :class:`~pipemare.engine.pipeline.Pipeline`;
each hook delegates to the module that does its job:

- setup checks the arguments, precision, layout and cut (:mod:`~pipemare.lightning.checks`);
  the pipeline is built at the first batch (:mod:`~pipemare.lightning.build`);
- ``training_step`` feeds the batch to the pipeline, which runs this process's share of the
  schedule, weight updates included, and returns without waiting for the batch to reach the
  last stage; the user's steps run per microbatch (:mod:`~pipemare.lightning.steps`), and the
  loss and ``self.log`` values a step reports are those of the minibatch ``L`` steps earlier,
  ``L`` the pipeline's depth in steps (:mod:`~pipemare.lightning.training`; shown as ``lag`` in
  the progress bar);
- ``backward`` does nothing and ``optimizer_step`` only runs Lightning's closure: the engine
  already applied each stage's update (manual optimisation: :mod:`~pipemare.lightning.manual`);
- validation and test run pipelined after draining the pipeline (their batches overlap);
- checkpoints hold the whole model and optimiser state (:mod:`~pipemare.lightning.checkpointing`,
  written without draining by :mod:`~pipemare.lightning.saving`).

Two modes: one stage per process (``devices=P``: Lightning's launchers, torchrun or SLURM,
gloo on CPU and NCCL on CUDA, see :mod:`~pipemare.lightning.launching`), or every stage in one
process (``devices=1``, ``stages=P``). Lightning ships two packages with separate strategy
registries; ``import pipemare`` registers the strategy in ``pytorch_lightning`` and, when
installed, in ``lightning.pytorch`` (:mod:`~pipemare.lightning.registry`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from pipemare.engine.heartbeat import Heartbeat
from pipemare.engine.lagged import result_lag
from pipemare.engine.pipeline import Pipeline
from pipemare.lightning import build, checks, launching, registry
from pipemare.lightning.launching import LightningAPI
from pipemare.lightning.model_state import ModelStateHooks
from pipemare.lightning.module_adapter import ModuleAdapter
from pipemare.lightning.processes import ProcessesMixin
from pipemare.lightning.saving import SaveQueue
from pipemare.lightning.steps import UserSteps
from pipemare.lightning.training import Evaluation, GradStash, TrainingReports
from pipemare.model.cuts import find_pipelined
from pipemare.optim.config import PipeMareConfig
from pipemare.schedule.actions import spec
from pipemare.schedule.delay import StageDelay, derive_delays

__all__ = ["PipeMareStrategy", "register"]


class _PipeMareStrategyMixin(ProcessesMixin, ModelStateHooks):
    """Implementation shared by the ``pytorch_lightning`` and ``lightning.pytorch`` classes.

    Lightning's process properties and collectives are :class:`ProcessesMixin`'s, the hooks
    that need the whole model :class:`ModelStateHooks`'; the rest go to the modules above.
    """

    strategy_name = "pipemare"
    _lightning: LightningAPI

    def __init__(
        self,
        stages: int | None = None,
        microbatches: int = 1,
        schedule: str = "pipemare",
        balance: Sequence[int] | str = "time",
        config: PipeMareConfig | None = None,
        sequential: str | None = None,
        module: str | None = None,
        split_points: Sequence[str] | None = None,
        start_method: str = "popen",
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        stall_timeout: float = 300.0,
        recompute: bool = False,
        heartbeat_timeout: float | None = 30.0,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        if checkpoint_io is None:  # atomic on any local filesystem (lightning.checkpoint_io)
            checkpoint_io = self._lightning.AtomicCheckpointIO()  # type: ignore[misc]
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        checks.check_arguments(
            stages=stages,
            microbatches=microbatches,
            schedule=schedule,
            balance=balance,
            config=config,
            sequential=sequential,
            module=module,
            split_points=split_points,
            start_method=start_method,
            timeout=timeout,
            stall_timeout=stall_timeout,
            recompute=recompute,
            heartbeat_timeout=heartbeat_timeout,
        )
        self.stages, self.microbatches, self.schedule = stages, microbatches, schedule
        self.balance: Sequence[int] | str = balance
        self.config = (
            config if config is not None else PipeMareConfig.for_schedule(spec(schedule).corrected)
        )
        self.sequential, self.recompute = sequential, recompute
        self.module_name = module if module is not None else sequential
        self.split_points = None if split_points is None else list(split_points)
        self._start_method, self._timeout = start_method, timeout
        self.stall_timeout = float(stall_timeout)
        self.heartbeat_timeout = None if heartbeat_timeout is None else float(heartbeat_timeout)
        self._num_nodes = 1
        self._failed = False
        self.pipeline: Pipeline | None = None
        self._adapter: ModuleAdapter | None = None
        self._steps: UserSteps | None = None
        self._reports = TrainingReports()
        self._evaluation = Evaluation()
        self._grads = GradStash()
        self._probes = build.ProbeRequests()
        self._pending_state: dict[str, Any] | None = None  # pipemare's part of a checkpoint
        self._trained: dict[str, Any] | None = None  # the loaded checkpoint's run
        self._saves = SaveQueue(self._write_file, self._remove_file)  # bound: spawn pickles
        #: set by a ConvergenceMonitor: it diagnoses a non-finite loss instead of the strategy
        self.divergence_monitored = False
        #: latest per-stage telemetry, filled by pipemare's monitors: stage -> name -> value
        self.stage_stats: dict[int, dict[str, float]] = {}

    # -- pipemare's own properties -----------------------------------------------------------

    @property
    def _known_stages(self) -> int | None:
        """P, where known: given, one per process, or one per layer of the Sequential."""
        if self.num_stages is not None:
            return self.num_stages
        seq = self._adapter.sequential if self._adapter else None
        return len(seq) if seq is not None else None

    @property
    def delays(self) -> tuple[StageDelay, ...]:
        """Every stage's delays, derived from the schedule (see :func:`pipemare.derive_delays`)."""
        p = self._known_stages
        if p is None:
            raise RuntimeError(
                "the number of stages is known once the Trainer set the strategy up; pass stages=P"
            )
        return derive_delays(self.schedule, p, self.microbatches)

    @property
    def lag(self) -> int:
        """Steps by which a training step's reported loss and logs trail its own minibatch."""
        return result_lag(self.schedule, self._known_stages or 1, self.microbatches)

    @property
    def reported_step(self) -> int | None:
        """The training step (counted from 1) whose minibatch the latest step's loss and logs
        belong to; None before any was reported."""
        return self._reports.returned or None

    # -- setup and the pipeline (built at the first batch: timing the layers needs one) -----

    def setup(self, trainer: pl.Trainer) -> None:
        self._failed = False
        checks.check_precision(self._lightning, self.precision_plugin)
        module = self._module
        checks.check_trainer(module, trainer)
        path, _ = find_pipelined(module, self.module_name)
        self._adapter = adapter = ModuleAdapter(module, path, self.split_points)
        checks.check_split_points(adapter, self.split_points)
        stages = build.check_cut(self) or self.num_stages or 2  # segments: at the first batch
        adapter.check_no_outside_parameters()
        self._steps = UserSteps(module, self._adapter, self.precision_plugin.forward_context)
        self.pipeline = None
        with checks.one_optimizer():
            super().setup(trainer)
        if self._fitting and self.optimizers:
            optimizer = build.stepped(self.optimizers)
            checks.check_optimizer(optimizer, self.schedule, stages, self.microbatches, self.config)
        if self.distributed and dist.is_initialized():
            launching.SigtermRelay(trainer, self._lightning, self).install()
        checks.ignore_moot_warnings()

    def request_probe(self, **settings: Any) -> None:
        """Ask for telemetry (:class:`pipemare.engine.telemetry.Probe`); monitors call this in
        setup."""
        self._probes.request(**settings)
        if self.pipeline is not None:
            self._probes.attach(self.pipeline)

    def _build(self, batch: Any, step: str, args: tuple) -> Pipeline:
        adapter = self._adapter
        assert adapter is not None
        if self.pipeline is None:
            build.prepare_model(self, batch, step, args)
            # later rebuilds (after fit, for test) cut the same way
            self.balance = build.balance_for(self, batch, step, args)
            self.pipeline = pipe = build.pipeline(self)
            self._load_pending_state()
            build.announce(self, pipe)
            self._reports.start(build.results(self, pipe.minibatches_fed), adapter.path)
            pipe.executor.on_minibatch = lambda k, loss: self._steps_of().publish(k, float(loss))
            pipe.executor.on_nonfinite = self._reports.record_nonfinite
            self._probes.attach(pipe)
        if adapter.segmented:  # segments run the graph traced in the module's mode
            adapter.sequential.train(adapter.pipelined.training)  # type: ignore[union-attr]
        return self.pipeline

    def _steps_of(self) -> UserSteps:
        assert self._steps is not None, "the strategy has not been set up by a Trainer yet"
        return self._steps

    @property
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        assert module is not None, "the strategy has no LightningModule yet"
        return module

    @property
    def _fitting(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == self._lightning.TrainerFn.FITTING

    # -- Lightning's step hooks ---------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int, *args: Any) -> torch.Tensor:
        steps = self._steps_of()
        with steps.manual.pipelined():  # under manual optimisation: see lightning.manual
            pipe = self._build(batch, "training_step", (batch_idx, *args))
            loss = self._reports.step(
                pipe,
                steps,
                batch,
                (batch_idx, *args),
                trainer=self._module.trainer,
                lag=self.lag,
                device=self.root_device,
                monitored=self.divergence_monitored,
            )
        self._write_due()  # checkpoints whose step reached every stage by now
        if self.lag:
            self._module.log("lag", float(self.lag), prog_bar=True, logger=False)
        steps.manual.after_step(lambda: self._grads.stash(pipe))
        return torch.tensor(loss, device=self.root_device)

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return closure_loss  # the pipeline ran every backward pass inside training_step

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        self._steps_of().manual.check_step()  # manual optimisation: the engine steps
        result = closure()  # runs training_step, in which the stages applied their updates
        self._grads.restore()
        return result

    def _evaluate(self, step: str, batch: Any, batch_idx: int, args: tuple) -> Any:
        pipe = self._build(batch, step, (batch_idx, *args))
        ahead = self.num_stages - 1 if self.distributed else 0  # type: ignore[operator]
        return self._evaluation.step(
            pipe,
            self._steps_of(),
            step,
            batch,
            batch_idx,
            args,
            results=lambda start: build.results(self, start),
            microbatches=self.microbatches,
            ahead=ahead,
            trainer=self._module.trainer,
            device=self.root_device,
        )

    def validation_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._evaluate("validation_step", batch, batch_idx, args)

    def test_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._evaluate("test_step", batch, batch_idx, args)

    def predict_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._evaluate("predict_step", batch, batch_idx, args)

    # -- starts and ends of loops: drain before evaluating, consolidate after a run ---------

    def on_validation_start(self) -> None:
        self._drain()

    def on_test_start(self) -> None:
        self._drain()

    def on_predict_start(self) -> None:
        self._drain()

    def on_train_end(self) -> None:
        self._drain()
        self._reports.check_unreported(self.pipeline)
        self._consolidate()

    def on_validation_end(self) -> None:
        if not self._fitting:  # validation inside fit keeps the pipeline
            self._consolidate()

    def on_test_end(self) -> None:
        self._consolidate()

    def on_predict_end(self) -> None:
        self._consolidate()

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        # this process is failing: no report from its heartbeat now, and its silence tells the
        # others (no "finished" is posted)
        Heartbeat.finish_current(False, f"{type(exception).__name__}: {exception}")
        self._saves.abandon(warn=self._lightning.rank_zero_warn)
        launching.end_launched_processes(self, exception)

    def teardown(self) -> None:
        self._grads.restore()
        if not self._failed:  # a normal end: the other processes stop watching this one
            Heartbeat.finish_current()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register pipemare's names in Lightning's strategy registry (Lightning calls this
        for each strategy class)."""
        registry.register_strategies(cls, strategy_registry)


_STRATEGY_DOC = """Asynchronous pipeline parallelism for an unchanged LightningModule.

    Args:
        stages: P. Default: the number of devices (one stage per process), or with
            ``devices=1`` one stage per child of the Sequential (the paper's fine-grained
            pipeline, simulated in one process with the same staleness).
        microbatches: N microbatches per batch; the batch size must be at least N.
        schedule: ``pipemare`` (default), ``async``, ``pipedream``, ``1f1b`` or ``gpipe``.
        balance: layers per stage: ``"time"`` (measured forward+backward time of each layer on
            the first batch, default), ``"auto"`` (the planner's cut for this P and N from a
            profile of time, memory and the engine's costs, see :mod:`pipemare.planner`),
            ``"params"``, ``"even"`` or a list of counts.
        config: :class:`~pipemare.PipeMareConfig` (T1, T2, T3); default per schedule.
        module: attribute path of the module to pipeline (``"gpt"``); default the one child
            holding the trainable parameters. A Sequential is cut between its children, any
            other module traced at the first batch and cut at its repeated blocks
            (:func:`pipemare.model.segments.segment_module`). ``sequential``: its former name.
        split_points: cuts of a module that is not a Sequential, each before the named module
            (``["gpt.transformer.h.2"]``); default its pipeline plan or its repeated blocks.
        start_method: how Lightning starts processes: ``popen`` (default), ``spawn``, ``fork``.
        timeout: the process group's timeout (default 30 minutes).
        stall_timeout: seconds a process waits for another stage before it fails, naming that
            stage, its rank, host and PID (default 300; raise it if one rank can be busy that
            long alone, e.g. writing a very large checkpoint). A live process that makes no
            progress (a deadlock) is found this way; a dead or stopped one by its heartbeat.
        heartbeat_timeout: seconds without a heartbeat from another process after which it is
            named as lost (killed, stopped, hung in a native call, unreachable) and every
            process exits non-zero, however long a step takes (default 30; None: off). See
            :mod:`pipemare.engine.heartbeat`.
        recompute: activation recomputation: every stage but the last keeps only its input
            per in-flight microbatch and reruns its forward at backward time, with the weights
            its backward uses (under ``async``/``pipemare`` those are backward-time weights,
            so the activations differ from the saved-activation default; exact for ``gpipe``,
            ``1f1b`` and ``pipedream``).

    With ``stages`` below the process count (``devices * num_nodes``), the processes run
    ``devices * num_nodes / stages`` data-parallel copies of the pipeline
    (:class:`~pipemare.engine.layout.RankLayout`: ranks ``r*P .. r*P+P-1`` form copy ``r``); each
    copy trains on its share of every batch and a stage's copies average their gradients
    before each update.

    Example::

        trainer = Trainer(strategy=PipeMareStrategy(microbatches=4), accelerator="cpu", devices=2)
        trainer = Trainer(strategy="pipemare_gpipe", devices=1)   # a baseline, by name
        trainer = Trainer(strategy=PipeMareStrategy(stages=2), devices=4)  # 2 copies x 2 stages
    """

PipeMareStrategy = registry.strategy_class(
    _PipeMareStrategyMixin, "pytorch_lightning", __name__, _STRATEGY_DOC
)
LightningPipeMareStrategy = registry.lightning_strategy_class(
    _PipeMareStrategyMixin, __name__, _STRATEGY_DOC
)


def register() -> None:
    """Register ``"pipemare"`` (and the ``pipemare_<schedule>`` variants) with Lightning."""
    registry.register(PipeMareStrategy, LightningPipeMareStrategy)
