"""The LightningModule's own step functions, run per microbatch around its pipelined module.

The user's ``training_step`` (or ``validation_step``, ...) calls its pipelined module (a
``self.gpt``, a ``self.net``: an ``nn.Sequential``, or a module traced and cut into segments)
once. To run it on a pipeline it runs in two halves, the attribute swapped for a stand-in for
the duration of one call (:class:`ModuleAdapter`):

- on the first stage a capturing stand-in records what the module receives (any positional and
  keyword arguments: the pipeline's input) and stops the step right there;
- on the last stage an injecting stand-in returns the pipeline's output (the module's own
  output structure: a tensor, a tuple, a Hugging Face ``ModelOutput``) instead of running the
  layers, so the rest of the user's step (loss, metrics, ``self.log``) runs on it.

Its ``self.log`` calls are recorded per microbatch (:class:`LogRecorder`), combined per
minibatch (weighted by their share: the mean of a per-sample mean over the minibatch is the
minibatch's value; ``reduce_fx="sum"``, ``"max"`` and ``"min"`` combine accordingly),
published with the minibatch's loss (:mod:`pipemare.engine.lagged`) and replayed through the
real ``LightningModule.log`` on every process at the same step, lagged by the pipeline's depth:
Lightning must see one value per step, identical on every rank (loggers write from rank 0, and
ModelCheckpoint, EarlyStopping and LR schedulers decide from ``callback_metrics`` everywhere).

torchmetrics objects are replayed as themselves: their state lives on the last stage only, and
their ``compute()`` at epoch end syncs it over the processes as it would under DDP (the other
ranks contribute empty states). Only the step value (``_forward_cache``) and the update count
are copied across.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch._dynamo import OptimizedModule
from typing_extensions import override

from pipemare.engine.lagged import Results
from pipemare.engine.microbatch import batch_size
from pipemare.lightning.manual import ManualOptimization, steps_per_batch
from pipemare.planner.decide import ModelFacts

if TYPE_CHECKING:
    from pipemare.model.blocks import Cut

__all__ = [
    "LogRecorder",
    "ModuleAdapter",
    "Record",
    "UserSteps",
    "closes_epoch",
    "closes_loader",
    "loss_of",
    "merge_published",
    "merge_records",
    "run_length",
    "short_last_batches",
]


class _Captured(BaseException):  # BaseException: a user's `except Exception` must not swallow it
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("pipemare captured the pipelined module's input")
        self.args, self.kwargs = args, kwargs


class _StandIn(nn.Module):
    """Takes the pipelined module's place during a step; the step may only call it."""

    def __init__(self, owner: str = "the module", path: str = "net") -> None:
        super().__init__()
        self.owner, self.path = owner, path

    def _refuse(self, *args: Any) -> Any:
        p = f"self.{self.path}"
        raise RuntimeError(
            f"{self.owner}.{self.path} was indexed, iterated or measured in the step (e.g. "
            f"{p}[0](x), a loop over its layers, len({p})); pipemare runs it as a pipeline, so "
            f"the step must pass its input through it in one call, y = {p}(x). Use single "
            "layers outside the step, or pipeline a different module"
        )

    __getitem__ = __iter__ = __len__ = _refuse

    def __bool__(self) -> bool:  # truth tests must not fall back to __len__
        return True


class _Capture(_StandIn):
    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)


class _Inject(_StandIn):
    def __init__(self, output: Any, owner: str = "the module", path: str = "net") -> None:
        super().__init__(owner, path)
        self.output, self.calls = output, 0

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(
                f"{self.owner}.{self.path} was called twice in one step; pipemare runs it once "
                "per microbatch as a pipeline. Call it once per step, or pipeline a different "
                "module"
            )
        return self.output


class ModuleAdapter:
    """Calls a LightningModule's step functions with its pipelined module swapped for a stand-in.

    An ``nn.Sequential`` is pipelined as it is. Any other module is cut into segments
    (:func:`pipemare.model.segments.segment_module`) at the first batch, from the arguments the
    step passes it: :meth:`prepare`.

    Args:
        module: the user's LightningModule.
        path: dotted path of the pipelined module inside ``module``.
        split_points: where to cut a module that is not a Sequential (module names, each cut
            before that module); None: at its repeated blocks.
        dynamic_shapes: which input sizes may vary (``"auto"`` or ``"all"``, see
            :func:`~pipemare.model.segments.segment_module`).
    """

    def __init__(
        self,
        module: nn.Module,
        path: str,
        split_points: Sequence[str] | None = None,
        dynamic_shapes: str = "auto",
    ) -> None:
        self.module, self.path = module, path
        self.dynamic_shapes = dynamic_shapes
        parent, _, attr = path.rpartition(".")
        self._parent = module.get_submodule(parent) if parent else module
        self._attr = attr
        #: how the user compiled the pipelined module (``"torch.compile"``, ``"compile()"``),
        #: or None; the pipeline compiles each stage instead
        self.user_compiled: str | None = None
        pipelined = getattr(self._parent, attr)
        if isinstance(pipelined, OptimizedModule):  # torch.compile(model): unwrapped, for good
            self.user_compiled, pipelined = "torch.compile", pipelined._orig_mod
            self._parent._modules[attr] = pipelined
        elif getattr(pipelined, "_compiled_call_impl", None) is not None:  # model.compile()
            self.user_compiled = "compile()"
        #: the module the step calls, as the user wrote it (unwrapped from torch.compile)
        self.pipelined: nn.Module = pipelined
        #: the split points as names inside the pipelined module
        self.split_points = None
        if split_points is not None:
            inside = f"{path}."
            self.split_points = [
                n[len(inside) :] if n.startswith(inside) else n for n in split_points
            ]
        #: what the pipeline runs: the Sequential itself, or the segments (after prepare)
        self.sequential: nn.Sequential | None = (
            self.pipelined if isinstance(self.pipelined, nn.Sequential) else None
        )
        self.segmented = self.sequential is None
        #: seconds spent tracing and cutting the module (None: not cut here)
        self.cut_seconds: float | None = None
        #: why each block was cut in two as well (its default cuts), or "" where it was not
        self.halved = ""

    @property
    def what(self) -> str:
        return f"{type(self.module).__name__}.{self.path}"

    def check_no_outside_parameters(self) -> None:
        """Trainable parameters outside the pipelined module would train on one stage only."""
        inside = {id(p) for p in self.pipelined.parameters()}
        outside = [
            n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in inside
        ]
        if outside:
            shown = ", ".join(outside[:4]) + (", ..." if len(outside) > 4 else "")
            raise ValueError(
                f"{type(self.module).__name__} has trainable parameters outside "
                f"{self.path} ({shown}); pipemare only pipelines {self.path}, so these would "
                f"train on one stage and go stale on the others. Move those layers into "
                f"{self.path}, pipeline the module that holds them all (module='...'), or "
                "freeze them"
            )

    def prepare(
        self, step: str, *args: Any, eval_graph: bool = True, stages: int | None = None
    ) -> nn.Sequential:
        """The Sequential the pipeline runs; a module that is not one is cut into segments now,
        from what ``module.<step>(*args)`` passes it (for training only without
        ``eval_graph``: see :func:`~pipemare.model.segments.segment_module`). Cut at its
        default places (no ``split_points``) into ``stages`` stages that do not divide its
        blocks, each block is cut in two as well (:func:`~pipemare.model.blocks.halved`), where
        it traces so; else at whole blocks."""
        if self.sequential is None:
            from pipemare.model.segments import UncuttableModelError, segment_module

            call_args, call_kwargs = self._capture(step, *args)
            start = time.perf_counter()
            halves = self._halves(stages) if self.split_points is None else None
            cut = functools.partial(
                segment_module,
                self.pipelined,
                call_args,
                call_kwargs,
                dynamic=self.dynamic_shapes,
                eval_graph=eval_graph,
            )
            try:
                self.sequential = cut(split_points=halves or self.split_points)
            except UncuttableModelError:
                if halves is None:
                    raise
                self.halved = ""  # a block that will not cut inside: whole blocks, as before
                self.sequential = cut(split_points=self.split_points)
            self.cut_seconds = time.perf_counter() - start
        return self.sequential

    def _halves(self, stages: int | None) -> list[Cut] | None:
        """The default cuts with each block cut in two, where ``stages`` does not divide the
        blocks (and :attr:`halved` says why); None where whole blocks serve."""
        from pipemare.model.blocks import halved
        from pipemare.model.segments import default_cuts

        cuts = default_cuts(self.pipelined)
        blocks = sum(not c.after for c in cuts)
        if stages is None or stages < 2 or blocks == 0 or blocks % stages == 0:
            return None
        halves, inner = halved(self.pipelined, cuts)
        if inner is None:
            return None
        self.halved = (
            f"each block is cut in two as well, before its {inner!r}: {blocks} blocks do not "
            f"divide among {stages} stages, and whole blocks would leave some stages a block "
            "more than others (every schedule steps at the busiest stage's pace); pass "
            "split_points to cut elsewhere"
        )
        return halves

    @contextlib.contextmanager
    def _swapped(self, stand_in: nn.Module) -> Iterator[None]:
        self._parent._modules[self._attr] = stand_in
        try:
            yield
        finally:
            self._parent._modules[self._attr] = self.pipelined

    def _capture(self, step: str, *args: Any) -> tuple[tuple, dict]:
        with self._swapped(_Capture(type(self.module).__name__, self.path)):
            try:
                getattr(self.module, step)(*args)
            except _Captured as captured:
                return captured.args, captured.kwargs
        raise RuntimeError(
            f"{type(self.module).__name__}.{step} returned without calling {self.path}; "
            f"pipemare needs the step to pass its input through {self.path}"
        )

    def capture_input(self, step: str, *args: Any) -> Any:
        """Run ``module.<step>(*args)`` up to its call of the pipelined module; return the first
        stage's input (the Sequential's argument, or the segments' flattened tensors)."""
        call_args, call_kwargs = self._capture(step, *args)
        if not self.segmented:
            if len(call_args) != 1 or call_kwargs:
                raise RuntimeError(
                    f"{self.what} is an nn.Sequential, which takes one input, but "
                    f"{step} called it with {len(call_args)} positional and "
                    f"{len(call_kwargs)} keyword arguments"
                )
            return call_args[0]
        assert self.sequential is not None, "prepare() cuts the module first"
        return self.sequential.flatten_inputs(*call_args, **call_kwargs)  # type: ignore[operator]

    def run_with_output(self, step: str, output: Any, *args: Any) -> Any:
        """Run ``module.<step>(*args)``, the pipelined module returning ``output``; return the
        result."""
        inject = _Inject(output, type(self.module).__name__, self.path)
        with self._swapped(inject):
            result = getattr(self.module, step)(*args)
        if inject.calls == 0:
            raise RuntimeError(
                f"{type(self.module).__name__}.{step} did not call {self.path}; pipemare needs "
                f"the step to pass its input through {self.path}"
            )
        return result

    def model_facts(self) -> ModelFacts:
        """What the pipelined model is, for the run's decisions (once it is a Sequential)."""
        seq, model = self.sequential, self.pipelined
        assert seq is not None, "the module is cut into segments at the first batch"
        config = getattr(model, "config", None)
        can_generate = getattr(model, "can_generate", None)
        label_shift = None
        if config is not None and callable(can_generate):  # a Hugging Face model
            causal = bool(can_generate()) and not getattr(config, "is_encoder_decoder", False)
            label_shift = 1 if causal else 0  # a causal LM's loss shifts its labels by one
        return ModelFacts(
            what=self.what,
            layers=len(seq),
            traced_seconds=(self.cut_seconds or 0.0) if self.segmented else None,
            eval_traced=bool(getattr(seq, "has_eval_graph", True)),
            cache_switched="use_cache" in getattr(seq, "call_defaults", {}),
            config_use_cache=getattr(config, "use_cache", None),
            label_shift=label_shift,
            user_compiled=self.user_compiled,
            layer_params=tuple(sum(p.numel() for p in layer.parameters()) for layer in seq),
            layer_trained=tuple(
                sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in seq
            ),
            layer_tensors=tuple(
                sum(1 for p in layer.parameters() if p.requires_grad) for layer in seq
            ),
            halved=self.halved,
            # the user's module, not the cut: a traced one's segments hold plain modules in
            # BatchNorm's place, and the run would take its N from timing where N = 1 keeps
            # the statistics
            batch_statistics=any(
                isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()
            ),
            # Hugging Face's gradient_checkpointing_enable() marks the layers it checkpoints
            gradient_checkpointing=any(
                getattr(m, "gradient_checkpointing", False) is True for m in model.modules()
            ),
        )

    def state_key(self, stage_key: str) -> str:
        """A stage module's state-dict key as the LightningModule's own."""
        if self.segmented:  # "<segment>.<name in the pipelined module>"
            stage_key = stage_key.partition(".")[2]
        return f"{self.path}.{stage_key}"


def loss_of(result: Any, step: str = "training_step") -> torch.Tensor:
    """The loss in what a training step returned: a tensor or a dict with ``"loss"``."""
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, dict) and isinstance(result.get("loss"), torch.Tensor):
        return result["loss"]
    raise TypeError(
        f"{step} returned {type(result).__name__}; with pipemare it must return the loss "
        "tensor (or a dict with a 'loss' tensor) for every batch"
    )


@contextlib.contextmanager
def state_kept(module: nn.Module) -> Iterator[None]:
    """Put back, after the block, what a training step may change on ``module`` besides its
    weights: its torchmetrics objects' states, and its own public attributes (a list of step
    outputs appended to, a counter, a tensor accumulated in place). The block runs the user's
    step code on the first batch to time it."""
    metrics: list[Any] = [m for m in module.modules() if _is_metric(m)]
    saved = [
        (m._copy_state_dict(), m._update_count, m._forward_cache, m._computed) for m in metrics
    ]
    own = {k: (v, _copied(v)) for k, v in vars(module).items() if not k.startswith("_")}
    try:
        yield
    finally:
        for metric, (states, count, cache, computed) in zip(metrics, saved, strict=True):
            for name, value in states.items():
                setattr(metric, name, value)
            metric._update_count, metric._forward_cache, metric._computed = count, cache, computed
        attributes = vars(module)
        for name in [k for k in attributes if not k.startswith("_") and k not in own]:
            del attributes[name]  # set during the block
        for name, (value, copied) in own.items():
            _restore(value, copied)
            attributes[name] = value


def _copied(value: Any) -> Any:
    """What :func:`_restore` puts back into ``value``: a container's items, a tensor's data."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, dict, set)):
        return copy.copy(value)
    return None


def _restore(value: Any, copied: Any) -> None:
    """Put ``copied`` (:func:`_copied`) back into ``value`` in place, so references to it stay
    valid."""
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            value.copy_(copied)
    elif isinstance(value, list):
        value[:] = copied
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(copied)


def _is_metric(value: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    return isinstance(value, Metric)


def _reduce_name(kwargs: dict[str, Any]) -> str:
    fx = kwargs.get("reduce_fx", "mean")
    name = fx if isinstance(fx, str) else getattr(fx, "__name__", "mean")
    return {"avg": "mean", "amax": "max", "amin": "min"}.get(name, name)


@dataclasses.dataclass
class Record:
    """One logged name, combined over a step's microbatches."""

    name: str
    kwargs: dict[str, Any]
    value: float | None = None  # plain values
    weight: float = 0.0
    metric: str | None = None  # torchmetrics: the metric's attribute path in the module
    forward_cache: torch.Tensor | None = None
    update_count: int = 0

    def add(self, value: float, weight: float) -> None:
        fx = _reduce_name(self.kwargs)
        if self.value is None:
            self.value = value * weight if fx == "mean" else value
        elif fx == "mean":
            self.value += value * weight
        elif fx == "sum":
            self.value += value
        elif fx == "max":
            self.value = max(self.value, value)
        elif fx == "min":
            self.value = min(self.value, value)
        else:
            raise ValueError(
                f"self.log({self.name!r}, reduce_fx={self.kwargs.get('reduce_fx')!r}) cannot be "
                "combined over microbatches; use 'mean', 'sum', 'max' or 'min'"
            )
        self.weight += weight

    def result(self) -> float:
        assert self.value is not None
        return self.value / self.weight if _reduce_name(self.kwargs) == "mean" else self.value


def merge_records(parts: list[list[Record]]) -> list[Record]:
    """One step's records from each copy of the pipeline (D data-parallel copies), combined
    as the microbatches are: the mean over copies of equal share (each copy's weights sum to
    one), the sum, the max or the min. A torchmetrics record keeps copy 0's step value; its
    state stays with each copy's last stage and ``compute()`` syncs all of them at epoch end.
    """
    merged: dict[str, Record] = {}
    for records in parts:
        for r in records:
            have = merged.get(r.name)
            if have is None:
                merged[r.name] = dataclasses.replace(r, kwargs=dict(r.kwargs))
            elif r.metric is not None:
                have.update_count = max(have.update_count, r.update_count)
            elif r.value is not None:
                fx = _reduce_name(r.kwargs)
                if have.value is None:
                    have.value, have.weight = r.value, r.weight
                elif fx in ("mean", "sum"):
                    have.value += r.value
                    have.weight += r.weight
                else:
                    pick = max if fx == "max" else min
                    have.value = pick(have.value, r.value)
    return list(merged.values())


class LogRecorder:
    """Stands in for ``LightningModule.log`` while the user's steps run, then replays."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.records: dict[str, Record] = {}
        self._weight = 1.0
        self._batch_size: int | None = None
        self._metric_paths = {id(m): n for n, m in module.named_modules() if _is_metric(m)}

    def recording(self, weight: float, batch_size: int | None = None) -> Callable[..., None]:
        """A ``log`` replacement for one microbatch carrying ``weight`` of the minibatch.

        ``batch_size`` (the minibatch's) is given to the replayed ``log`` unless the user
        passed one: a record is replayed during a later step, whose batch may differ in size
        (e.g. a validation loader's last batch), and Lightning weights epoch means by it.
        """
        self._weight, self._batch_size = weight, batch_size
        return self._log

    def _log(self, name: str, value: Any, **kwargs: Any) -> None:
        kwargs.pop("sync_dist_group", None)  # a process group does not travel between ranks
        if self._batch_size is not None and kwargs.get("batch_size") is None:
            kwargs["batch_size"] = self._batch_size
        record = self.records.setdefault(name, Record(name, kwargs))
        if _is_metric(value):
            path = self._metric_paths.get(id(value))
            if path is None:
                raise ValueError(
                    f"self.log({name!r}, metric) needs the torchmetrics object to be an attribute "
                    "of the LightningModule so every rank can find it"
                )
            record.metric = path
            cache = getattr(value, "_forward_cache", None)
            record.forward_cache = cache.detach().cpu() if isinstance(cache, torch.Tensor) else None
            record.update_count = int(getattr(value, "_update_count", 0))
            return
        if isinstance(value, torch.Tensor):
            value = value.detach().float().item()
        record.add(float(value), self._weight)

    def take(self) -> list[Record]:
        """The combined records of this step (and forget them)."""
        records, self.records = list(self.records.values()), {}
        return records

    def replay(self, records: list[Record], log: Callable[..., None], device: torch.device) -> None:
        """Call the real ``log`` once per record, identically on every rank."""
        for r in records:
            if r.metric is not None:
                metric: Any = self.module.get_submodule(r.metric)
                if r.forward_cache is not None:
                    metric._forward_cache = r.forward_cache.to(device)
                # The state stays on the last stage; its update count tells compute() on the
                # other ranks that syncing (not updating locally) is expected here.
                metric._update_count = max(int(metric._update_count), r.update_count)
                log(r.name, metric, **r.kwargs)
            else:
                log(r.name, torch.tensor(r.result(), device=device), **r.kwargs)


class UserSteps:
    """Runs one kind of user step (``training_step``, ...) per microbatch and replays its logs.

    Args:
        module: the LightningModule.
        adapter: splits its step around the Sequential.
        forward_context: the precision plugin's context around forward computation.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        adapter: ModuleAdapter,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self.module, self.adapter = module, adapter
        self.recorder = LogRecorder(module)
        #: what a training step under manual optimisation needs (:mod:`~pipemare.lightning.manual`)
        self.manual = ManualOptimization(module)
        self._forward_context = forward_context
        self.name, self.args, self.size = "training_step", (), 1
        self._batch: Any = None
        #: the pipeline's microbatch weights (None: by rows); logs are combined with them
        self.shares: Callable[[list[Any]], list[float]] | None = None
        #: where the last stage publishes each minibatch's ``(loss, records)``
        self.results: Results | None = None

    def begin(self, name: str, batch: Any, args: tuple) -> None:
        """The step the next microbatches belong to."""
        self.name, self.args, self.size = name, args, batch_size(batch)
        self._batch = batch

    @contextlib.contextmanager
    def logging_to(self, log: Callable[..., None]) -> Iterator[None]:
        """Route the module's ``self.log`` calls to ``log`` for the duration (inside another
        such block, back to that block's ``log`` after)."""
        outer = self.module.__dict__.get("log")
        self.module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            if outer is None:
                del self.module.log
            else:
                self.module.log = outer  # type: ignore[method-assign]

    def discarding_logs(self) -> contextlib.AbstractContextManager[None]:
        return self.logging_to(lambda *a, **k: None)

    def input(self, microbatch: Any) -> Any:
        """First stage: what the step passes to its Sequential (its own logs are dropped)."""
        with self.discarding_logs(), self._forward_context():
            return self.adapter.capture_input(self.name, microbatch, *self.args)

    def head(self, out: Any, microbatch: Any) -> Any:
        """Last stage: the rest of the step on the pipeline's output, its logs recorded."""
        weight = self._share(microbatch)
        with self.logging_to(self.recorder.recording(weight, self.size)):
            return self.adapter.run_with_output(self.name, out, microbatch, *self.args)

    @contextlib.contextmanager
    def rehearsal(self, step: str, args: tuple) -> Iterator[Callable[[Any, Any], torch.Tensor]]:
        """:meth:`loss` as the run computes it for ``step``, to time it (and the step's code
        before the model) at setup on the first batch: its logs are recorded as the run
        records them and thrown away, and what the step changed on the module is put back
        after the block (:func:`state_kept`)."""
        recorder = LogRecorder(self.module)

        def loss(out: Any, microbatch: Any) -> torch.Tensor:
            with self.logging_to(recorder.recording(1.0, batch_size(microbatch))):
                result = self.adapter.run_with_output(step, out, microbatch, *args)
            recorder.take()
            return loss_of(result, step)

        with state_kept(self.module):
            yield loss

    def _share(self, microbatch: Any) -> float:
        """``microbatch``'s share of its batch by the pipeline's weights (rows by default), so
        that its logs combine as its loss does: the weights' ratio between it and the whole
        batch (for counted tokens, its tokens over the batch's)."""
        if self.shares is not None:
            mine, whole = self.shares([microbatch, self._batch])
            if whole > 0:
                return mine / whole
        return batch_size(microbatch) / self.size

    def loss(self, out: Any, microbatch: Any) -> torch.Tensor:
        if self.manual.active and self.name == "training_step":
            return self.manual.loss(lambda: self.head(out, microbatch))
        return loss_of(self.head(out, microbatch))

    def publish(self, minibatch: int, value: Any) -> None:
        """Last stage: ``value`` and the logs recorded since the last call, for every process."""
        assert self.results is not None
        self.results.publish(minibatch, (value, self.recorder.take()))

    def replay_through(self, minibatch: int, device: torch.device) -> list[Any]:
        """Replay the logs of every minibatch not replayed yet up to ``minibatch``.

        Returns:
            Their published values (losses or step outputs), oldest first.
        """
        assert self.results is not None
        values = []
        for value, records in self.results.take_through(minibatch):
            self.replay(records, device)
            values.append(value)
        return values

    def replay(self, records: list[Record], device: torch.device) -> None:
        self.recorder.replay(records, self.module.log, device)


def merge_published(parts: list[tuple[Any, list[Record]]]) -> tuple[Any, list[Record]]:
    """What D copies of the pipeline published for one minibatch, as one result: the mean of
    their losses (copy 0's value when it is not a number, e.g. a step's outputs) and their
    logs combined (:func:`merge_records`)."""
    values = [v for v, _ in parts]
    value = values[0]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        value = sum(values) / len(values)
    return value, merge_records([records for _, records in parts])


def closes_epoch(trainer: pl.Trainer) -> bool:
    """Whether the running training step is the last of its epoch or of the run (where known)."""
    loop = trainer.fit_loop.epoch_loop
    if loop._num_ready_batches_reached():
        return True
    step = steps_per_batch(trainer)  # a batch may count a step per optimiser (manual)
    return trainer.max_steps != -1 and loop.global_step + step >= trainer.max_steps


def closes_loader(trainer: pl.Trainer, batch_idx: int, args: tuple) -> bool:
    """Whether the running evaluation batch is the last of its dataloader."""
    loader = int(args[0]) if args else 0
    if trainer.sanity_checking:
        counts = trainer.num_sanity_val_batches
    elif trainer.testing:
        counts = trainer.num_test_batches
    else:
        counts = trainer.num_val_batches
    count = counts[loader] if loader < len(counts) else math.inf
    progress = getattr(trainer._active_loop, "batch_progress", None)
    return bool(getattr(progress, "is_last_batch", False)) or batch_idx + 1 >= count


def short_last_batches(trainer: pl.Trainer) -> list[tuple[int, int, int]]:
    """``(last, samples, batch_size)`` of each training DataLoader whose last batch is smaller
    than the others (a sized dataset, no ``drop_last``)."""
    from torch.utils.data import DataLoader

    loaders = trainer.train_dataloader
    flat = getattr(loaders, "flattened", None)
    found = []
    for loader in flat if flat is not None else [loaders]:
        if not isinstance(loader, DataLoader) or loader.batch_size is None or loader.drop_last:
            continue
        try:
            n = len(loader.dataset)  # type: ignore[arg-type]
        except TypeError:  # an iterable dataset: its length is not known
            continue
        if n % loader.batch_size:
            found.append((n % loader.batch_size, n, loader.batch_size))
    return found


def run_length(trainer: pl.Trainer) -> tuple[int | None, int | None]:
    """The run's optimiser steps and steps per epoch (T1's horizon), each None where the
    Trainer does not know it."""
    total = trainer.estimated_stepping_batches
    per_batch = steps_per_batch(trainer)  # several optimisers: max_steps counts each one
    if per_batch > 1 and trainer.max_steps != -1:
        total = min(total, math.ceil(trainer.max_steps / per_batch))
    per_epoch = trainer.num_training_batches

    def whole(value: float) -> int | None:
        return int(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    return whole(total), whole(per_epoch)


def read_first_training_batch(trainer: pl.Trainer) -> tuple[Any, str | None]:
    """The batch the training loop will feed first, read now and handed back to the loop,
    which then feeds it as if it had never been read; or ``(None, why)`` where the loop's
    data cannot be read ahead.

    The fit loop's data is set up here (Lightning does so when the run's length is first
    asked), and its fetcher (``fit_loop._data_fetcher``, the same in both Lightning packages)
    takes the batch back as a prefetched one: Lightning's ``_PrefetchDataFetcher`` returns
    prefetched batches first, and ``fetched`` and ``done`` are set as if the batch had been
    prefetched. A loop fed through ``dataloader_iter`` cannot be read ahead.
    """
    if trainer.limit_train_batches == 0:
        return None, "the Trainer trains on no batches (limit_train_batches=0)"
    loop = trainer.fit_loop
    loop.setup_data()
    fetcher = getattr(loop, "_data_fetcher", None)
    held = getattr(fetcher, "batches", None)
    if (
        fetcher is None
        or not isinstance(held, list)
        or type(fetcher).__name__ != ("_PrefetchDataFetcher")
    ):
        return None, "its training_step reads its own batches (dataloader_iter)"
    prefetched = bool(held)
    try:
        item = next(fetcher)  # (batch, batch_idx, dataloader_idx)
    except StopIteration:
        return None, "the training data is empty"
    fetcher.batches.insert(0, item)
    fetcher.done = False
    if not prefetched:  # a sized loader is not prefetched: count the batch as not yet read
        fetcher.fetched -= 1
    return item[0], None
