"""A LightningModule under manual optimisation (``self.automatic_optimization = False``).

Such a module's ``training_step`` calls ``self.manual_backward(loss)`` and steps its optimisers
itself, typically two (``torch.optim.Muon`` for the hidden matrices, ``AdamW`` for the rest).
In a pipeline the step runs per microbatch, in halves on the first and last stage
(:mod:`pipemare.lightning.steps`), and each stage's update comes when the schedule calls for it.
So while the strategy runs a training step:

- the loss is what the step passes to ``self.manual_backward`` (exactly once per call);
- the optimisers that ``self.optimizers()`` returns step and zero nothing: the engine steps
  them all, chained (:class:`~pipemare.optim.chain.ChainedOptimizer`), stage by stage, and
  counts one step per optimiser per batch, so ``trainer.global_step`` advances as Lightning's
  own manual loop would for a step that calls each optimiser's ``step()`` once;
- a learning-rate scheduler stepped inside ``training_step``, gradient clipping there,
  ``opt.step(closure)`` and ``toggle_optimizer`` are refused with what to do instead: a
  scheduler steps in ``on_train_batch_end``, which runs once per batch on every process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["ManualOptimization", "steps_per_batch"]


def steps_per_batch(trainer: Any) -> int:
    """How much ``trainer.global_step`` advances per batch: 1, or under manual optimisation
    one per optimiser (each steps once per batch in the pipeline)."""
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        return 1
    return max(1, len(trainer.optimizers))


class _InertOptimizer:
    """A LightningOptimizer as a pipelined training step sees it: its ``step`` and
    ``zero_grad`` do nothing (the engine steps each stage); everything else is the real one's."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> None:
        if closure is not None:
            raise ValueError(
                "pipemare runs each microbatch's forward and backward itself, so an optimiser "
                "step cannot take a closure; call self.manual_backward(loss) and then opt.step()"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # gradients of other microbatches are in flight; the engine clears them

    def toggle_model(self, sync_grad: bool = True) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _RefusedScheduler:
    """A scheduler as a pipelined training step sees it: stepping it there is refused."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            f"pipemare runs training_step once per microbatch and only on the stages that need "
            f"it, so a scheduler cannot step there ({type(self._real).__name__}.step() was "
            "called in training_step); step it in on_train_batch_end, which runs once per "
            "batch on every process: def on_train_batch_end(self, *args): "
            "self.lr_schedulers().step()"
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _refusal(message: str) -> Callable[..., None]:
    """A stand-in for a module method that a pipelined training step cannot run."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ValueError(message)

    return refuse


_refuse_clipping = _refusal(
    "pipemare clips each stage's gradients itself when the update is due; gradient "
    "clipping inside training_step is not supported with pipemare. Remove the "
    "self.clip_gradients call; to clip, use automatic optimisation with "
    "Trainer(gradient_clip_val=...)"
)
_refuse_toggling = _refusal(
    "toggle_optimizer, untoggle_optimizer and toggled_optimizer inside training_step are "
    "not supported with pipemare: it backpropagates the step's one loss through every "
    "stage's parameters, and a microbatch's backward runs after later forwards, so it "
    "cannot leave one optimiser's parameters out for one step. Remove the call; to keep "
    "parameters fixed for the whole run, set requires_grad=False on them before fit"
)


def _shaped(items: list[Any], like: Any) -> Any:
    """``items`` in the shape Lightning returned ``like`` in (one object, or a list)."""
    return items if isinstance(like, list) else items[0]


class ManualOptimization:
    """What the strategy does around a training step of a module under manual optimisation
    (nothing for one under automatic optimisation). See the module's docstring."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._losses: list[torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return not self.module.automatic_optimization

    @contextlib.contextmanager
    def pipelined(self) -> Iterator[None]:
        """Around a training step: inert optimisers, refused schedulers and clipping, and
        ``manual_backward`` recording the loss (see :meth:`loss`)."""
        if not self.active:
            yield
            return
        module = self.module
        optimizers = module.optimizers()
        inert = [_InertOptimizer(o) for o in _listed(optimizers)]
        schedulers = module.lr_schedulers()
        refused = [_RefusedScheduler(s) for s in _listed(schedulers)]
        module.optimizers = lambda use_pl_optimizer=True: _shaped(inert, optimizers)
        module.lr_schedulers = lambda: _shaped(refused, schedulers) if refused else None
        module.manual_backward = self._record
        module.clip_gradients = _refuse_clipping
        toggles = ("toggle_optimizer", "untoggle_optimizer", "toggled_optimizer")
        for name in toggles:
            setattr(module, name, _refuse_toggling)
        try:
            yield
        finally:
            for name in ("optimizers", "lr_schedulers", "manual_backward", "clip_gradients"):
                delattr(module, name)
            for name in toggles:
                delattr(module, name)

    def _record(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self._losses is not None:  # outside loss(): the step's first half, or a trace
            self._losses.append(loss)

    def loss(self, run: Callable[[], Any]) -> torch.Tensor:
        """The loss the step passed to ``manual_backward`` while ``run()`` ran it."""
        self._losses = []
        try:
            run()
        finally:
            losses, self._losses = self._losses, None
        if len(losses) != 1:
            raise ValueError(
                f"training_step called self.manual_backward {len(losses)} times in one step; "
                "pipemare backpropagates one loss per microbatch through the pipeline: call it "
                "once, on the sum of your losses"
            )
        return losses[0]

    def after_step(self, stash: Callable[[], None]) -> None:
        """After a training step: under automatic optimisation ``stash()`` (Lightning zeroes
        the gradients next, in-flight ones stay aside); under manual optimisation count one
        step per optimiser in Lightning's progress (its ``global_step``)."""
        if not self.active:
            stash()
            return
        for optimizer in _listed(self.module.optimizers()):
            optimizer._on_before_step()
            optimizer._on_after_step()

    def check_step(self) -> None:
        """Refuse an optimiser step outside a pipelined training step (e.g. in a hook)."""
        if self.active:
            raise ValueError(
                "pipemare steps the optimisers itself, stage by stage: call opt.step() only "
                "inside training_step, where it marks the step (the pipeline applies it)"
            )


def _listed(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
