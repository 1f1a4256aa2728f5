"""The engine's public front: cut an ``nn.Sequential`` into stages, train it on a schedule."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipemare.engine import build
from pipemare.engine.executor import Executor
from pipemare.engine.microbatch import row_shares, scatter, scatter_filled, to_device
from pipemare.engine.payload import as_payload
from pipemare.engine.replicas import broadcast_state
from pipemare.engine.telemetry import Probe
from pipemare.engine.ties import TiedWeights, untie
from pipemare.engine.transport import ACT, DistributedTransport, Transport
from pipemare.model import partition
from pipemare.model.materialize import to_meta
from pipemare.optim.config import PipeMareConfig
from pipemare.optim.optimizer import PipeMareOptimizer
from pipemare.optim.settings import RunSettings, resolve
from pipemare.schedule.actions import Action, stream
from pipemare.schedule.delay import StageDelay, derive_delays

__all__ = ["Pipeline"]


def _first(batch: Any) -> Any:
    return batch[0]


def _second(batch: Any) -> Any:
    return batch[1]


class Pipeline:
    """Trains an ``nn.Sequential`` as a pipeline of stages, synchronous or asynchronous.

    All stages can run in this process (``transport="inprocess"``: the simulator, any number
    of stages, same staleness as the real thing) or one per process
    (``transport="distributed"``: launch P processes, gloo on CPU, NCCL on CUDA). With the same
    seed both give the same weights.

    Args:
        model: the layers to pipeline.
        optimizer: a ``torch.optim`` optimiser over ``model``'s parameters; LR schedulers
            attached to it keep working (see :class:`~pipemare.optim.PipeMareOptimizer`).
        loss_fn: ``(last stage output, target) -> scalar loss``, a mean over the microbatch.
        stages: P; default: one per process with the distributed transport, else one per layer.
        microbatches: N, microbatches per minibatch (one optimiser step).
        schedule: ``gpipe``, ``1f1b``, ``pipedream``, ``async`` or ``pipemare``.
        balance: layers per stage (a list), ``"even"`` (default) or ``"params"``; the other
            names of :data:`~pipemare.model.cuts.BALANCES` need a sample batch.
        config: staleness corrections asked for; default: the schedule's (``PipeMareConfig()``
            for ``pipemare``, none for the others). What runs, and why, is resolved once into
            :attr:`settings` (:func:`~pipemare.optim.settings.resolve`).
        transport: ``"inprocess"``, ``"distributed"`` or a :class:`~pipemare.Transport`.
        device: where this process's stages run (default: where the model is).
        input_fn: batch -> the model's input (default ``batch[0]``).
        target_fn: batch -> what ``loss_fn`` compares with (default ``batch[1]``).
        microbatch_weights: the microbatches of one batch -> each one's share of the batch's
            loss (default: its share of the rows, for a loss that averages over rows). A loss
            that averages over counted tokens (padding ignored) needs each microbatch's share
            of those tokens instead: :func:`~pipemare.engine.microbatch.token_shares`.
        forward_context: context manager factory around each stage's forward (e.g. autocast).
        seed: seeds each stage's own random stream (default: from ``torch.initial_seed()``).
        clip_grad_norm: clip by the global L2 norm over all stages (:mod:`~pipemare.engine.clip`).
        clip_grad_value: clip every gradient element to ``[-value, value]``.
        total_steps: the run's optimiser steps, for T1's horizon as a fraction of the run.
        steps_per_epoch: optimiser steps per epoch, for T1's horizon in epochs.
        check_finite: before each stage's update, check its gradients; NaN or Inf ones are not
            applied and raise :class:`~pipemare.NonFiniteGradientError` (one device sync
            per update; the Lightning strategy reports them with the step's results instead).
        recompute: activation recomputation on every stage but the last: a stage keeps only
            its inputs per in-flight microbatch and reruns its forward at backward time, at the
            weights its backward uses (under ``async``/``pipemare`` the activations then come
            from backward-time weights too; see :mod:`pipemare.engine.recompute`). The last
            stage, whose forward runs the loss, never reruns.
        compile: ``torch.compile`` each stage's layers (True: its defaults, inductor), or a
            dict of its options (``backend``, ``mode``, ``dynamic``, ``fullgraph``,
            ``options``). The backward still sees the weights the schedule gives it (the
            no-stash hooks hold under the compiled graph); the loss is not compiled.
        measure_saved: count the bytes each stage's in-flight microbatches keep
            (``stages[i].peak_saved_bytes``); None: where it costs next to nothing
            (:class:`~pipemare.engine.stage.Stage`).
        settings: the run's settings as a caller already decided them (the Lightning
            strategy's :func:`~pipemare.planner.decide.decide`), for this schedule, P, N and
            cut; None: resolved here from ``config``.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        >>> pipe = Pipeline(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                 nn.functional.cross_entropy, stages=3, microbatches=2)
        >>> [round(d.forward, 2) for d in pipe.delays]
        [1.0, 0.5, 0.0]
        >>> loss = pipe.step((torch.randn(4, 8), torch.tensor([0, 1, 2, 0])))
        >>> pipe.drain()
    """

    def __init__(
        self,
        model: nn.Sequential,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        stages: int | None = None,
        microbatches: int = 1,
        schedule: str = "pipemare",
        balance: Sequence[int] | str | None = None,
        config: PipeMareConfig | None = None,
        transport: str | Transport = "inprocess",
        device: torch.device | str | None = None,
        input_fn: Callable[[Any], Any] = _first,
        target_fn: Callable[[Any], Any] = _second,
        microbatch_weights: Callable[[list[Any]], list[float]] | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        seed: int | None = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        total_steps: int | None = None,
        steps_per_epoch: int | None = None,
        check_finite: bool = True,
        recompute: bool = False,
        compile: bool | Mapping[str, Any] = False,
        measure_saved: bool | None = None,
        settings: RunSettings | None = None,
    ) -> None:
        partition.check_sequential(model)
        sp = build.check_arguments(
            schedule=schedule,
            stages=stages,
            microbatches=microbatches,
            balance=balance,
            recompute=recompute,
            compile=compile,
        )
        self.device = build.default_device(model, device)
        transport = build.make_transport(transport, stages, len(model), self.device, microbatches)
        self.transport = transport
        self.num_stages = transport.num_stages
        self.balance = build.choose_balance(model, balance, self.num_stages)
        self.stage_modules = partition.split(model, self.balance)
        ties = untie(self.stage_modules)  # before the stages move: a copy must not go to meta
        self.schedule, self.microbatches = schedule, microbatches
        self.delays: tuple[StageDelay, ...] = derive_delays(schedule, self.num_stages, microbatches)
        replicas = transport.replicas if isinstance(transport, DistributedTransport) else 1
        if settings is None:
            settings = resolve(
                config,
                optimizer,
                schedule=schedule,
                delays=self.delays,
                microbatches=microbatches,
                replicas=replicas,
                balance=self.balance,
                total_steps=total_steps,
                steps_per_epoch=steps_per_epoch,
            )
        else:
            build.check_settings(settings, schedule, self.num_stages, microbatches, self.balance)
        self.config = settings.config
        self.input_fn, self.target_fn, self.loss_fn = input_fn, target_fn, loss_fn
        self.microbatch_weights = microbatch_weights or row_shares

        local = transport.local_stages
        for i, module in enumerate(self.stage_modules):
            if i in local:
                module.to(self.device)
            else:  # freed; the user's model keeps its ties
                to_meta(module, model)
        #: tied parameters on several stages, kept in step (see :mod:`pipemare.engine.ties`)
        self.ties = TiedWeights(ties, local, transport, microbatches)
        self.optimizer = PipeMareOptimizer(
            optimizer,
            {i: self._trained(i) for i in local},
            self.delays,
            microbatches=microbatches,
            settings=settings,
        )
        self.stages = build.make_stages(
            self.stage_modules,
            local,
            sp,
            self.optimizer,
            predicts=settings.predicts,
            forward_context=forward_context,
            microbatches=microbatches,
            seed=seed,
            recompute=recompute,
            compile=build.compile_options(compile),
            measure_saved=measure_saved,
        )
        self.clip = build.make_clip(
            clip_grad_norm, clip_grad_value, sp.flushes, transport, self.device, microbatches
        )
        self.executor = Executor(
            self.stages,
            self.num_stages,
            microbatches,
            self._stream,
            transport,
            self.optimizer,
            input_fn=lambda b: to_device(input_fn(b), self.device),
            loss_fn=lambda out, b: loss_fn(out, to_device(target_fn(b), self.device)),
            clip=self.clip,
            check_finite=check_finite,
            ties=self.ties,
        )
        if isinstance(transport, DistributedTransport) and transport.replicas > 1:
            self.executor.reducer = build.replica_averager(transport, self.stage_modules)

    @property
    def settings(self) -> RunSettings:
        """What the run does and why, decided once (:func:`~pipemare.optim.settings.resolve`)
        and renewed only by a new run length or a resume (the optimiser wrapper's)."""
        return self.optimizer.settings

    def _trained(self, stage: int) -> list[nn.Parameter]:
        """``stage``'s parameters that its update steps: those that require gradients when
        the pipeline is built, but copies of tied ones. A frozen parameter (a LoRA model's
        base) gets no optimiser step, correction buffer or weight prediction."""
        copies = {id(p) for p in self.ties.copies_on(stage)}
        return [
            p
            for p in self.stage_modules[stage].parameters()
            if p.requires_grad and id(p) not in copies
        ]

    def _stream(self, stage: int, start: int) -> Iterator[Action]:
        return stream(
            self.schedule,
            self.num_stages,
            self.microbatches,
            stage,
            start=start,
            warmup=self.settings.warmup_steps,
        )

    def sync_buffers(self) -> None:
        """Give every replica copy 0's buffers (BatchNorm statistics), e.g. before evaluating."""
        transport = self.transport
        if isinstance(transport, DistributedTransport) and transport.replicas > 1:
            for i in self.local_stages:
                broadcast_state(
                    self.stage_modules[i],
                    transport.replica_group,
                    src=transport.replica_ranks[0],
                    parameters=False,
                )

    # -- training ----------------------------------------------------------------------------

    @property
    def probe(self) -> Probe | None:
        """Telemetry (see :mod:`pipemare.engine.telemetry`); None until a monitor attaches one."""
        return self.executor.probe

    @probe.setter
    def probe(self, probe: Probe | None) -> None:
        if probe is not None:
            probe.microbatches = self.microbatches
        self.executor.probe = probe

    @property
    def local_stages(self) -> tuple[int, ...]:
        """The stages this process runs."""
        return self.transport.local_stages

    @property
    def minibatches_fed(self) -> int:
        """Minibatches fed to the first stage so far (in flight ones included)."""
        return self.executor.fed // self.microbatches

    def step(self, batch: Any) -> torch.Tensor | None:
        """Feed one minibatch and run the pipeline as far as it can go.

        Returns the minibatch's loss where the last stage runs (every microbatch of it has
        passed the last stage by then), None in other processes. With a non-flushing schedule
        its weight update happens later, as the pipeline moves on. A batch of fewer samples
        than N (an epoch's last) runs a sample per microbatch, the other slots filled with
        copies of weight 0 (:func:`~pipemare.engine.microbatch.scatter_filled`).
        """
        k = self.minibatches_fed
        self.ties.follow_modes()
        self.optimizer.record(k)
        self.executor.feed(*scatter_filled(batch, self.microbatches, self.microbatch_weights))
        self.executor.run()
        return self.executor.pop_loss(k)

    @property
    def drained(self) -> bool:
        """Whether nothing is in flight: no minibatch was fed since the last drain."""
        return self.executor.drained_at == self.executor.fed

    def drain(self) -> None:
        """Finish all microbatches in flight and apply their updates (e.g. before evaluating)."""
        self.executor.drain()

    @torch.no_grad()
    def evaluate(
        self,
        batch: Any,
        input_fn: Callable[[Any], Any] | None = None,
        head: Callable[[Any, Any], Any] | None = None,
        microbatches: int | None = None,
    ) -> list[Any] | None:
        """Forward ``batch`` through every stage without gradients (drains training first).

        Args:
            batch: what to evaluate; split into ``microbatches`` (default: the pipeline's N).
            input_fn: microbatch -> the first stage's input (default: the microbatch itself).
            head: ``(last stage output, microbatch) -> result``, run on the last stage.

        Returns:
            One result per microbatch where the last stage runs, None in other processes.
        """
        self.drain()
        self.ties.follow_modes()
        chunks = scatter(batch, microbatches or self.microbatches)
        results = []
        for j, chunk in enumerate(chunks):
            tag = -1 - j  # negative indices keep evaluation apart from training microbatches
            for stage in self.stages:
                i = stage.index
                if i == 0:
                    x = to_device(input_fn(chunk) if input_fn is not None else chunk, self.device)
                else:
                    x = self.transport.recv(i - 1, i, ACT, tag)
                y = stage.forward(tag, x, grad=False)
                if i > 0:
                    self.transport.release(i - 1, i, ACT, tag)
                if i == self.num_stages - 1:
                    results.append(head(y, chunk) if head is not None else y)
                else:
                    self.transport.send(i, i + 1, ACT, tag, as_payload(y, i))
        self.transport.flush()
        return results if self.num_stages - 1 in self.local_stages else None

    def predict(self, inputs: Any) -> Any:
        """Forward ``inputs`` through every stage without gradients (drains first).

        Returns the last stage's outputs, concatenated over microbatches, where the last
        stage runs; None in other processes.
        """
        outputs = self.evaluate(inputs)
        if not outputs:
            return None
        if isinstance(outputs[0], torch.Tensor):
            return torch.cat(outputs)
        return outputs

    def state_dict(self) -> dict[str, Any]:
        """The pipeline's own state (this process's stages): drains, so nothing is in flight.

        Weights and the optimiser are saved by their owners; this holds how many minibatches
        ran (T1's and T3's clock) and each stage's random stream.
        """
        self.drain()
        return {
            "minibatches": self.minibatches_fed,
            "rng": {s.index: s.rng_state() for s in self.stages},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state["minibatches"]`` minibatches, with an empty pipeline."""
        self.drain()
        self.executor.restart(int(state["minibatches"]))
        self.ties.restart(int(state["minibatches"]))
        for s in self.stages:
            s.version = int(state["minibatches"])
            self.transport.progress(s.index, s.version)
            if s.index in state["rng"]:
                s.set_rng_state(state["rng"][s.index])
