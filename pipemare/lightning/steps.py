"""The LightningModule's own step functions, run per microbatch in the pipeline, logs replayed.

The user's ``training_step`` (or ``validation_step``, ...) runs in two halves: on the first
stage up to the point where it calls its pipelined module (an ``nn.Sequential``, or a module
traced and cut into segments; what it passes is the pipeline's input), on the last stage from
there on (the loss, metrics, ``self.log``). Its ``self.log`` calls are recorded per
microbatch, combined per minibatch, published with the minibatch's loss
(:mod:`pipemare.engine.lagged`), and replayed through the real ``LightningModule.log`` on every
process at the same step, lagged by the pipeline's depth.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch

from pipemare.engine.lagged import Results
from pipemare.engine.microbatch import batch_size
from pipemare.lightning.logreplay import LogRecorder, Record, merge_records
from pipemare.lightning.manual import ManualOptimization, steps_per_batch
from pipemare.lightning.module_adapter import ModuleAdapter, loss_of

__all__ = [
    "UserSteps",
    "closes_epoch",
    "closes_loader",
    "merge_published",
    "short_last_batches",
]


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
        """Route the module's ``self.log`` calls to ``log`` for the duration."""
        self.module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log

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
    logs combined (:func:`pipemare.lightning.logreplay.merge_records`)."""
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
