"""Lightning strategy: ``Trainer(strategy="pipemare")`` pipelines an unchanged LightningModule.

:class:`PipeMareStrategyMixin` holds the behaviour, its hooks in the order Lightning calls them,
as in Lightning's own ``DDPStrategy``: ``__init__`` stores the arguments, ``setup`` decides where
this process sits, the hooks run. Two short subclasses serve Lightning's two packages by
ordinary inheritance: :class:`PipeMareStrategy` (``pytorch_lightning``) and
:class:`LightningPipeMareStrategy` (``lightning.pytorch``, where installed); each names its
:class:`~pipemare.lightning.packages.LightningPackage`. ``import pipemare`` registers both.

The hooks hand work to the :class:`~pipemare.lightning.runner.PipelineRunner`, which builds the
pipeline at the first batch from the run's plan and drives it: ``training_step`` feeds the
batch and returns the loss of the minibatch ``L`` steps earlier (``lag`` in the progress bar);
``backward`` does nothing and ``optimizer_step`` only runs Lightning's closure (the stages
applied their updates); validation and test run pipelined after a drain; checkpoints hold the
whole model, written without draining (:mod:`~pipemare.lightning.checkpoint`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import signal
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.strategies import ParallelStrategy
from typing_extensions import override

from pipemare.engine.build import compile_options
from pipemare.engine.heartbeat import Heartbeat, announce
from pipemare.engine.layout import RankLayout
from pipemare.engine.link import Link
from pipemare.engine.pipeline import Pipeline
from pipemare.engine.transport import DistributedTransport, destroy_at_exit
from pipemare.engine.watchdog import Watchdog
from pipemare.lightning import checks, shards
from pipemare.lightning.launching import SigtermRelay, restarts_share_the_store
from pipemare.lightning.packages import LIGHTNING, PYTORCH_LIGHTNING, LightningPackage
from pipemare.lightning.runner import PipelineOptions, PipelineRunner, Placement
from pipemare.lines import text
from pipemare.model.materialize import has_meta, meta_parameters, whole_state_collected
from pipemare.optim.config import PipeMareConfig
from pipemare.optim.settings import RunSettings
from pipemare.planner.decide import Advice
from pipemare.planner.report import parse_bytes
from pipemare.planner.stage_memory import StageMemory
from pipemare.schedule.actions import SCHEDULES
from pipemare.schedule.delay import StageDelay

if TYPE_CHECKING:  # the mixin is typed over the base each subclass gives it
    from pytorch_lightning.strategies.launchers.launcher import _Launcher

    _StrategyBase = ParallelStrategy
else:
    _StrategyBase = object

__all__ = ["LightningPipeMareStrategy", "PipeMareStrategy", "PipeMareStrategyMixin", "register"]


class PipeMareStrategyMixin(_StrategyBase):
    """Asynchronous pipeline parallelism for an unchanged LightningModule.

    Args:
        stages: P. Default: the number of devices (one stage per process), or with
            ``devices=1`` one stage per child of the Sequential (the paper's fine-grained
            pipeline, simulated in one process with the same staleness).
        microbatches: N microbatches per batch; the batch size must be at least N.
            ``"auto"`` (default): N = P on a schedule that never flushes, so that no stage's
            weights are a whole update late on average, capped at the smallest batch's size;
            on ``gpipe`` and ``1f1b`` the divisor of the batch whose step, replayed from each
            layer's forward and backward measured at that N, is the fastest (1 for a model with
            BatchNorm) (:mod:`pipemare.planner.decide`); a run resumed from a checkpoint of
            the same schedule and P keeps its N. The choice and its reason are printed with
            the run's settings; :attr:`microbatches` is None until the first batch.
        schedule: ``pipemare`` (default), ``async``, ``pipedream``, ``1f1b`` or ``gpipe``.
        balance: layers per stage: ``"time"`` (measured forward+backward time of each layer on
            the first batch, with the training step's code around the model counted on the
            first and last stages; default), ``"auto"`` (the planner's cut for this P and N from a
            profile of time, memory and the engine's costs, see :mod:`pipemare.planner`),
            ``"params"``, ``"even"`` or a list of counts.
        config: :class:`~pipemare.PipeMareConfig` (T1, T2, T3); default per schedule.
        module: attribute path of the module to pipeline (``"gpt"``); default the one child
            holding the trainable parameters. A Sequential is cut between its children, any
            other module traced at the first batch and cut at its repeated blocks
            (:func:`pipemare.model.segments.segment_module`). ``sequential``: its former name.
        split_points: cuts of a module that is not a Sequential, each before the named module
            (``["gpt.transformer.h.2"]``); default its pipeline plan or its repeated blocks.
        dynamic_shapes: which input sizes of a traced module may change between batches:
            ``"auto"`` (default) the batch, and the length of token-like inputs (rank 1 to 3:
            ids, masks, labels, embeddings), as padding each batch to its longest sequence
            needs; ``"all"`` every size, images' height and width included (tracing may then
            take minutes on windowed vision transformers such as Swin).
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
        simulated_link: run the links between neighbouring stages' processes as if they were
            slower, e.g. ``"1Gb/s@1ms"`` or ``"10Gb/s@20us"`` (bandwidth, then latency): each
            message is received no earlier than its send time plus the latency plus its bytes
            over the bandwidth, a link's messages one after another. For checking what a
            slower network would cost on one machine; the replays the run prints take this
            link. Processes over torch.distributed only (default None: the real links).
        recompute: activation recomputation: every stage but the last keeps only its input
            per in-flight microbatch and reruns its forward at backward time, with the weights
            its backward uses (under ``async``/``pipemare`` those are backward-time weights,
            so the activations differ from the saved-activation default; exact for ``gpipe``,
            ``1f1b`` and ``pipedream``). On whenever the model has Hugging Face's gradient
            checkpointing on (``model.gradient_checkpointing_enable()``): its per-layer
            checkpoints do not survive the trace, so the run honours it per stage.
        compile: ``torch.compile`` each stage's forward: True (its defaults: inductor) or a
            dict of its options (``backend``, ``mode``, ``dynamic``, ``fullgraph``,
            ``options``). A pipelined module the user passed through ``torch.compile`` (or
            ``.compile()``) is unwrapped and compiled stage by stage the same way, with
            ``torch.compile``'s defaults unless ``compile`` gives options. The backward
            still uses the weights the schedule gives it: no weight copies under ``pipemare``
            (:mod:`pipemare.engine.nostash`). Compiling the LightningModule itself is refused
            by Lightning for strategies other than its own.
        microbatch_weights: each microbatch's share of its batch's loss, so that the
            minibatch's loss and gradient are one device's. ``"auto"`` (default): for a Hugging
            Face model its share of the counted label tokens (labels other than -100, a
            causal LM's after its shift by one), else its share of the rows; ``"rows"``;
            ``"tokens"``: its share of the labels other than -100 in the batch's ``labels``
            entry or its last element (``(inputs, targets)``), for a loss that averages over
            them (``cross_entropy(..., ignore_index=-100)``); or a function from the list of
            microbatches to their shares.
        advise: an asynchronous schedule times the model's layers at every N 1F1B could run
            for the first batch, and the engine's own cost per action, on this device, replays
            both schedules and says in the run's first lines (and its stored settings) which
            reaches the quality sooner: the step ratio times the steps to quality that
            reference tasks measured for this schedule, optimiser family, P and N, or "not
            measured" outside them (:class:`~pipemare.planner.decide.Advice`; default True;
            False skips the measurement).
        weights: a file of one device's weights to start from (``torch.save`` of the
            LightningModule's or the pipelined module's ``state_dict()``, a Lightning
            checkpoint, a ``.safetensors`` file, or a Hugging Face ``save_pretrained``
            directory, sharded or not): each process reads only its own stage's tensors, at
            the first batch, cast to its parameters' dtype. A head tied to the embedding that
            the file leaves out is read under the embedding's name; ``peft``'s wrapped names
            (``base_model.model.``, ``.base_layer``) under the base model's, and its adapters
            keep the values ``peft`` gave them. With a model built on the meta device it
            replaces the initialisation.
        memory_limit: the bytes one stage may hold on a CPU (an int, or ``"8GiB"``); on CUDA
            the device's free memory is read instead. At the first batch of a fit every stage's
            memory is predicted (weights, gradients, optimiser state, correction buffers and
            the activations of its microbatches in flight), printed, and a stage that would
            not fit is refused before the first step, with the fixes.
        measure_activations: count, on every stage, the bytes its in-flight microbatches keep
            for their backward passes (``strategy.pipeline.stages[i].peak_saved_bytes``, to
            check the memory the run predicted). It takes a Python hook per tensor autograd
            saves, 8-10% of a forward and backward on a small GPT, so it is off by default
            (default False; stages that recompute, stash, run T2 or are compiled count anyway).

    A model built in ``configure_model`` (or under ``trainer.init_module(empty_init=True)``)
    is built on the meta device, its buffers real: at setup it is cut by parameter counts and
    each process gives real storage only to its own stage's layers, initialised by each
    module's ``reset_parameters()`` (or the model's ``init_weights()``), or read from
    ``weights``. After the run each process still holds its stage only; :meth:`gather` gives
    it the whole model where that fits. A model built in ``__init__`` is cut at the first
    batch as before, each process moving only its own stage to its device, and gathered
    whole after each run.

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

    strategy_name = "pipemare"
    #: what this class takes from its Lightning package (set by each subclass)
    _package: ClassVar[LightningPackage]
    #: pipemare's names in Lightning's registry: (name, arguments, description)
    _REGISTERED: tuple[tuple[str, dict[str, Any], str], ...] = (
        ("pipemare", {}, "PipeMare asynchronous pipeline: corrected, no flush, no weight stash"),
        ("pipemare_spawn", {"start_method": "spawn"}, "pipemare launched with spawn"),
        ("pipemare_fork", {"start_method": "fork"}, "pipemare launched with fork (notebooks)"),
        *(
            (f"pipemare_{name}", {"schedule": name}, f"pipemare engine with the {name!r} schedule")
            for name in SCHEDULES
            if name != "pipemare"
        ),
    )

    def __init__(
        self,
        stages: int | None = None,
        microbatches: int | str = "auto",
        schedule: str = "pipemare",
        balance: Sequence[int] | str = "time",
        config: PipeMareConfig | None = None,
        sequential: str | None = None,
        module: str | None = None,
        split_points: Sequence[str] | None = None,
        dynamic_shapes: str = "auto",
        start_method: str = "popen",
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        stall_timeout: float = 300.0,
        recompute: bool = False,
        heartbeat_timeout: float | None = 30.0,
        simulated_link: str | Link | None = None,
        compile: bool | dict[str, Any] = False,
        microbatch_weights: str | Callable[[list[Any]], list[float]] = "auto",
        advise: bool = True,
        weights: str | os.PathLike[str] | None = None,
        memory_limit: int | str | None = None,
        save_distributed_checkpoint: bool | None = None,
        measure_activations: bool = False,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        if checkpoint_io is None:  # atomic on any local filesystem (lightning.checkpoint_io)
            checkpoint_io = self._package.checkpoint_io()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        checks.check_strategy_arguments(
            stages=stages,
            microbatches=microbatches,
            schedule=schedule,
            balance=balance,
            config=config,
            sequential=sequential,
            module=module,
            split_points=split_points,
            dynamic_shapes=dynamic_shapes,
            start_method=start_method,
            timeout=timeout,
            stall_timeout=stall_timeout,
            recompute=recompute,
            heartbeat_timeout=heartbeat_timeout,
            compile=compile,
            microbatch_weights=microbatch_weights,
        )
        for name, value in (("advise", advise), ("measure_activations", measure_activations)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        link = None if simulated_link is None else Link.parse(simulated_link)
        if save_distributed_checkpoint not in (None, True, False):
            raise ValueError(
                "save_distributed_checkpoint must be True (per-stage shards), False (one file "
                f"of the whole model) or None (shards where no process holds the whole model), "
                f"got {save_distributed_checkpoint!r}"
            )
        if weights is not None and not os.path.exists(weights):
            raise ValueError(
                f"weights={weights!r} does not exist; pass the path of a torch.save of the "
                "model's state_dict(), a Lightning checkpoint, a .safetensors file or a "
                "save_pretrained directory"
            )
        self._options = PipelineOptions(
            stages=stages,
            microbatches=microbatches,
            schedule=schedule,
            balance=balance if isinstance(balance, str) else list(balance),
            config=config,
            module=module if module is not None else sequential,
            split_points=None if split_points is None else list(split_points),
            dynamic_shapes=dynamic_shapes,
            recompute=recompute,
            compile=compile_options(compile),
            microbatch_weights=microbatch_weights,
            stall_timeout=float(stall_timeout),
            heartbeat_timeout=None if heartbeat_timeout is None else float(heartbeat_timeout),
            simulated_link=link,
            advise=advise,
            weights=None if weights is None else os.fspath(weights),
            memory_limit=None if memory_limit is None else _bytes(memory_limit),
            save_distributed_checkpoint=save_distributed_checkpoint,
            measure_activations=measure_activations,
        )
        self._start_method, self._timeout = start_method, timeout
        self._num_nodes = 1
        self._failed = False
        self._divergence_delegated = False
        self._stepping = False  # inside optimizer_step, which runs Lightning's closure
        self._runner = PipelineRunner(
            self._options,
            self._package,
            self._write_file,
            self._remove_file,
            self._end_launched,
            self._write_shards,
        )

    # -- the arguments, as given -----------------------------------------------------------------

    @property
    def options(self) -> PipelineOptions:
        """The arguments as given (``"auto"`` and None not yet decided): what the runner
        builds from."""
        return self._options

    @property
    def stages(self) -> int | None:
        """P as given (None: one per process, or in one process one per layer)."""
        return self.options.stages

    @property
    def schedule(self) -> str:
        return self.options.schedule

    @property
    def asked_config(self) -> PipeMareConfig | None:
        """The corrections as given (None: the schedule's default), resolved for the run when
        the pipeline is built (:attr:`settings`)."""
        return self.options.config

    @property
    def recompute(self) -> bool:
        """Whether stages recompute: as given, or once the pipeline is built, as the run
        decided (Hugging Face's gradient checkpointing turns it on)."""
        plan = self._runner.plan
        return plan.recompute if plan is not None else self.options.recompute

    # -- where this process sits: Lightning's properties ---------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Machines the run spans (Lightning sets it from ``Trainer(num_nodes=...)``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this machine: one per device Lightning gave the strategy."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed(self) -> bool:
        """One stage per process (else every stage runs in this process)."""
        return self.num_processes * self.num_nodes > 1

    @property
    def is_distributed(self) -> bool:
        """Whether the stages run in several processes (Lightning reads it for ``sync_dist``
        and its samplers)."""
        return self.distributed

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """How Lightning's sampler splits the data: by copy of the pipeline, not by process."""
        # every stage of a copy of the pipeline sees the same batches; the copies split them
        if not self.distributed:
            return {"num_replicas": 1, "rank": 0}
        layout = self.rank_layout
        return {"num_replicas": layout.replicas, "rank": layout.position(self.global_rank)[0]}

    # -- the pipeline's shape: what was given or, once built, decided --------------------------

    @property
    def num_stages(self) -> int | None:
        """P: given, or one per process; in one process without ``stages``, the Sequential's
        layer count once the model is cut (None before). The run's plan, once made, is the
        only source."""
        plan = self._runner.plan
        if plan is not None:
            return plan.stages
        if self.distributed:
            world = self.num_processes * self.num_nodes
            return self.stages if self.stages is not None else world
        return self.stages if self.stages is not None else self._runner.stages

    @property
    def rank_layout(self) -> RankLayout:
        """Which processes form each copy of the pipeline and which hold each stage's replicas
        (:class:`~pipemare.engine.layout.RankLayout`): ``devices * num_nodes / stages`` copies."""
        stages = self.num_stages if self.distributed else 1
        assert stages is not None
        return RankLayout(self.num_processes * self.num_nodes, stages, max(self.num_processes, 1))

    @property
    def replicas(self) -> int:
        """D: data-parallel copies of the pipeline (1 unless ``stages`` < the process count)."""
        return self.rank_layout.replicas if self.distributed else 1

    @property
    def microbatches(self) -> int | None:
        """N: as given, or for ``"auto"`` as decided at the first batch (None before)."""
        return self._runner.microbatches

    @property
    def delays(self) -> tuple[StageDelay, ...] | None:
        """Every stage's delays, derived from the schedule (see :func:`pipemare.derive_delays`);
        None until P and N are known."""
        return self._runner.delays

    @property
    def lag(self) -> int | None:
        """Steps by which a training step's reported loss and logs trail its own minibatch;
        None until P and N are known."""
        return self._runner.lag

    @property
    def balance(self) -> list[int] | None:
        """Layers per stage, as the pipeline was cut (None before the first batch cut it)."""
        return self._runner.cut

    @property
    def pipeline(self) -> Pipeline | None:
        """The running pipeline; None before the first batch and after a run consolidated it."""
        return self._runner.pipeline

    @property
    def settings(self) -> RunSettings | None:
        """What the run does and why (:class:`~pipemare.optim.settings.RunSettings`: the
        layout, the corrections, T1's horizon, each decision with its reason), as its first
        lines print it; None before the first batch built the pipeline."""
        pipe = self._runner.pipeline
        return None if pipe is None else pipe.settings

    @property
    def memory(self) -> list[StageMemory] | None:
        """Every stage's memory as predicted before the first step of a fit
        (:class:`~pipemare.planner.stage_memory.StageMemory`); None before."""
        return self._runner.memory

    @property
    def advice(self) -> Advice | None:
        """Which schedule reaches the quality sooner on this model and device: the step
        replayed from its layers as measured at the first batch, the steps to quality from
        reference tasks (:class:`~pipemare.planner.decide.Advice`); None before it, or where
        the run does not advise (see ``advise``)."""
        plan = self._runner.plan
        return None if plan is None else plan.advice

    def set_run_length(self, total_steps: int) -> int | None:
        """Run on as a run now known to be ``total_steps`` optimiser steps long (e.g. a time
        budget that stops it before ``max_steps``): the settings are renewed
        (:meth:`~pipemare.optim.settings.RunSettings.for_run_length`); returns T1's new horizon,
        or None where the run's length does not set it (or before the first batch)."""
        pipe = self._runner.pipeline
        return None if pipe is None else pipe.optimizer.set_run_length(total_steps)

    @property
    def update(self) -> tuple[int | None, int] | None:
        """``(stage, minibatch)`` of the update whose gradient hooks are running (0-based
        minibatch), None outside them: in a pipeline ``trainer.global_step`` is the step
        running, and a stage applies an earlier minibatch's update. The stage is None where
        the hooks see every stage at once (one process, ``gpipe`` or ``1f1b``;
        :mod:`~pipemare.lightning.hooks`)."""
        hooks = self._runner.hooks
        return None if hooks is None else hooks.update

    @property
    def reported_step(self) -> int | None:
        """The training step (counted from 1) whose minibatch the latest step's loss and logs
        belong to; None before any was reported."""
        return self._runner.reports.returned or None

    # -- launch: one process per stage ---------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        """Lightning's launcher for one process per stage, or none when every stage runs here.

        ``popen`` re-runs the user's script once per extra process (Lightning's default for
        scripts; torchrun and SLURM start the processes themselves and Lightning detects them);
        the other methods use :mod:`torch.multiprocessing`.
        """
        checks.check_layout(self.stages, self.num_processes, self.num_nodes)
        checks.check_precision(self._package, self.precision_plugin)
        package = self._package
        if not self.distributed:
            self._launcher = None
        elif self._start_method == "popen":
            assert self.cluster_environment is not None
            launcher = package.script_launcher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
            self._launcher = cast("_Launcher", launcher)  # the package's own launcher class
        else:
            self._launcher = package.spawn_launcher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.distributed:
            self._connect()

    def set_world_ranks(self) -> None:
        """Tell the cluster environment and both packages' ``rank_zero_only`` this rank."""
        env = self.cluster_environment
        if env is not None:
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            env.set_world_size(self.num_nodes * self.num_processes)
        # loggers write from rank 0 only, whichever package's decorator guards them
        for package in (PYTORCH_LIGHTNING, LIGHTNING):
            if package is not None:
                # the decorator carries its rank as an attribute that its type does not declare
                package.rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _connect(self) -> None:
        """Seed, set the ranks and join the default process group (gloo on CPU, NCCL on CUDA)."""
        reset_seed()
        self.set_world_ranks()
        backend = _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None, "Lightning gives a strategy its environment"
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        destroy_at_exit()
        if restarts_share_the_store():
            self._package.rank_zero_warn(text("torchrun.restarts"))

    # -- setup: this process's place, decided; the pipeline is built at the first batch ---------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._failed = False
        checks.check_precision(self._package, self.precision_plugin)
        module = self.lightning_module
        assert module is not None, "the strategy has no LightningModule yet"
        checks.check_trainer(module, trainer)
        if trainer.state.fn == "fit":
            checks.check_hooks(module)
        self._runner.setup(module, self._placement(), self.precision_plugin.forward_context)
        with checks.one_optimizer():
            super().setup(trainer)
        self._runner.attach_optimizers(self.optimizers)
        if self._runner.fitting:
            self._runner.check_optimizer()
        if self.distributed and dist.is_initialized():
            relay = SigtermRelay(
                trainer, self._package.sigterm, self.options.stall_timeout, self._watchdog
            )
            relay.install()
        checks.ignore_moot_warnings()

    def _watchdog(self) -> Watchdog | None:
        """The pipeline's watchdog over the other processes, once there is a pipeline."""
        transport = self.pipeline.transport if self.pipeline is not None else None
        return transport.watchdog if isinstance(transport, DistributedTransport) else None

    def _placement(self) -> Placement:
        """Where this process sits in the run, as the runner needs it."""
        return Placement(
            distributed=self.distributed,
            stages=self.num_stages,
            layout=self.rank_layout if self.distributed else None,
            global_rank=self.global_rank,
            device=self.root_device,
            broadcast=self.broadcast,
        )

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)``: parameters on the meta device, buffers
        real; each process makes its own stage real at setup. Otherwise Lightning's."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with meta_parameters(), self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: parameters on the meta device, buffers real (see
        :meth:`tensor_init_context`)."""
        with meta_parameters():
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """A model built on the meta device takes a checkpoint's weights after setup, once its
        stage is real."""
        module = self.lightning_module
        return module is not None and has_meta(module)

    @override
    def model_to_device(self) -> None:
        """Only what lies outside the pipelined module moves now; each process moves (or, built
        on the meta device, makes real) its own stage's layers only."""
        self._runner.place_model(self.root_device)

    def gather(self) -> None:
        """Give this process the whole model, every stage's weights (collective: call it on
        every process). After a run, a model built on the meta device holds only this
        process's stage; call this where the whole model fits, e.g. to save it whole."""
        self._runner.gather()

    def request_probe(self, **settings: Any) -> None:
        """Ask for telemetry (:class:`pipemare.engine.telemetry.Probe`); monitors call this in
        setup. Switches are or-ed over the callers, intervals take the shortest asked for."""
        self._runner.request_probe(**settings)

    def delegate_divergence(self) -> None:
        """Let a callback (``ConvergenceMonitor``) diagnose a non-finite loss: the strategy then
        no longer stops the run with ``NonFiniteLossError``; the callback decides."""
        self._divergence_delegated = True

    # -- Lightning's step hooks -----------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch, batch_idx, *rest = args
        checks.check_step_in_optimizer_step(self._runner.module, self._stepping)
        loss = self._runner.train(batch, (batch_idx, *rest), monitored=self._divergence_delegated)
        lag = self._runner.lag
        if lag:
            self._runner.module.log("lag", float(lag), prog_bar=True, logger=False)
        return torch.tensor(loss, device=self.root_device)

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return closure_loss  # the pipeline ran every backward pass inside training_step

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        self._runner.steps.manual.check_step()  # manual optimisation: the engine steps
        self._stepping = True
        try:
            result = closure()  # runs training_step, in which the stages applied their updates
        finally:
            self._stepping = False
        self._runner.restore_grads()
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, batch_idx, *rest = args
        return self._runner.evaluate("validation_step", batch, batch_idx, tuple(rest))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, batch_idx, *rest = args
        return self._runner.evaluate("test_step", batch, batch_idx, tuple(rest))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, batch_idx, *rest = args
        return self._runner.evaluate("predict_step", batch, batch_idx, tuple(rest))

    # -- starts and ends of loops: drain before evaluating, consolidate after a run -------------

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        module = self.lightning_module
        if module is not None and module.trainer.sanity_checking:
            self._runner.build_before_sanity_check()  # from the first training batch
        self._runner.drain()
        self._runner.trace_eval()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._runner.drain()
        self._runner.trace_eval()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._runner.drain()
        self._runner.trace_eval()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._runner.finish_training()
        self._runner.consolidate()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if not self._runner.fitting:  # validation inside fit keeps the pipeline
            self._runner.consolidate()

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self._runner.consolidate()

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._runner.consolidate()

    # -- checkpoints: the whole model, collected without draining ---------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model; during training the state each stage has once the step's
        minibatch has reached it, collected without draining
        (:mod:`~pipemare.lightning.checkpoint`)."""
        return self._runner.module_state()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The user's optimiser state for the whole model, plus pipemare's own under "pipemare"."""
        return self._runner.checkpoints.optimizer_state(optimizer, self._runner.pipeline)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        self._runner.save(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._runner.checkpoints.saves.remove(filepath)

    def _write_file(self, checkpoint: dict[str, Any], filepath: Any, options: Any) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options=options)

    def _remove_file(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)

    def _write_shards(self, tensors: dict[str, Any], meta: dict[str, Any], filepath: Any) -> None:
        path = self.broadcast(os.fspath(filepath))  # every process writes under rank 0's name
        shards.write(tensors, meta if self.is_global_zero else None, path, self.barrier)

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """A directory of per-stage shards is read lazily, each process later reading only its
        stage's tensors; a single file is memory-mapped, so that a process touches only the
        bytes of the tensors it keeps (a remote one is read as Lightning reads it)."""
        path = os.fspath(checkpoint_path)
        if shards.is_sharded(path):
            return shards.ShardedCheckpoint(path).checkpoint()
        if "://" in path or not os.path.isfile(path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        except RuntimeError as error:  # written without the zip format: cannot be mapped
            if "mmap" not in str(error):
                raise
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Lightning's, noting how the checkpoint's run was laid out and corrected, which
        validate, test and predict report (they restore no optimiser state). Where the model
        was built on the meta device only the real tensors are read now, this process's
        stage's once it is real (:meth:`PipelineRunner.keep_state_for_build`)."""
        self._runner.checkpoints.note_trained(checkpoint)
        module = self.lightning_module
        assert module is not None
        state = checkpoint["state_dict"]
        if not has_meta(module):
            if isinstance(state, shards.ShardedEntries):
                state = state.read(state)
            module.load_state_dict(state, strict=strict)
            return
        with whole_state_collected():  # names only: no warning about the meta entries
            if strict:
                checks.check_state_keys(module, state)
            own = module.state_dict(keep_vars=True)
        real = [k for k, v in own.items() if not v.is_meta]
        if self._runner.built is None:  # no stage real yet: filled in once this one is
            self._runner.keep_state_for_build(state)
        module.load_state_dict(shards.read_local(state, real), strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore the user's optimisers and pipemare's state (corrections, the run's settings,
        each stage's random stream) from a checkpoint; applied when the pipeline is built."""
        self._runner.load_optimizer_states(self.optimizers, checkpoint["optimizer_states"])

    # -- collectives (identity in one process) ----------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if self.distributed and dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (self.distributed and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and self.distributed:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- the end: an error, then teardown ---------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._failed = True
        # this process is failing: no report from its heartbeat now, and its silence tells the
        # others (no "finished" is posted)
        Heartbeat.finish_current(False, f"{type(exception).__name__}: {exception}")
        self._runner.checkpoints.saves.abandon(warn=self._package.rank_zero_warn)
        self._end_launched(exception)

    def _end_launched(self, error: BaseException | None = None) -> None:
        """After an error in the process that launched the others (``start_method="popen"``),
        end them as Lightning does after Ctrl-C: a stage left waiting, or stopped, would hold
        its device until its own deadline, or forever. torchrun's agent and ``srun
        --kill-on-bad-exit`` do the same for the jobs they start.

        ``error`` is printed first: Lightning's launcher ends this process within seconds of a
        child's failed exit, which can come before this process's traceback is printed."""
        launcher = getattr(self, "_launcher", None)
        if isinstance(launcher, self._package.script_launcher) and launcher.procs:
            if error is not None:
                announce(error)
            launcher.kill(signal.SIGKILL)

    @override
    def teardown(self) -> None:
        self._runner.restore_grads()
        if not self._failed:  # a normal end: the other processes stop watching this one
            Heartbeat.finish_current()
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            # Only after an error: a run ends by consolidating. Moving meta stages to the CPU
            # would raise and hide the original error, so skip that step of the teardown.
            for part in (
                self.cluster_environment,
                self.precision_plugin,
                self.accelerator,
                self.checkpoint_io,
            ):
                if part is not None:
                    part.teardown()
            return
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register pipemare's names in Lightning's strategy registry (Lightning calls this
        for each strategy class); a name already there is kept."""
        for name, params, description in cls._REGISTERED:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **params)


class PipeMareStrategy(PipeMareStrategyMixin, ParallelStrategy):
    __doc__ = PipeMareStrategyMixin.__doc__
    _package = PYTORCH_LIGHTNING


#: :class:`PipeMareStrategy` for ``lightning.pytorch``; None where that package is absent.
LightningPipeMareStrategy: type[PipeMareStrategyMixin] | None = None

if importlib.util.find_spec("lightning") is not None:
    from lightning.pytorch.strategies import ParallelStrategy as _LightningParallelStrategy

    class _LightningPipeMareStrategy(PipeMareStrategyMixin, _LightningParallelStrategy):  # type: ignore[misc]
        """:class:`PipeMareStrategy` for ``lightning.pytorch``: the same mixin over that
        package's ``ParallelStrategy`` (Lightning's two packages have separate base classes
        and registries, and a class cannot derive from both). The ignore: mypy sees the
        mixin typed over ``pytorch_lightning``'s base, whose signatures name that package's
        Trainer and plugins; at run time the mixin's ``super()`` is this package's base."""

        _package = LIGHTNING  # type: ignore[assignment]

    _LightningPipeMareStrategy.__name__ = _LightningPipeMareStrategy.__qualname__ = (
        "LightningPipeMareStrategy"
    )
    LightningPipeMareStrategy = _LightningPipeMareStrategy


def _bytes(value: int | str) -> int:
    """``memory_limit`` in bytes: an int as it is, a string such as ``"8GiB"`` read."""
    if isinstance(value, bool) or (isinstance(value, int) and value <= 0):
        raise ValueError(
            f"memory_limit must be a positive number of bytes or e.g. '8GiB', got {value!r}"
        )
    if isinstance(value, int):
        return value
    try:
        return parse_bytes(value)
    except Exception as err:  # argparse's error type: said as a ValueError here
        raise ValueError(f"memory_limit: {err}") from None


def register() -> None:
    """Register ``"pipemare"`` (and the ``pipemare_<schedule>`` variants) with Lightning:
    :class:`PipeMareStrategy` in ``pytorch_lightning`` and, when installed,
    :class:`LightningPipeMareStrategy` in ``lightning.pytorch``."""
    from pytorch_lightning.strategies import StrategyRegistry

    PipeMareStrategy.register_strategies(StrategyRegistry)
    if LightningPipeMareStrategy is not None:
        from lightning.pytorch.strategies import StrategyRegistry as LightningRegistry

        LightningPipeMareStrategy.register_strategies(LightningRegistry)
