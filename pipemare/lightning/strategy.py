"""Lightning strategy: ``Trainer(strategy="pipemare")`` pipelines an unchanged LightningModule.

The strategy is glue between Lightning's hooks and :class:`~pipemare.engine.pipeline.Pipeline`:

- ``training_step`` feeds the batch to the pipeline, which runs this process's share of the
  schedule, weight updates included, and returns without waiting for the batch to reach the
  last stage; the user's steps run per microbatch (:mod:`~pipemare.lightning.steps`), and the loss
  and
  ``self.log`` values a step reports are those of the minibatch ``L`` steps earlier, ``L`` the
  pipeline's depth in steps (:mod:`pipemare.engine.lagged`; shown as ``lag`` in the progress bar);
- ``backward`` does nothing and ``optimizer_step`` only runs Lightning's closure: the engine
  already applied each stage's update when the schedule called for it;
- validation and test run pipelined after draining the pipeline (a batch's microbatches
  overlap across stages, and in one process per stage consecutive batches overlap too);
- checkpoints hold the whole model and optimiser state (:mod:`pipemare.lightning.checkpointing`).

Two modes: one stage per process (``devices=P``: Lightning's launchers, torchrun or SLURM,
gloo on CPU and NCCL on CUDA, see :mod:`~pipemare.lightning.launching`), or every stage in one
process
(``devices=1``, ``stages=P``). Lightning ships two packages with separate strategy registries;
``import pipemare`` registers the strategy in ``pytorch_lightning`` and, when installed, in
``lightning.pytorch``.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn

from pipemare.engine.errors import NonFiniteGradientError, NonFiniteLossError
from pipemare.engine.lagged import DistributedResults, LocalResults, Results, result_lag
from pipemare.engine.layout import RankLayout
from pipemare.engine.microbatch import batch_size, combine, scatter
from pipemare.engine.pipeline import Pipeline
from pipemare.engine.telemetry import Probe
from pipemare.engine.transport import DistributedTransport
from pipemare.lightning import checkpointing, launching
from pipemare.lightning.launching import START_METHODS, LightningAPI
from pipemare.lightning.module_adapter import ModuleAdapter, find_sequential
from pipemare.lightning.saving import SaveQueue
from pipemare.lightning.steps import (
    UserSteps,
    check_last_batch,
    closes_epoch,
    closes_loader,
    merge_published,
)
from pipemare.model import partition
from pipemare.optim.config import PipeMareConfig
from pipemare.schedule.actions import SCHEDULES, spec
from pipemare.schedule.delay import StageDelay, derive_delays

__all__ = ["PipeMareStrategy", "register"]

_BALANCES = ("time", "auto", "params", "even")


if TYPE_CHECKING:  # the mixin is combined with a Lightning ParallelStrategy at run time
    from pytorch_lightning.strategies import ParallelStrategy as _Base
else:
    _Base = object


class _PipeMareStrategyMixin(_Base):
    """Implementation shared by the ``pytorch_lightning`` and ``lightning.pytorch`` classes."""

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
        start_method: str = "popen",
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        stall_timeout: float = 300.0,
        recompute: bool = False,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        if (
            checkpoint_io is None
        ):  # atomic on any local filesystem (pipemare.lightning.checkpoint_io)
            checkpoint_io = self._lightning.AtomicCheckpointIO()  # type: ignore[misc]
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        spec(schedule)  # a clear error for an unknown name, before anything runs
        if stages is not None and (
            isinstance(stages, bool) or not isinstance(stages, int) or stages < 1
        ):
            raise ValueError(f"stages must be a positive integer, got {stages!r}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
        counts = isinstance(balance, (list, tuple)) and all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in balance
        )
        if balance not in _BALANCES and not (counts and len(balance) > 0):
            raise ValueError(
                f"balance must be one of {', '.join(_BALANCES)} or a list of layer counts (a "
                f"whole number >= 1 per stage, e.g. [3, 2]), got {balance!r}"
            )
        if config is not None and not isinstance(config, PipeMareConfig):
            raise TypeError(
                f"config must be a pipemare.PipeMareConfig, got {type(config).__name__}; "
                "e.g. PipeMareConfig(warmup_steps=20)"
            )
        if config is not None:  # refused here, before anything runs, not at the first batch
            config.for_stashing(schedule, spec(schedule).stashes)
        if start_method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}"
            )
        if sequential is not None and not isinstance(sequential, str):
            raise ValueError(
                "sequential must name the nn.Sequential attribute as a string, e.g. 'net' or "
                f"'model.layers', got {sequential!r}"
            )
        if not isinstance(timeout, datetime.timedelta):
            raise ValueError(
                "timeout (for connecting the processes) must be a datetime.timedelta, e.g. "
                f"datetime.timedelta(minutes=30), got {timeout!r}"
            )
        self.stages, self.microbatches, self.schedule = stages, microbatches, schedule
        self.balance: Sequence[int] | str = balance
        self.config = (
            config if config is not None else PipeMareConfig.for_schedule(spec(schedule).corrected)
        )
        self.sequential = sequential
        if (
            isinstance(stall_timeout, bool)
            or not isinstance(stall_timeout, (int, float))
            or not 0 < stall_timeout < math.inf
        ):
            raise ValueError(
                f"stall_timeout must be a positive, finite number of seconds, got {stall_timeout!r}"
            )
        if not isinstance(recompute, bool):
            raise ValueError(
                f"recompute must be True or False, got {recompute!r}; True keeps only each "
                "stage's inputs and reruns its forward at backward time"
            )
        self.recompute = recompute
        self._start_method, self._timeout = start_method, timeout
        self.stall_timeout = float(stall_timeout)
        self._num_nodes = 1
        self.pipeline: Pipeline | None = None
        self._adapter: ModuleAdapter | None = None
        self._steps: UserSteps | None = None
        self._train_results: Results | None = None
        self._eval_results: Results | None = None
        self._eval_index = 0  # evaluation batches run so far, in every loop alike
        self._last_loss = math.nan  # the latest minibatch loss reported
        #: set by a ConvergenceMonitor: it diagnoses a non-finite loss instead of the strategy
        self.divergence_monitored = False
        self._pending_state: dict[str, Any] | None = None
        # minibatch -> (stage, parameter names): updates skipped for non-finite gradients
        self._bad_grads: dict[int, tuple[int, list[str]]] = {}
        self._returned = 0  # the step whose loss the latest training step returned
        self._diverged = False  # a monitored run met a non-finite loss
        self._saves = SaveQueue(self._write_file, self._remove_file)  # bound: spawn pickles
        self._grad_stash: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._probe_settings: dict[str, Any] = {}
        #: latest per-stage telemetry, filled by pipemare's monitors: stage -> name -> value
        self.stage_stats: dict[int, dict[str, float]] = {}

    # -- devices, ranks, launch ------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed(self) -> bool:
        """One stage per process (else every stage runs in this process)."""
        return self.num_processes * self.num_nodes > 1

    @property
    def is_distributed(self) -> bool:  # Lightning reads it for sync_dist and samplers
        return self.distributed

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # every stage of a copy of the pipeline sees the same batches; the copies split them
        if not self.distributed:
            return {"num_replicas": 1, "rank": 0}
        layout = self.rank_layout
        return {"num_replicas": layout.replicas, "rank": layout.position(self.global_rank)[0]}

    @property
    def num_stages(self) -> int | None:
        if self.distributed:
            return self.stages if self.stages is not None else self._world_size
        return self.stages if self.stages is not None else None

    @property
    def _world_size(self) -> int:
        return self.num_processes * self.num_nodes

    @property
    def rank_layout(self) -> RankLayout:
        """Which processes form each copy of the pipeline and which hold each stage's replicas
        (:class:`~pipemare.engine.layout.RankLayout`): ``devices * num_nodes / stages`` copies."""
        stages = self.num_stages if self.distributed else 1
        assert stages is not None
        return RankLayout(self._world_size, stages, max(self.num_processes, 1))

    @property
    def replicas(self) -> int:
        """D: data-parallel copies of the pipeline (1 unless ``stages`` < the process count)."""
        return self.rank_layout.replicas if self.distributed else 1

    @property
    def delays(self) -> tuple[StageDelay, ...]:
        """Every stage's delays, derived from the schedule (see :func:`pipemare.derive_delays`)."""
        p = (
            self.num_stages
            if self.num_stages is not None
            else (len(self._adapter.sequential) if self._adapter else None)
        )
        if p is None:
            raise RuntimeError(
                "the number of stages is known once the Trainer set the strategy up; pass stages=P"
            )
        return derive_delays(self.schedule, p, self.microbatches)

    def _check_layout(self) -> None:
        world = self._world_size
        if world > 1 and self.stages is not None and world % self.stages:
            fits = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f"PipeMareStrategy(stages={self.stages}) with devices={self.num_processes} and "
                f"num_nodes={self.num_nodes}: {world} processes cannot run whole copies of a "
                f"{self.stages}-stage pipeline; use stages={' or '.join(map(str, fits))} "
                f"(devices*num_nodes/stages copies, each a pipeline), change the device count, "
                f"or devices=1 to simulate the {self.stages} stages in one process"
            )

    def _check_precision(self) -> None:
        lt, p = self._lightning, self.precision_plugin
        name = getattr(p, "precision", "32-true")
        ok = (
            (type(p) is lt.Precision)
            or (isinstance(p, lt.MixedPrecision) and name == "bf16-mixed")
            or (isinstance(p, lt.HalfPrecision) and name == "bf16-true")
        )
        if not ok:
            raise ValueError(
                f"pipemare supports precision '32-true', 'bf16-mixed' and 'bf16-true', not "
                f"{name!r} ({type(p).__name__}); float16 needs loss scaling across stages, which "
                "pipemare does not do: use precision='bf16-mixed'"
            )

    def _configure_launcher(self) -> None:
        self._check_layout()
        self._check_precision()
        self._launcher = launching.make_launcher(self, self._start_method)

    def set_world_ranks(self) -> None:
        launching.set_world_ranks(self)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.distributed:
            launching.connect(self, self._timeout)

    # -- collectives (identity in one process) ----------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        if self.distributed and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (self.distributed and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and self.distributed:
            return self._lightning.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- setup --------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        self._check_precision()
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                "pipemare applies each stage's optimiser step itself; manual optimization "
                "(self.automatic_optimization = False) is not supported"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}: a pipeline already "
                "accumulates over its microbatches; use PipeMareStrategy(microbatches=N) instead"
            )
        clip = trainer.gradient_clip_val
        if clip is not None and not (isinstance(clip, (int, float)) and 0 <= clip < math.inf):
            raise ValueError(
                f"gradient_clip_val={clip!r}: a clipping threshold must be a positive number; "
                "pass one, or 0 or None for no clipping"
            )
        path, seq = find_sequential(module, self.sequential)
        stages = self._check_cut(f"{type(module).__name__}.{path}", seq)
        self._adapter = ModuleAdapter(module, path)
        self._adapter.check_no_outside_parameters()
        self._steps = UserSteps(module, self._adapter, self.precision_plugin.forward_context)
        self.pipeline = None
        try:
            super().setup(trainer)
        except RuntimeError as err:  # Lightning's words would send the user to manual optimization
            if "multiple optimizers" not in str(err) or "optimizer_idx" in str(err):
                raise
            raise ValueError(
                "pipemare steps one optimiser, stage by stage; configure_optimizers returned "
                "several (Lightning runs several only with manual optimization, which pipemare "
                "does not support). Return one optimiser, with a parameter group for each part "
                "that needs other settings, e.g. torch.optim.Adam([{'params': body.parameters()}"
                ", {'params': head.parameters(), 'lr': 1e-4}])"
            ) from err
        self._check_optimizer(stages)
        if self.distributed and dist.is_initialized():
            launching.SigtermRelay(trainer, self._lightning, self).install()
        # The pipeline steps the optimiser per stage; before its first update a non-flushing
        # pipeline is still filling, which torch would otherwise report as a wrong call order.
        warnings.filterwarnings(
            "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before"
        )

    def _check_cut(self, what: str, seq: nn.Sequential) -> int:
        """Refuse, before anything runs, a Sequential that cannot be cut as asked; return P."""
        partition.check_sequential(seq, what)
        stages = self.num_stages or len(seq)
        if stages > len(seq):
            raise ValueError(
                f"cannot cut {what} ({len(seq)} layers) into {stages} stages: every stage needs "
                f"at least one layer; use at most {len(seq)} stages or split the model into more "
                "layers"
            )
        if self.balance in ("time", "auto", "params") and stages < len(seq):
            partition.check_ties(seq, stages, what=what)  # their cut keeps tied layers together
            return stages
        if isinstance(self.balance, str):
            balance = partition.even_balance(len(seq), stages)
        else:
            balance = list(self.balance)
            if len(balance) != stages:
                run = (
                    f"stages={self.num_stages}"
                    if self.distributed and self.stages is not None
                    else "one per process"
                    if self.distributed
                    else f"stages={self.stages}"
                    if self.stages is not None
                    else f"one per layer of {what}, the default with devices=1"
                )
                also = "" if self.distributed else f", or pass stages={len(balance)}"
                raise ValueError(
                    f"balance {balance} lists {len(balance)} stages but the run has {stages} "
                    f"({run}); give one layer count per stage{also}"
                )
            partition.check_balance(balance, len(seq), what)
        partition.check_ties(seq, stages, balance, what)
        return stages

    def _check_optimizer(self, stages: int) -> None:
        """Refuse, before any update, an optimiser the pipeline cannot step (LBFGS) or that a
        correction set to True cannot serve: the checks the pipeline makes when it is built."""
        from pipemare.optim.optimizer import PipeMareOptimizer

        if not self._fitting or not self.optimizers:
            return
        delays = derive_delays(self.schedule, stages, self.microbatches)
        with warnings.catch_warnings():  # "auto" corrections that stand aside say so later
            warnings.simplefilter("ignore")
            PipeMareOptimizer(
                self.optimizers[0], {}, delays, self.config, total_steps=1, steps_per_epoch=1
            )

    # -- telemetry --------------------------------------------------------------------------

    def request_probe(self, **settings: Any) -> None:
        """Ask for telemetry (:class:`pipemare.engine.telemetry.Probe`); monitors call this in
        setup."""
        for key, value in settings.items():
            old = self._probe_settings.get(key)
            if isinstance(value, bool):
                self._probe_settings[key] = bool(old) or value
            elif value:
                self._probe_settings[key] = min(old, value) if old else value
        if self.pipeline is not None:
            self._attach_probe(self.pipeline)

    def _attach_probe(self, pipe: Pipeline) -> None:
        if not self._probe_settings:
            return
        if pipe.probe is None:
            pipe.probe = Probe()
        assert pipe.probe is not None
        pipe.probe.merge(**self._probe_settings)

    # -- building the pipeline (at the first batch: timing the layers needs one) -------------

    def _optimizer(self, seq: nn.Sequential) -> torch.optim.Optimizer:
        if len(self.optimizers) > 1:
            raise ValueError(
                "pipemare steps one optimiser; configure_optimizers returned several: return "
                "one, with a parameter group for each part that needs other settings"
            )
        # Lightning's stand-in when configure_optimizers returns None is not the user's
        if self.optimizers and type(self.optimizers[0]).__name__ != "_MockOptimizer":
            return self.optimizers[0]
        return torch.optim.SGD(seq.parameters(), lr=0.0)  # never stepped with a real rate

    def _choose_balance(
        self, seq: nn.Sequential, stages: int, sample: Any, step: str, args: tuple
    ) -> list[int]:
        if not isinstance(self.balance, str):
            return list(self.balance)
        if self.balance == "even" or stages == len(seq):
            return partition.even_balance(len(seq), stages)
        if self.balance == "params":
            return partition.balance_by_params(seq, stages)
        balance = None
        if self.global_rank == 0:  # time on one process, so every process cuts alike
            assert self._adapter is not None
            with self._steps_of().discarding_logs(), torch.random.fork_rng(devices=[]):
                x = self._adapter.capture_input(step, scatter(sample, self.microbatches)[0], *args)
                if self.balance == "auto":
                    balance = self._plan_balance(seq, x, stages)
                else:
                    with self.precision_plugin.forward_context():  # time what will run
                        balance = partition.balance_by_time(seq, x, stages)
        return self.broadcast(balance, src=0)

    def _plan_balance(self, seq: nn.Sequential, x: Any, stages: int) -> list[int]:
        """``balance="auto"``: the planner's cut for this P and N (:mod:`pipemare.planner.planner`),
        from a profile of the layers with the run's optimiser type and corrections."""
        from pipemare.planner import planner

        opt = self._optimizer(seq)
        make = type(opt)

        def optimizer(params: Any) -> torch.optim.Optimizer:
            try:
                return make(params, **opt.defaults)
            except TypeError:  # a constructor that does not take its own defaults back
                return torch.optim.SGD(params, lr=0.0)

        return planner.auto_balance(
            seq,
            x,
            stages,
            self.microbatches,
            self.schedule,
            optimizer=optimizer,
            config=self.config,
            forward_context=self.precision_plugin.forward_context,
        )

    def _run_length(self, trainer: Any) -> dict[str, Any]:
        """The run's optimiser steps and steps per epoch, for T1's horizon, where known."""
        if not self._fitting:
            return {}
        out = {}
        total = trainer.estimated_stepping_batches
        if isinstance(total, (int, float)) and math.isfinite(total):
            out["total_steps"] = int(total)
        per_epoch = trainer.num_training_batches
        if isinstance(per_epoch, (int, float)) and math.isfinite(per_epoch):
            out["steps_per_epoch"] = int(per_epoch)
        return out

    def _build(self, batch: Any, step: str, args: tuple) -> Pipeline:
        assert self._adapter is not None
        seq = self._adapter.sequential
        stages = self.num_stages or len(seq)
        if self.pipeline is None:
            if self._fitting:
                check_last_batch(self._module.trainer, self.microbatches)
            saved = (self._pending_state or {}).get("layout")
            if isinstance(self.balance, str) and saved and saved["stages"] == stages:
                balance = list(saved["balance"])  # a resume cuts as the run it continues did
            else:
                balance = self._choose_balance(seq, stages, batch, step, args)
            self.balance = balance  # later rebuilds (after fit, for test) cut the same way
            trainer = self._module.trainer
            clip_val = trainer.gradient_clip_val if self._fitting else None
            algorithm = trainer.gradient_clip_algorithm or "norm"
            clip: dict[str, Any] = {}
            if clip_val:
                clip = {
                    "clip_grad_norm" if algorithm == "norm" else "clip_grad_value": float(clip_val)
                }
            steps = self._steps_of()
            self.pipeline = Pipeline(
                seq,
                self._optimizer(seq),
                steps.loss,
                stages=stages,
                microbatches=self.microbatches,
                schedule=self.schedule,
                balance=balance,
                config=self.config,
                transport=self._transport(),
                device=self.root_device,
                input_fn=steps.input,
                target_fn=lambda mb: mb,
                forward_context=self.precision_plugin.forward_context,
                recompute=self.recompute,
                **clip,
                **self._run_length(trainer),
            )
            if self.distributed:
                self._lightning.rank_zero_info(self.rank_layout.describe())
            self._lightning.rank_zero_info(
                f"pipemare: {stages} stages "
                f"({'one per process' if self.distributed else 'in one process'}), "
                f"layers per stage {balance}, schedule {self.schedule!r}, N={self.microbatches}, "
                f"corrections: {self.pipeline.optimizer.describe() or 'none'}"
            )
            self._load_pending_state()
            self._train_results = self._results(self.pipeline.minibatches_fed)
            self.pipeline.executor.on_minibatch = lambda k, loss: steps.publish(k, float(loss))
            self.pipeline.executor.on_nonfinite = self._record_nonfinite
            self._attach_probe(self.pipeline)
        return self.pipeline

    def _transport(self) -> Any:
        if not self.distributed:
            return "inprocess"
        return DistributedTransport(
            self.num_stages,
            self.root_device,
            stall_timeout=self.stall_timeout,
            layout=self.rank_layout,
        )

    def _results(self, start: int) -> Results:
        """Where the last stage publishes results for every process (see pipemare.engine.lagged)."""
        if not self.distributed:
            return LocalResults(start)
        assert self.pipeline is not None
        transport = self.pipeline.transport
        assert isinstance(transport, DistributedTransport)
        last = transport.rank_of(transport.num_stages - 1)
        layout = self.rank_layout
        merge_group = None
        if layout.replicas > 1:  # the copies' last stages combine their results first
            group = dist.new_group(list(layout.stage_groups[-1]), backend="gloo")  # on every rank
            merge_group = group if self.global_rank == last else None
        return DistributedResults(
            last,
            start,
            watchdog=transport.watchdog,
            ranks=layout.pipelines[transport.replica],
            merge_group=merge_group,
            merge=merge_published,
        )

    @property
    def lag(self) -> int:
        """Steps by which a training step's reported loss and logs trail its own minibatch."""
        p = self.num_stages or (len(self._adapter.sequential) if self._adapter else 1)
        return result_lag(self.schedule, p, self.microbatches)

    @property
    def reported_step(self) -> int | None:
        """The training step (counted from 1) whose minibatch the latest step's loss and logs
        belong to; None before any was reported."""
        return self._returned or None

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
        pipe = self._build(batch, "training_step", (batch_idx, *args))
        steps = self._steps_of()
        steps.begin("training_step", batch, (batch_idx, *args))
        assert self._train_results is not None
        steps.results = self._train_results
        k = pipe.minibatches_fed
        pipe.step(batch)
        # Report what every process already has: minibatch k - L. Wait for more only at a
        # run's first step (Lightning needs a loss from every rank) and at an epoch's last
        # (so epoch aggregates cover exactly this epoch's minibatches).
        first = self._train_results.next == self._train_results.start
        upto = k if first or closes_epoch(self._module.trainer) else k - self.lag
        losses = steps.replay_through(upto, self.root_device)
        if losses:
            # the latest loss, or the first non-finite one caught up with (monitors see it)
            j = next((j for j, v in enumerate(losses) if not math.isfinite(v)), len(losses) - 1)
            self._last_loss = losses[j]
            self._returned = self._train_results.next - len(losses) + j + 1
            self._check_finite(losses)
        self._write_due()  # checkpoints whose step reached every stage by now
        if self.lag:
            self._module.log("lag", float(self.lag), prog_bar=True, logger=False)
        self._stash_grads()
        return torch.tensor(self._last_loss, device=self.root_device)

    def _check_finite(self, losses: list[float]) -> None:
        """Stop at a non-finite loss, on every process at the same step (the losses are the
        same everywhere); a ConvergenceMonitor, when attached, diagnoses it instead. Stop at
        non-finite gradients where the loss was finite, on the process that met them."""
        assert self._train_results is not None
        first = self._train_results.next - len(losses)  # the minibatch of losses[0]
        for k, loss in enumerate(losses, start=first):
            if not math.isfinite(loss):
                if not self.divergence_monitored:
                    raise NonFiniteLossError(k + 1, self._last_stage, loss, self._where(-1))
                self._bad_grads.clear()  # the run diverged: the monitor decides from here on
                self._diverged = True
            bad = self._bad_grads.pop(k, None)
            if bad is not None and math.isfinite(loss):
                raise NonFiniteGradientError(k + 1, bad[0], bad[1], self._where(bad[0]))

    @property
    def _last_stage(self) -> int:
        assert self.pipeline is not None
        return self.pipeline.num_stages - 1

    def _where(self, stage: int) -> str:
        """The text ", rank r" for ``stage`` (-1: the last) with a process per stage, else ""."""
        pipe = self.pipeline
        assert pipe is not None
        if not isinstance(pipe.transport, DistributedTransport):
            return ""
        return f", rank {pipe.transport.rank_of(stage % pipe.num_stages)}"

    def _record_nonfinite(self, stage: int, minibatch: int, names: list[str]) -> None:
        # The update was skipped. Raise when the minibatch's results arrive: a non-finite loss
        # then stops every process alike; a finite one means the backward itself overflowed.
        if self._diverged:
            return
        assert self._adapter is not None
        names = [f"{self._adapter.path}.{n}" for n in names]
        self._bad_grads.setdefault(minibatch, (stage, names))

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return closure_loss  # the pipeline ran every backward pass inside training_step

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        result = closure()  # runs training_step, in which the stages applied their updates
        self._restore_grads()
        return result

    def _stash_grads(self) -> None:
        # Lightning zeroes gradients after training_step; a non-flushing pipeline carries
        # partial gradients of in-flight minibatches across steps, so keep them aside.
        assert self.pipeline is not None
        self._grad_stash = []
        for i in self.pipeline.local_stages:
            for p in self.pipeline.optimizer.stage_parameters(i):
                self._grad_stash.append((p, p.grad))
                p.grad = None

    def _restore_grads(self) -> None:
        for p, g in self._grad_stash:
            p.grad = g
        self._grad_stash = []

    def _evaluate(self, step: str, batch: Any, batch_idx: int, args: tuple) -> Any:
        pipe = self._build(batch, step, (batch_idx, *args))
        steps = self._steps_of()
        steps.begin(step, batch, (batch_idx, *args))
        if self._eval_results is None:
            self._eval_results = self._results(0)
        steps.results = self._eval_results
        j, self._eval_index = self._eval_index, self._eval_index + 1
        n = min(self.microbatches, batch_size(batch))
        outputs = pipe.evaluate(batch, input_fn=steps.input, head=steps.head, microbatches=n)
        if outputs is not None:  # the last stage
            sizes = [batch_size(c) for c in scatter(batch, n)]
            steps.publish(j, combine(outputs, sizes))
        # With a process per stage, stage 0 runs up to P - 1 batches ahead of the last stage;
        # predictions are collected per batch, so predict reports each batch's own.
        lag = self.num_stages - 1 if self.distributed and step != "predict_step" else 0  # type: ignore[operator]
        upto = j if closes_loader(self._module.trainer, batch_idx, args) else j - lag
        values = steps.replay_through(upto, self.root_device)
        return values[-1] if values else None

    def validation_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._evaluate("validation_step", batch, batch_idx, args)

    def test_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._evaluate("test_step", batch, batch_idx, args)

    def predict_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._evaluate("predict_step", batch, batch_idx, args)

    def _drain(self) -> None:
        if self.pipeline is not None:
            self.pipeline.drain()
            self.pipeline.sync_buffers()  # the copies evaluate (and save) copy 0's buffers
            self._write_due()

    def on_validation_start(self) -> None:
        self._drain()

    def on_test_start(self) -> None:
        self._drain()

    def on_predict_start(self) -> None:
        self._drain()

    def _consolidate(self) -> None:
        """Give every process the whole model again (as DDP leaves it): each held one stage."""
        self._drain()
        if self.distributed and self.pipeline is not None:
            full = self._gather_state(all_ranks=True)
            for module in self.pipeline.stage_modules:
                if any(p.is_meta for p in module.parameters()):
                    module.to_empty(device=self.root_device)
            self._module.load_state_dict(full)
            self.pipeline = None  # its stages are no longer split; the next run rebuilds it

    def on_train_end(self) -> None:
        self._drain()
        if self._bad_grads:  # skipped updates of minibatches whose results never came
            k, (stage, names) = min(self._bad_grads.items())
            raise NonFiniteGradientError(k + 1, stage, names, self._where(stage))
        self._consolidate()

    def on_validation_end(self) -> None:
        if not self._fitting:  # validation inside fit keeps the pipeline
            self._consolidate()

    def on_test_end(self) -> None:
        self._consolidate()

    def on_predict_end(self) -> None:
        self._consolidate()

    def on_exception(self, exception: BaseException) -> None:
        lost = self._saves.abandon()
        if lost:
            self._lightning.rank_zero_warn(
                f"pipemare: {len(lost)} checkpoint(s) not written, their step's updates had not "
                f"reached every stage when the run stopped: {', '.join(lost)}; the files written "
                "before are intact"
            )
        launching.end_launched_processes(self)

    def teardown(self) -> None:
        self._restore_grads()
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

    # -- checkpoints: one ordinary checkpoint with the whole model ---------------------------

    def _gather_state(self, all_ranks: bool = False) -> dict[str, Any]:
        assert self._adapter is not None and self.pipeline is not None
        prefix = self._adapter.path + "."
        return checkpointing.module_state(self._module, self.pipeline, prefix, all_ranks)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model; during training the state each stage has once the step's
        minibatch has reached it, collected without draining (:mod:`~pipemare.lightning.saving`)."""
        if self.pipeline is None:
            return self._module.state_dict()
        assert self._adapter is not None
        return self._saves.module_state(self._module, self.pipeline, self._adapter.path + ".")

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The user's optimiser state for the whole model, plus pipemare's own under "pipemare"."""
        if self.pipeline is None:
            return optimizer.state_dict()
        return self._saves.optimizer_state(optimizer, self.pipeline)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        self._saves.save(checkpoint, filepath, storage_options, self.pipeline)
        self._write_due()

    def remove_checkpoint(self, filepath: Any) -> None:
        self._saves.remove(filepath)

    def _write_file(self, checkpoint: dict[str, Any], filepath: Any, options: Any) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options=options)

    def _remove_file(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)

    def _write_due(self) -> None:
        if self._adapter is not None:
            self._saves.poll(self._module, self.pipeline, self._adapter.path + ".")

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        for optimizer, state in zip(self.optimizers, states, strict=False):
            optimizer.load_state_dict({k: v for k, v in state.items() if k != "pipemare"})
            if "pipemare" in state:
                self._pending_state = state["pipemare"]
        if self.pipeline is not None and self._pending_state is not None:
            self._load_pending_state()
            if self._train_results is not None:  # the next minibatch to report moved with it
                self._train_results.start = self._train_results.next = self.pipeline.minibatches_fed

    def _load_pending_state(self) -> None:
        if self._pending_state is None:
            return
        assert self.pipeline is not None
        notes = checkpointing.load_pipemare_state(self.pipeline, self._pending_state)
        self._pending_state = None
        if notes:
            self._lightning.rank_zero_warn(
                "pipemare: resuming a checkpoint saved with another layout; the weights, the "
                "optimiser's state and the step count carry over; " + "; ".join(notes)
            )

    # -- registration -------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries: list[tuple[str, dict[str, Any], str]] = [
            ("pipemare", {}, "PipeMare asynchronous pipeline: T1 + T2, no flush, no weight stash"),
            ("pipemare_spawn", {"start_method": "spawn"}, "pipemare launched with spawn"),
            ("pipemare_fork", {"start_method": "fork"}, "pipemare launched with fork (notebooks)"),
        ]
        entries += [
            (f"pipemare_{name}", {"schedule": name}, f"pipemare engine with the {name!r} schedule")
            for name in SCHEDULES
            if name != "pipemare"
        ]
        for name, params, description in entries:
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=description, **params)


def _make(package: str) -> type[_PipeMareStrategyMixin]:
    lt = LightningAPI(package)
    cls = type(
        "PipeMareStrategy",
        (_PipeMareStrategyMixin, lt.strategies.ParallelStrategy),
        {"__module__": __name__, "__doc__": _STRATEGY_DOC, "_lightning": lt},
    )
    return cls


_STRATEGY_DOC = """Asynchronous pipeline parallelism for an unchanged LightningModule.

    Args:
        stages: P. Default: the number of devices (one stage per process), or with
            ``devices=1`` one stage per child of the Sequential (the paper's fine-grained
            pipeline, simulated in one process with the same staleness).
        microbatches: N microbatches per batch; the batch size must be at least N.
        schedule: ``pipemare`` (default), ``async``, ``pipedream``, ``1f1b`` or ``gpipe``.
        balance: layers per stage: ``"time"`` (measured forward+backward time of each layer on
            the first batch, default), ``"auto"`` (the planner's cut for this P and N from a
            profile of time, memory and the engine's costs, see :mod:`pipemare.planner.planner`),
            ``"params"``, ``"even"`` or a list of counts.
        config: :class:`~pipemare.PipeMareConfig` (T1, T2, T3); default per schedule.
        sequential: attribute path of the ``nn.Sequential`` to pipeline; found automatically
            when the module has exactly one.
        start_method: how Lightning starts processes: ``popen`` (default), ``spawn``, ``fork``.
        stall_timeout: seconds a process waits for another stage before it fails, naming that
            stage, its rank, host and PID (default 300; raise it if one rank can be busy that
            long alone, e.g. writing a very large checkpoint).
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

PipeMareStrategy: type[_PipeMareStrategyMixin] = _make("pytorch_lightning")


def _lightning_strategy() -> type[_PipeMareStrategyMixin] | None:
    if importlib.util.find_spec("lightning") is None:
        return None
    return _make("lightning.pytorch")


LightningPipeMareStrategy: type[_PipeMareStrategyMixin] | None = _lightning_strategy()


def register() -> None:
    """Register ``"pipemare"`` (and the ``pipemare_<schedule>`` variants) with Lightning."""
    from pytorch_lightning.strategies import StrategyRegistry

    PipeMareStrategy.register_strategies(StrategyRegistry)
    if LightningPipeMareStrategy is not None:
        from lightning.pytorch.strategies import StrategyRegistry as LightningRegistry

        LightningPipeMareStrategy.register_strategies(LightningRegistry)
