"""The strategy's runner: builds the pipeline at the first batch, drives it, owns what it leaves.

It owns the model adapter and the user's steps, the pipeline (built at the first batch: timing
the layers needs one), the lagged reports and evaluation results, the telemetry the monitors
asked for, and the checkpoints in flight with the state a loaded checkpoint still has to give
the pipeline. It reads the strategy's public settings and Lightning's public state of it (the
process layout, the optimisers, the precision plugin) and never writes to the strategy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipemare.engine.lagged import DistributedResults, LocalResults, Results
from pipemare.engine.microbatch import batch_size, scatter, token_shares
from pipemare.engine.pipeline import Pipeline
from pipemare.engine.telemetry import Probe
from pipemare.engine.transport import DistributedTransport
from pipemare.lightning import checkpoint, checks
from pipemare.lightning.checkpoint import SaveQueue
from pipemare.lightning.launching import LightningAPI
from pipemare.lightning.manual import steps_per_batch
from pipemare.lightning.module_adapter import ModuleAdapter
from pipemare.lightning.steps import UserSteps, merge_published, short_batches
from pipemare.lightning.training import Evaluation, GradStash, TrainingReports
from pipemare.model import cuts, partition
from pipemare.optim.chain import ChainedOptimizer, copies_of
from pipemare.optim.settings import Decision, auto_microbatches

__all__ = ["PipelineRunner", "stepped"]


def stepped(optimizers: Sequence[Any]) -> Any:
    """What the pipeline steps of ``optimizers`` (one or more): the one, or all chained."""
    return optimizers[0] if len(optimizers) == 1 else ChainedOptimizer(optimizers)


class PipelineRunner:
    """Runs the strategy's pipeline and keeps its state between Lightning's hooks.

    Args:
        strategy: the PipeMareStrategy it runs for; only its public attributes are read.
        api: Lightning's symbols, from the strategy's package.
        write: writes a complete checkpoint file (the Lightning base's ``save_checkpoint``).
        remove: removes a checkpoint file (the base's ``remove_checkpoint``).
        on_fatal: called when this process's heartbeat thread ends it.
    """

    def __init__(
        self,
        strategy: Any,
        api: LightningAPI,
        write: Callable[[dict[str, Any], str, Any], None],
        remove: Callable[[str], None],
        on_fatal: Callable[[], None],
    ) -> None:
        self.strategy, self.api, self._on_fatal = strategy, api, on_fatal
        self.pipeline: Pipeline | None = None
        #: the cut the first pipeline chose; later rebuilds (after fit, for test) cut alike
        self.cut: list[int] | None = None
        self.adapter: ModuleAdapter | None = None
        self._steps: UserSteps | None = None
        self.reports = TrainingReports()
        self._evaluation = Evaluation()
        self._grads = GradStash()
        self._probes: dict[str, Any] = {}  # the telemetry settings the monitors asked for
        self.saves = SaveQueue(write, remove)
        self._pending_state: dict[str, Any] | None = None  # pipemare's part of a checkpoint
        self._trained: dict[str, Any] | None = None  # the loaded checkpoint's run
        #: N once decided (asked, or ``"auto"`` chosen at the first batch), and the decision
        self.microbatches: int | None = None
        self._n_decided: list[Decision] = []
        self._call_decided: list[Decision] = []  # arguments set for the pipelined calls
        self._short_decided: list[Decision] = []  # how a last batch smaller than N runs

    # -- what the runner reads of the run ---------------------------------------------------

    @property
    def module(self) -> Any:
        module = self.strategy.lightning_module
        assert module is not None, "the strategy has no LightningModule yet"
        return module

    @property
    def fitting(self) -> bool:
        """Whether the Trainer runs ``fit`` (not validate, test or predict)."""
        module = self.strategy.lightning_module
        trainer = module.trainer if module is not None else None
        return trainer is not None and trainer.state.fn == self.api.TrainerFn.FITTING

    @property
    def steps(self) -> UserSteps:
        """The user's steps, run per microbatch."""
        assert self._steps is not None, "the strategy has not been set up by a Trainer yet"
        return self._steps

    @property
    def known_stages(self) -> int | None:
        """P, where known: given, one per process, or one per layer of the Sequential."""
        if self.strategy.num_stages is not None:
            return int(self.strategy.num_stages)
        seq = self.adapter.sequential if self.adapter else None
        return len(seq) if seq is not None else None

    # -- setup ------------------------------------------------------------------------------

    def setup(self, module: Any) -> None:
        """Find the module to pipeline and refuse, before anything runs, what cannot be cut."""
        strategy = self.strategy
        path, _ = cuts.find_pipelined(module, strategy.module_name)
        self.adapter = adapter = ModuleAdapter(
            module, path, strategy.split_points, strategy.dynamic_shapes
        )
        checks.check_split_points(adapter, strategy.split_points)
        self._check_cut()  # a module cut into segments is checked at the first batch
        adapter.check_no_outside_parameters()
        self._steps = UserSteps(module, adapter, strategy.precision_plugin.forward_context)
        self.pipeline = None

    def _check_cut(self) -> int | None:
        """P, after refusing a cut that cannot be made; None while the pipelined module waits
        to be cut into segments (at the first batch)."""
        adapter, strategy = self.adapter, self.strategy
        assert adapter is not None
        if adapter.sequential is None:
            return None
        return cuts.check_cut(
            adapter.what,
            adapter.sequential,
            strategy.balance,
            strategy.stages,
            strategy.num_stages,
            strategy.distributed,
        )

    def stages_for_checks(self) -> int:
        """P as far as setup knows it (the segments are cut at the first batch)."""
        return self._check_cut() or self.strategy.num_stages or 2

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

    def pipeline_for(self, batch: Any, step: str, args: tuple) -> Pipeline:
        """The pipeline, built now from ``batch`` if there is none yet."""
        adapter = self.adapter
        assert adapter is not None
        if self.pipeline is None:
            self._prepare_model(batch, step, args)
            cut, decided = self._balance(batch, step, args)
            compiled, compile_decided = self._compiled()
            weights, weights_decided = self._weights()
            decided = [
                *self._call_decided,
                *compile_decided,
                *weights_decided,
                *self._n_decided,
                *self._short_decided,
                *decided,
            ]
            self.pipeline = pipe = self._build(cut, decided, compiled, weights)
            self.cut = list(pipe.balance)
            self._load_pending_state()
            self.announce()
            self.reports.start(self.results(pipe.minibatches_fed), adapter.path)
            pipe.executor.on_minibatch = lambda k, loss: self.steps.publish(k, float(loss))
            pipe.executor.on_nonfinite = self.reports.record_nonfinite
            self._attach_probe(pipe)
        if adapter.segmented:  # segments run the graph traced in the module's mode
            adapter.sequential.train(adapter.pipelined.training)  # type: ignore[union-attr]
        return self.pipeline

    def _prepare_model(self, batch: Any, step: str, args: tuple) -> None:
        """Cut a pipelined module that is not a Sequential into segments, from what the step
        passes it, and check the cut; decide N; refuse batches smaller than N."""
        adapter = self.adapter
        assert adapter is not None
        if adapter.sequential is None:
            with self.steps.discarding_logs(), torch.random.fork_rng(devices=[]):
                adapter.prepare(step, batch, *args)
            self._check_cut()
            self._call_decided = call_decisions(adapter)
        self._decide_microbatches(batch)
        if self.fitting:
            assert self.microbatches is not None
            self._short_decided = short_batches(self.module.trainer, batch, self.microbatches)

    def _decide_microbatches(self, batch: Any) -> None:
        """N: as asked, or for ``"auto"`` chosen once P and the batches are known
        (:func:`~pipemare.optim.settings.auto_microbatches`), kept for later rebuilds."""
        strategy = self.strategy
        if self.microbatches is not None:
            return
        if isinstance(strategy.asked_microbatches, int):
            self.microbatches = strategy.asked_microbatches
            return
        rows = batch_size(batch)
        stages = self.known_stages or 1
        self.microbatches, decision = auto_microbatches(strategy.schedule, stages, rows)
        self._n_decided = [decision]

    def _balance(self, sample: Any, step: str, args: tuple) -> tuple[list[int], list[Decision]]:
        """Layers per stage: as the run a resume continues cut them, given, or chosen now; and
        how P and the cut were chosen where the user left them open."""
        assert self.adapter is not None and self.adapter.sequential is not None
        seq = self.adapter.sequential
        strategy = self.strategy
        stages = strategy.num_stages or len(seq)
        decided = []
        if strategy.stages is None:
            per = "process" if strategy.distributed else "layer of the pipelined model"
            decided.append(Decision("stages", f"P={stages}", f"one per {per}"))
        balance = strategy.balance
        saved = (self._pending_state or {}).get("layout")
        if isinstance(balance, str) and saved and saved["stages"] == stages:
            cut, why = list(saved["balance"]), "as the checkpointed run cut it"
        elif not isinstance(balance, str):
            return list(balance), decided
        elif stages == len(seq):
            cut, why = partition.even_balance(len(seq), stages), "one layer per stage"
        elif balance == "even":
            cut, why = partition.even_balance(len(seq), stages), "balance='even'"
        elif balance == "params":
            cut, why = partition.balance_by_params(seq, stages), "balance='params'"
        else:
            chosen = None
            if strategy.global_rank == 0:  # measure on one process, so every process cuts alike
                chosen = self._measured_balance(seq, stages, sample, step, args)
            cut = list(strategy.broadcast(chosen, src=0))
            why = (
                "balance='auto': the planner's cut from a profile of the layers"
                if balance == "auto"
                else "balance='time': from each layer's time on the first microbatch, the most "
                "even cut whose slowest stage is within 25% of the fastest cut's"
            )
        return cut, [*decided, Decision("layers per stage", str(cut), why)]

    def _measured_balance(
        self, seq: nn.Sequential, stages: int, sample: Any, step: str, args: tuple
    ) -> list[int]:
        """``"time"``: each layer's time on the first microbatch; ``"auto"``: the planner's
        cut for this P and N (:mod:`pipemare.planner`), from a profile of the layers with the
        run's optimiser and corrections."""
        strategy = self.strategy
        forward_context = strategy.precision_plugin.forward_context
        assert self.adapter is not None
        with self.steps.discarding_logs(), torch.random.fork_rng(devices=[]):
            x = self.adapter.capture_input(step, scatter(sample, strategy.microbatches)[0], *args)
            if strategy.balance != "auto":
                with forward_context():  # time what will run
                    return partition.balance_by_time(seq, x, stages)
            from pipemare.planner import auto_balance

            return auto_balance(
                seq,
                x,
                stages,
                strategy.microbatches,
                strategy.schedule,
                optimizer=copies_of(self._user_optimizer(seq), seq.parameters()),
                config=strategy.asked_config,
                forward_context=forward_context,
            )

    def _user_optimizer(self, seq: nn.Sequential) -> torch.optim.Optimizer:
        """The optimiser ``configure_optimizers`` returned (several, under manual optimisation:
        chained), or a stand-in that never steps."""
        optimizers = self.strategy.optimizers
        # Lightning's stand-in when configure_optimizers returns None is not the user's
        if optimizers and type(optimizers[0]).__name__ != "_MockOptimizer":
            return stepped(optimizers)
        return torch.optim.SGD(seq.parameters(), lr=0.0)  # never stepped with a real rate

    def _build(
        self,
        balance: list[int],
        decided: list[Decision],
        compiled: dict[str, Any] | bool,
        weights: Callable[[list[Any]], list[float]] | None,
    ) -> Pipeline:
        """The Pipeline over the Sequential, cut by ``balance``, compiled and its microbatches
        weighted as decided, with the Trainer's clipping and run length."""
        assert self.adapter is not None and self.adapter.sequential is not None
        strategy, seq, steps = self.strategy, self.adapter.sequential, self.steps
        steps.shares = weights  # the step's logs combine as the losses do
        return Pipeline(
            seq,
            self._user_optimizer(seq),
            steps.loss,
            stages=strategy.num_stages or len(seq),
            microbatches=strategy.microbatches,
            schedule=strategy.schedule,
            balance=balance,
            config=strategy.asked_config,
            transport=self._transport(),
            device=strategy.root_device,
            input_fn=steps.input,
            target_fn=lambda mb: mb,
            microbatch_weights=weights,
            forward_context=strategy.precision_plugin.forward_context,
            recompute=strategy.recompute,
            compile=compiled,
            layout_decisions=decided,
            **self._clipping(),
            **self._run_length(),
        )

    def _weights(self) -> tuple[Callable[[list[Any]], list[float]] | None, list[Decision]]:
        """How each microbatch's loss is weighted (None: by rows), and the decision to say."""
        asked = self.strategy.microbatch_weights
        tokens = "each microbatch's share of the batch's counted label tokens"
        if callable(asked):
            name = getattr(asked, "__name__", type(asked).__name__)
            return asked, [Decision("microbatch weights", f"from {name}", "microbatch_weights")]
        if asked == "rows":
            return None, []
        if asked == "tokens":
            why = "microbatch_weights='tokens': a loss that averages over the labels not -100"
            return token_shares(), [Decision("microbatch weights", tokens, why)]
        auto = label_token_weights(self.adapter)
        if auto is None:
            return None, []
        why = (
            "a Hugging Face loss averages over the label tokens that are not -100 (padding), "
            "so the minibatch's loss and gradient are one device's"
        )
        return auto, [Decision("microbatch weights", tokens, why)]

    def _compiled(self) -> tuple[dict[str, Any] | bool, list[Decision]]:
        """``torch.compile``'s options for each stage (False: none), and the decision to say."""
        options, user = self.strategy.compile, self.adapter and self.adapter.user_compiled
        if options is None and not user:
            return False, []
        shown = ", ".join(f"{k}={v!r}" for k, v in (options or {}).items()) or "its defaults"
        choice = f"each stage's forward, torch.compile with {shown}"
        if user:
            what = self.adapter.what  # type: ignore[union-attr]
            call = "torch.compile(...)" if user == "torch.compile" else f"{what}.compile()"
            why = (
                f"{what} was passed through {call}; a compiled whole cannot be cut, so each "
                "stage is compiled instead"
                + ("" if options else " (compile={...} on the strategy chooses the options)")
            )
        else:
            why = "asked; the backward still sees the schedule's weights, with no weight copies"
        return options or {}, [Decision("compile", choice, why)]

    def _run_length(self) -> dict[str, Any]:
        """The run's optimiser steps and steps per epoch, for T1's horizon, where known."""
        if not self.fitting:
            return {}
        trainer = self.module.trainer
        out = {}
        total = trainer.estimated_stepping_batches
        per_batch = steps_per_batch(trainer)  # several optimisers: max_steps counts each one
        if per_batch > 1 and trainer.max_steps != -1:
            total = min(total, math.ceil(trainer.max_steps / per_batch))
        if isinstance(total, (int, float)) and math.isfinite(total):
            out["total_steps"] = int(total)
        per_epoch = trainer.num_training_batches
        if isinstance(per_epoch, (int, float)) and math.isfinite(per_epoch):
            out["steps_per_epoch"] = int(per_epoch)
        return out

    def _clipping(self) -> dict[str, Any]:
        """The Trainer's gradient clipping as the pipeline's keyword (none outside fit)."""
        trainer = self.module.trainer
        clip_val = trainer.gradient_clip_val if self.fitting else None
        algorithm = trainer.gradient_clip_algorithm or "norm"
        if not clip_val:
            return {}
        return {"clip_grad_norm" if algorithm == "norm" else "clip_grad_value": float(clip_val)}

    def _transport(self) -> Any:
        strategy = self.strategy
        if not strategy.distributed:
            return "inprocess"
        transport = DistributedTransport(
            strategy.num_stages,
            strategy.root_device,
            stall_timeout=strategy.stall_timeout,
            layout=strategy.rank_layout,
            heartbeat_timeout=strategy.heartbeat_timeout,
        )
        # a process ended by its heartbeat thread first ends those it launched, as on an error
        transport.watchdog.reporter.on_fatal(self._on_fatal)
        return transport

    def announce(self) -> None:
        """Print the run's settings on rank 0: stages, cut, schedule and the corrections with
        their settings, then each decision taken on the user's behalf with its reason
        (:class:`~pipemare.optim.settings.RunSettings`); outside fit, those of the run that
        trained the loaded checkpoint (evaluation applies none)."""
        pipe, strategy = self.pipeline, self.strategy
        assert pipe is not None
        if strategy.distributed:
            self.api.rank_zero_info(strategy.rank_layout.describe())
        run = f"schedule {strategy.schedule!r}, N={strategy.microbatches}"
        decisions: list[str] = []
        if self.fitting:
            run += f", corrections: {pipe.settings.describe() or 'none'}"
            decisions = [str(d) for d in pipe.settings.decisions]
        elif self._trained is not None:
            trained = self._trained
            run = (
                f"evaluating a checkpoint trained with schedule {trained['schedule']!r}, "
                f"N={trained['microbatches']}, corrections: {trained['described'] or 'none'}"
            )
            decisions = list(trained.get("settings", {}).get("decisions", []))
        else:
            run += " (evaluation applies no corrections)"
        self.api.rank_zero_info(
            f"pipemare: {pipe.num_stages} stages "
            f"({'one per process' if strategy.distributed else 'in one process'}), "
            f"layers per stage {list(pipe.balance)}, {run}"
        )
        for line in decisions:
            self.api.rank_zero_info(f"pipemare:   {line}")

    def results(self, start: int) -> Results:
        """Where the last stage publishes results for every process
        (:mod:`pipemare.engine.lagged`)."""
        strategy = self.strategy
        if not strategy.distributed:
            return LocalResults(start)
        assert self.pipeline is not None
        transport = self.pipeline.transport
        assert isinstance(transport, DistributedTransport)
        last = transport.rank_of(transport.num_stages - 1)
        layout = strategy.rank_layout
        merge_group = None
        if layout.replicas > 1:  # the copies' last stages combine their results first
            group = dist.new_group(list(layout.stage_groups[-1]), backend="gloo")  # every rank
            merge_group = group if strategy.global_rank == last else None
        return DistributedResults(
            last,
            start,
            watchdog=transport.watchdog,
            ranks=layout.pipelines[transport.replica],
            merge_group=merge_group,
            merge=merge_published,
            lag=strategy.lag,
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
                lag=self.strategy.lag,
                device=self.strategy.root_device,
                monitored=monitored,
            )
        self.write_due()  # checkpoints whose step reached every stage by now
        steps.manual.after_step(lambda: self._grads.stash(pipe))
        return loss

    def restore_grads(self) -> None:
        """Give back the in-flight gradients kept aside while Lightning zeroed them."""
        self._grads.restore()

    def evaluate(self, step: str, batch: Any, batch_idx: int, args: tuple) -> Any:
        """Run a validation, test or predict batch; the latest step output reported."""
        strategy = self.strategy
        pipe = self.pipeline_for(batch, step, (batch_idx, *args))
        ahead = strategy.num_stages - 1 if strategy.distributed else 0
        return self._evaluation.step(
            pipe,
            self.steps,
            step,
            batch,
            batch_idx,
            args,
            results=self.results,
            microbatches=strategy.microbatches,
            ahead=ahead,
            trainer=self.module.trainer,
            device=strategy.root_device,
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
        self.reports.check_unreported(self.pipeline)

    def consolidate(self) -> None:
        """Give every process the whole model again (as DDP leaves it): each held one stage."""
        self.drain()
        if self.strategy.distributed and self.pipeline is not None:
            checkpoint.consolidate(
                self.module, self.pipeline, self.state_names, self.strategy.root_device
            )
            self.pipeline = None  # its stages are no longer split; the next run rebuilds it

    # -- checkpoints (:mod:`~pipemare.lightning.checkpoint`) ---------------------------------

    @property
    def state_names(self) -> checkpoint.StateNames:
        """A stage module's state-dict key -> the LightningModule's own key for it."""
        assert self.adapter is not None
        return self.adapter.state_key

    def module_state(self) -> dict[str, Any]:
        """The whole model; during training the state each stage has once the step's
        minibatch reached it, collected without draining."""
        if self.pipeline is None:
            return self.module.state_dict()
        return self.saves.module_state(self.module, self.pipeline, self.state_names)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The user's optimiser state for the whole model, plus pipemare's own under "pipemare"."""
        if self.pipeline is None:
            return optimizer.state_dict()
        return self.saves.optimizer_state(optimizer, self.pipeline)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        """Queue a checkpoint; it is written once its step reached every stage."""
        self.saves.save(checkpoint, filepath, storage_options, self.pipeline)
        self.write_due()

    def write_due(self) -> None:
        """Write the queued checkpoints whose step reached every stage by now."""
        if self.adapter is not None:
            self.saves.poll(self.module, self.pipeline, self.state_names)

    def note_trained(self, loaded: Mapping[str, Any]) -> None:
        """Keep how a loaded checkpoint's run was laid out and corrected, which validate, test
        and predict report (they restore no optimiser state)."""
        self._trained = checkpoint.trained_layout(loaded)

    def load_optimizer_states(self, optimizers: Sequence[Any], states: Sequence[Any]) -> None:
        """Load the user's optimiser states now, and pipemare's part once the pipeline exists."""
        pending = checkpoint.load_optimizer_states(optimizers, states)
        if pending is not None:
            self._pending_state = pending
        if self.pipeline is not None and self._pending_state is not None:
            self._load_pending_state()
            results = self.reports.results
            if results is not None:  # the next minibatch to report moved with it
                results.start = results.next = self.pipeline.minibatches_fed

    def _load_pending_state(self) -> None:
        """Load pipemare's part of a checkpoint into the pipeline, once both exist."""
        if self._pending_state is None:
            return
        assert self.pipeline is not None
        notes, run_notes = checkpoint.load_pipemare_state(self.pipeline, self._pending_state)
        self._pending_state = None
        checkpoint.warn_layout_changes(notes, self.api.rank_zero_warn)
        checkpoint.warn_run_changes(run_notes, self.api.rank_zero_warn)


def call_decisions(adapter: ModuleAdapter) -> list[Decision]:
    """How the module was cut, in how long, and what its calls get that the user's step does
    not pass, with the reasons."""
    seq = adapter.sequential
    if not adapter.segmented or seq is None:
        return []
    out = [
        Decision(
            "segments",
            f"{len(seq)}, traced and cut in {adapter.cut_seconds or 0.0:.1f} s",
            f"{type(adapter.pipelined).__name__} is not an nn.Sequential: torch.export traced "
            "its forward at the first batch",
        )
    ]
    defaults = getattr(seq, "call_defaults", {})
    if "use_cache" not in defaults:
        return out
    config = getattr(adapter.pipelined, "config", None)
    kept = getattr(config, "use_cache", None)
    return [
        *out,
        Decision(
            "use_cache",
            f"False in {adapter.what}'s calls",
            "a key/value cache for generation cannot travel between stages and training does "
            "not read it" + (f"; its config keeps use_cache={kept}" if kept is not None else ""),
        ),
    ]


def label_token_weights(adapter: ModuleAdapter | None) -> Callable[[list[Any]], list[float]] | None:
    """For a Hugging Face model (a ``config`` and ``can_generate``), microbatch weights by
    counted label tokens (:func:`~pipemare.engine.microbatch.token_shares`; a causal LM's
    labels shifted by one, as its loss shifts them); None: by rows."""
    model = adapter.pipelined if adapter is not None else None
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    if config is None or not callable(can_generate):
        return None
    causal = bool(can_generate()) and not getattr(config, "is_encoder_decoder", False)
    return token_shares(shift=1 if causal else 0)
