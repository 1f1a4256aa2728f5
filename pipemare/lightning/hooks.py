"""Lightning's gradient hooks, fired inside the pipeline where each stage's gradients are whole.

On one device Lightning calls ``on_before_backward`` and ``on_after_backward`` around the
backward pass, then ``on_before_optimizer_step`` and ``configure_gradient_clipping`` before the
step, on the callbacks and then on the module. In a pipeline there is no one moment with the
whole model's gradient of a minibatch: stage ``i`` applies update ``k`` when its own gradient of
``k`` is complete, and in a non-flushing schedule the other stages do so at other steps. So:

- ``on_after_backward``, ``on_before_optimizer_step`` and ``configure_gradient_clipping`` fire
  once per stage update, on the process that runs the stage, right before the update, with
  exactly that stage's gradient of that minibatch in ``.grad`` (every other parameter's
  ``.grad`` is None meanwhile). :attr:`GradientHooks.update` says which ``(stage, minibatch)``
  (``trainer.global_step`` is the step running, not the minibatch being applied).
- ``configure_gradient_clipping``, when overridden, replaces the engine's clipping: its
  ``self.clip_gradients`` clips this stage by the engine's rule (by value, or by the global norm
  over every stage, :mod:`pipemare.engine.clip`); not calling it clips nothing.
- ``on_before_backward`` fires once per microbatch on the last stage, with the loss its
  backward pass propagates (the microbatch's loss times its share of the minibatch, as
  Lightning passes the loss divided by ``accumulate_grad_batches``).
- ``self.log`` in these hooks is recorded per minibatch, combined over the stages and
  microbatches as the step's logs are (:func:`~pipemare.lightning.steps.merge_records`), and
  replayed on every process at the same step: minibatch ``k``'s records at step
  ``k + S + 1``, ``S`` the steps after which every stage has applied an update
  (:func:`~pipemare.engine.lagged.snapshot_lag`). The last ``S + 1`` minibatches of a run are
  not replayed.

In one process with a flushing schedule (``gpipe``, ``1f1b``: every stage simulated here, every
stage's gradient of minibatch ``k`` whole before any stage moves on) the hooks run as on one
device instead: once per step, when every stage has run its last backward pass of the
minibatch and before any stage applies it, with every parameter's gradient in ``.grad``
(tied weights' contributions summed into the owner's). ``on_before_backward`` then also fires
once, right before ``on_after_backward``, with the minibatch's loss (the sum of its
microbatches' losses times their shares); ``configure_gradient_clipping``'s
``self.clip_gradients`` clips every stage at once; the records are replayed at the step
itself; :attr:`GradientHooks.update` is ``(None, k)``. Non-flushing schedules keep the per
stage update hooks in one process too: there the stages apply a minibatch at different steps,
so a whole gradient of one minibatch never exists.

Nothing of this is installed unless the module or a callback overrides one of these hooks.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.overrides import is_overridden
from torch import nn

from pipemare.engine.lagged import snapshot_lag
from pipemare.engine.pipeline import Pipeline
from pipemare.lightning.steps import LogRecorder, Record, merge_records
from pipemare.schedule.actions import spec

__all__ = ["GRADIENT_HOOKS", "GradientHooks", "HookLogs", "overridden_hooks", "overrides"]

#: the hooks fired here; ``configure_gradient_clipping`` is the module's only
GRADIENT_HOOKS = (
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
)

Payload = dict[str, list[Record]]  # hook name -> its records for one minibatch


def _base(obj: object, name: str) -> type | None:
    """The Lightning class (``LightningModule`` or ``Callback``, of either package) whose
    ``name`` a subclass may override."""
    for cls in type(obj).__mro__:
        if cls.__name__ in ("LightningModule", "Callback") and cls.__module__.endswith(
            ("core.module", "callbacks.callback")
        ):
            return cls if hasattr(cls, name) else None
    return None


def overrides(obj: Any, name: str) -> bool:
    """Whether ``obj``'s class (a LightningModule's or a Callback's) overrides Lightning's
    ``name``. The class, not the instance: pipemare itself replaces some methods on the
    module for the run (manual optimisation's ``clip_gradients``, which refuses), and those
    are not the user's."""
    base = _base(obj, name)
    return base is not None and is_overridden(name, type(obj), base)


def overridden_hooks(module: Any, callbacks: Sequence[Any]) -> set[str]:
    """The gradient hooks that the module or a callback overrides. An overridden
    ``clip_gradients`` counts as ``configure_gradient_clipping``: Lightning's own
    ``configure_gradient_clipping`` calls it with the Trainer's settings."""
    found = set()
    for name in GRADIENT_HOOKS:
        owners = [module] if name == "configure_gradient_clipping" else [module, *callbacks]
        if any(overrides(obj, name) for obj in owners):
            found.add(name)
    if overrides(module, "clip_gradients"):
        found.add("configure_gradient_clipping")
    return found


class HookLogs:
    """Each minibatch's hook records, from every process to every process, in order.

    In one process the records wait in a dictionary. Over processes each one posts its own
    records of a minibatch in an asynchronous all-gather (a gloo group of its own) and takes
    everyone's at the next step, so no step waits for another process's hooks.

    Args:
        group: the gloo group of every process; None in one process.
        keep: the ranks whose records count (copy 0 of D data-parallel copies); None: all.
    """

    _CAPACITY = 65536  # bytes per process per minibatch in the all-gather; more goes apart
    _HEAD = 16  # minibatch index and length, two int64

    def __init__(self, group: Any = None, keep: Sequence[int] | None = None) -> None:
        self._group, self._keep = group, None if keep is None else set(keep)
        self._held: dict[int, Payload] = {}  # one process
        self._posted: list[tuple[int, Any, list[torch.Tensor], bytes]] = []  # over processes

    def post(self, minibatch: int, payload: Payload) -> None:
        if self._group is None:
            self._held[minibatch] = payload
            return
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        message = torch.zeros(self._CAPACITY, dtype=torch.uint8)
        message[: self._HEAD].view(torch.int64)[:] = torch.tensor([minibatch, len(data)])
        first = data[: self._CAPACITY - self._HEAD]
        if first:
            body = torch.frombuffer(bytearray(first), dtype=torch.uint8)
            message[self._HEAD : self._HEAD + len(first)] = body
        parts = [torch.empty_like(message) for _ in range(dist.get_world_size(self._group))]
        work = dist.all_gather(parts, message, group=self._group, async_op=True)
        self._posted.append((minibatch, work, parts, data))

    def take(self) -> list[tuple[int, Payload]]:
        """Every posted minibatch's records, every process's combined, oldest first."""
        if self._group is None:
            held, self._held = sorted(self._held.items()), {}
            return held
        out = []
        for minibatch, work, parts, data in self._posted:
            work.wait()
            heads = [p[: self._HEAD].view(torch.int64).tolist() for p in parts]
            if any(k != minibatch for k, _ in heads):
                raise RuntimeError(
                    f"the processes exchanged the gradient hooks' logs of different minibatches "
                    f"({[k for k, _ in heads]}, expected {minibatch}): they ran different steps"
                )
            room = self._CAPACITY - self._HEAD
            if any(length > room for _, length in heads):  # every process sees it: all gather
                whole: list[Any] = [None] * len(parts)
                dist.all_gather_object(whole, data, group=self._group)
                blobs = [bytes(b) for b in whole]
            else:
                blobs = [
                    bytes(p[self._HEAD : self._HEAD + n].numpy())
                    for p, (_, n) in zip(parts, heads, strict=True)
                ]
            payloads = [
                pickle.loads(b)
                for rank, b in enumerate(blobs)
                if self._keep is None or rank in self._keep
            ]
            out.append((minibatch, _merged(payloads)))
        self._posted = []
        return out


def _merged(payloads: list[Payload]) -> Payload:
    """Records of one minibatch from several stages or processes, per hook, combined."""
    names = dict.fromkeys(name for p in payloads for name in p)
    return {name: merge_records([p[name] for p in payloads if name in p]) for name in names}


class GradientHooks:
    """Fires the module's and the callbacks' gradient hooks at the pipeline's updates.

    Args:
        module: the LightningModule (with its trainer).
        pipe: the pipeline, whose executor calls back here.
        names: the hooks overridden (:func:`overridden_hooks`).
        logs: where the hooks' records travel between processes.
    """

    def __init__(self, module: Any, pipe: Pipeline, names: set[str], logs: HookLogs) -> None:
        self.module, self.pipe, self.names, self.logs = module, pipe, names, logs
        #: ``(stage, minibatch)`` of the update whose hooks are running, ``(None, minibatch)``
        #: where they see every stage at once (:attr:`whole`); None between them
        self.update: tuple[int | None, int] | None = None
        #: one process and a flushing schedule: the hooks fire once per step, as on one device
        self.whole = spec(pipe.schedule).flushes and len(pipe.local_stages) == pipe.num_stages
        self._recorder = LogRecorder(module)
        self._records: dict[int, Payload] = {}  # this process's records per minibatch
        self._minibatch: int | None = None  # the minibatch whose hooks are running
        self._lag = snapshot_lag(pipe.schedule, pipe.num_stages, pipe.microbatches)
        self._next = pipe.minibatches_fed  # the next minibatch to post
        self._fired = pipe.minibatches_fed - 1  # whole: the last minibatch whose hooks ran
        self._losses: dict[int, torch.Tensor] = {}  # whole: each minibatch's loss so far
        executor = pipe.executor
        if self.whole:
            executor.update_gate = self.gate
            if "configure_gradient_clipping" in names:  # clipped by the hook: settle per stage
                executor.on_update = self._settle
            if "on_before_backward" in names:
                executor.on_loss = self._add_loss
            return
        if names - {"on_before_backward"}:
            executor.on_update = self.on_update
        if "on_before_backward" in names:
            executor.on_loss = self.on_loss

    # -- inside the pipeline -----------------------------------------------------------------

    def on_update(self, stage: int, minibatch: int, params: list[nn.Parameter]) -> None:
        """The executor's ``on_update``: the hooks of ``stage``'s update of ``minibatch``."""
        pipe, clip = self.pipe, self.pipe.clip
        if pipe.optimizer.holds(stage, minibatch):  # an incomplete gradient: no hooks
            if clip is not None:
                clip.apply(stage, minibatch, params)
            return
        module, trainer = self.module, self.module.trainer
        with self._only(stage, params), self._logging(minibatch, 1.0):
            self.update = (stage, minibatch)
            try:
                self._call("on_after_backward")
                for optimizer in trainer.optimizers:
                    self._call("on_before_optimizer_step", optimizer)
                    if not module.automatic_optimization:
                        continue  # as in Lightning: no clipping under manual optimisation
                    if "configure_gradient_clipping" in self.names:
                        self._user_clipping(optimizer, minibatch, [(stage, params)])
                    elif clip is not None:
                        clip.apply(stage, minibatch, params)
            finally:
                self.update = None
        if clip is not None and "configure_gradient_clipping" in self.names:
            clip.settle(stage, minibatch)

    def on_loss(self, microbatch: int, loss: torch.Tensor, share: float) -> None:
        """The executor's ``on_loss``: ``on_before_backward`` of one microbatch."""
        with self._logging(microbatch // self.pipe.microbatches, share):
            self._call("on_before_backward", loss)

    # -- one process, a flushing schedule: once per step ----------------------------------------

    def gate(self, stage: int, minibatch: int) -> bool:
        """The executor's ``update_gate`` (:attr:`whole`): hold every update of ``minibatch``
        until each stage's gradient of it is whole, then run the hooks once, before any
        stage applies it."""
        if minibatch <= self._fired:
            return True
        if not self.pipe.executor.at_update(minibatch):
            return False
        self._fired = minibatch
        self._whole_step(minibatch)
        return True

    def _whole_step(self, minibatch: int) -> None:
        """The hooks of ``minibatch`` in Lightning's order, with every stage's gradient."""
        pipe, module = self.pipe, self.module
        stages = [(j, pipe.optimizer.stage_parameters(j)) for j in pipe.local_stages]
        if pipe.ties:
            pipe.ties.gather(minibatch)
        if pipe.clip is not None:  # every stage's norm on the board before anything clips
            for j, params in stages:
                pipe.clip.post(j, minibatch, params)
        loss = self._losses.pop(minibatch, None)
        with self._logging(minibatch, 1.0):
            self.update = (None, minibatch)
            try:
                if loss is not None:
                    self._call("on_before_backward", loss)
                self._call("on_after_backward")
                for optimizer in module.trainer.optimizers:
                    self._call("on_before_optimizer_step", optimizer)
                    clips = "configure_gradient_clipping" in self.names
                    if module.automatic_optimization and clips:
                        self._user_clipping(optimizer, minibatch, stages)
            finally:
                self.update = None

    def _settle(self, stage: int, minibatch: int, params: list[nn.Parameter]) -> None:
        """The executor's ``on_update`` where ``configure_gradient_clipping`` clipped every
        stage at once: each stage's update only settles its share of the norms."""
        assert self.pipe.clip is not None  # the runner builds one when the hook is overridden
        self.pipe.clip.settle(stage, minibatch)

    def _add_loss(self, microbatch: int, loss: torch.Tensor, share: float) -> None:
        """The executor's ``on_loss`` (:attr:`whole`): the minibatch's loss, summed."""
        k = microbatch // self.pipe.microbatches
        have = self._losses.get(k)
        self._losses[k] = loss if have is None else have + loss

    # -- clipping --------------------------------------------------------------------------------

    def _user_clipping(
        self, optimizer: Any, minibatch: int, stages: list[tuple[int, list[nn.Parameter]]]
    ) -> None:
        """The module's ``configure_gradient_clipping``, its ``self.clip_gradients`` clipping
        ``stages`` (``(stage, its parameters)``) by the engine's rule (the precision plugin's
        ``clip_gradients``, rerouted)."""
        clip, trainer = self.pipe.clip, self.module.trainer
        assert clip is not None  # the runner builds a norm board when the hook is overridden

        def clip_gradients(
            optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm"
        ) -> None:
            if clip_val <= 0:
                return
            algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm))
            for stage, params in stages:
                clip.apply(stage, minibatch, params, algorithm=algorithm, value=float(clip_val))

        plugin = trainer.precision_plugin
        plugin.clip_gradients = clip_gradients
        try:
            self._call_module(
                "configure_gradient_clipping",
                optimizer,
                gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            )
        finally:
            del plugin.clip_gradients

    def _call(self, name: str, *args: Any) -> None:
        """``name`` on every callback, then on the module, as Lightning orders them."""
        module = self.module
        trainer = module.trainer
        previous = module._current_fx_name
        module._current_fx_name = name
        try:
            for callback in trainer.callbacks:
                getattr(callback, name)(trainer, module, *args)
        finally:
            module._current_fx_name = previous
            self._keep(name)
        self._call_module(name, *args)

    def _call_module(self, name: str, *args: Any, **kwargs: Any) -> None:
        module = self.module
        previous = module._current_fx_name
        module._current_fx_name = name
        try:
            getattr(module, name)(*args, **kwargs)
        finally:
            module._current_fx_name = previous
            self._keep(name)

    def _keep(self, hook: str) -> None:
        """File the records ``hook`` just made under the minibatch being handled."""
        records = self._recorder.take()
        if records and self._minibatch is not None:
            have = self._records.setdefault(self._minibatch, {})
            have[hook] = merge_records([have.get(hook, []), records])

    @contextlib.contextmanager
    def _only(self, stage: int, params: list[nn.Parameter]) -> Iterator[None]:
        """Hide the other local stages' gradients (partial sums of minibatches in flight)."""
        mine = {id(p) for p in params}
        hidden = []
        for j in self.pipe.local_stages:
            if j == stage:
                continue
            for p in self.pipe.optimizer.stage_parameters(j):
                if id(p) not in mine and p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            yield
        finally:
            for p, g in hidden:
                p.grad = g

    @contextlib.contextmanager
    def _logging(self, minibatch: int, weight: float) -> Iterator[None]:
        """Record the hooks' ``self.log`` calls as ``minibatch``'s, each with ``weight``."""
        module = self.module
        before = module.__dict__.get("log")
        module.log = self._recorder.recording(weight)
        self._minibatch = minibatch
        try:
            yield
        finally:
            self._minibatch = None
            if before is None:
                del module.log
            else:
                module.log = before

    # -- between steps ---------------------------------------------------------------------------

    def after_step(self, device: torch.device) -> None:
        """After a training step: replay the records posted at the previous step, then post
        those of every minibatch each stage has now applied. Where the hooks ran once per
        step (:attr:`whole`), nothing travels: the step's own records replay at once, as
        Lightning logs them on one device."""
        if not self.whole:
            self._replay_posted(device)
        applied = self.pipe.minibatches_fed - 1 - self._lag
        while self._next <= applied:
            self.logs.post(self._next, self._records.pop(self._next, {}))
            self._next += 1
        if self.whole:
            self._replay_posted(device)

    def _replay_posted(self, device: torch.device) -> None:
        for _, payload in self.logs.take():
            self._replay(payload, device)

    def _replay(self, payload: Payload, device: torch.device) -> None:
        module = self.module
        previous = module._current_fx_name
        try:
            for hook, records in payload.items():
                module._current_fx_name = hook
                self._recorder.replay(records, module.log, device)
        finally:
            module._current_fx_name = previous

    def close(self) -> None:
        """At the end of fit: finish the exchanges in flight (their records are not replayed)."""
        self.logs.take()
        self._records.clear()
        self._losses.clear()
