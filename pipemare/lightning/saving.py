"""Checkpoints of a running pipeline that leave its trajectory alone.

Lightning saves by asking the strategy for the model's and the optimiser's state
(``dump_checkpoint``) and then handing the dict to ``save_checkpoint``. Draining the pipeline
there would make every later step depend on how often the run checkpoints. Instead, the
strategy answers with a :class:`~pipemare.engine.snapshot.Snapshot` of the step's minibatch: each
stage's state is copied as that stage reaches the point a drain would have left it at, and
the checkpoint is written, in order with the saves and removals queued before and after it,
once every stage has passed that point — :func:`~pipemare.engine.lagged.snapshot_lag` steps later
(with one process per stage, every process writes at that same step, since collecting the
stages' parts is a collective), or at the next drain (validation, the end of training).

So a checkpoint of step ``t`` holds exactly what a run that drained after step ``t`` holds,
its file appears ``L`` steps later, and a removal Lightning asks for after it (top-k
rotation) waits for it: the previous checkpoint is never gone before the new one is whole.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from pipemare.engine.lagged import snapshot_lag
from pipemare.engine.pipeline import Pipeline
from pipemare.engine.snapshot import Snapshot
from pipemare.engine.transport import DistributedTransport
from pipemare.lightning import checkpointing
from pipemare.lightning.checkpointing import StateNames
from pipemare.optim.chain import ChainedOptimizer

__all__ = ["Deferred", "SaveQueue"]


class Deferred(dict[str, Any]):
    """Stands for a state that a snapshot still collects; empty until the write fills it."""

    def __init__(
        self,
        snapshot: Snapshot,
        param_groups: list[dict[str, Any]] | None = None,
        span: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.snapshot = snapshot
        self.param_groups, self.span = param_groups, span


@dataclasses.dataclass
class _Entry:
    filepath: str
    checkpoint: dict[str, Any] | None = None  # None: a removal
    storage_options: Any = None
    snapshot: Snapshot | None = None
    due: int = 0  # the step (minibatch) at whose end every process has its part


class SaveQueue:
    """The strategy's saves and removals, in Lightning's order, each when its state is whole.

    Args:
        write: writes a complete checkpoint (the strategy's base ``save_checkpoint``).
        remove: removes a checkpoint file (the base ``remove_checkpoint``).
    """

    def __init__(
        self,
        write: Callable[[dict[str, Any], str, Any], None],
        remove: Callable[[str], None],
    ) -> None:
        self._write, self._remove = write, remove
        self._entries: collections.deque[_Entry] = collections.deque()
        self._current: Snapshot | None = None  # taken by the dump in progress

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pending(self) -> list[str]:
        """Files asked for and not written yet."""
        return [e.filepath for e in self._entries if e.checkpoint is not None]

    # -- Lightning's dump_checkpoint -----------------------------------------------------

    def _snapshot(self, pipe: Pipeline) -> Snapshot:
        minibatch = pipe.minibatches_fed - 1
        if self._current is None or self._current.minibatch != minibatch:
            # several saves of one step (a top-k file and last.ckpt) share one snapshot
            same = [e.snapshot for e in self._entries if e.snapshot is not None]
            if same and same[-1].minibatch == minibatch:
                self._current = same[-1]
            else:
                self._current = Snapshot(pipe, minibatch)
        return self._current

    @staticmethod
    def _ready_now(pipe: Pipeline, snap: Snapshot) -> bool:
        if not isinstance(pipe.transport, DistributedTransport):
            return snap.complete
        # every process must decide alike: only what the schedule tells, never local progress
        return pipe.drained or snapshot_lag(pipe.schedule, pipe.num_stages, pipe.microbatches) == 0

    def module_state(self, module: nn.Module, pipe: Pipeline, names: StateNames) -> dict[str, Any]:
        """``lightning_module_state_dict``: the whole model now, or a :class:`Deferred`."""
        snap = self._snapshot(pipe)
        if self._ready_now(pipe, snap):
            return checkpointing.module_state(module, pipe, names, snapshot=snap)
        return Deferred(snap)

    def optimizer_state(self, optimizer: Any, pipe: Pipeline) -> dict[str, Any]:
        """``optimizer_state``: the whole optimiser state now, or a :class:`Deferred`."""
        snap = self._snapshot(pipe)
        groups = copy.deepcopy(optimizer.state_dict()["param_groups"])
        chain = pipe.optimizer.optimizer  # several optimisers: this one's part of the chain
        span = chain.span(optimizer) if isinstance(chain, ChainedOptimizer) else None
        if self._ready_now(pipe, snap):
            return checkpointing.optimizer_state(groups, snap, span)
        return Deferred(snap, groups, span)

    # -- Lightning's save_checkpoint / remove_checkpoint -------------------------------------

    def save(
        self, checkpoint: dict[str, Any], filepath: str, storage_options: Any, pipe: Pipeline | None
    ) -> None:
        self._current = None
        state = checkpoint.get("state_dict")
        snap = state.snapshot if isinstance(state, Deferred) else None
        if snap is None and not self._entries:
            self._write(checkpoint, filepath, storage_options)
            return
        entry = _Entry(filepath, checkpoint, storage_options, snap)
        if snap is not None:
            assert pipe is not None
            lag = snapshot_lag(pipe.schedule, pipe.num_stages, pipe.microbatches)
            entry.due = snap.minibatch + lag
            # the rest of the dict (loops, callbacks, schedulers) as it is at this step
            entry.checkpoint = {
                k: v if isinstance(v, Deferred) else copy.deepcopy(v)
                for k, v in checkpoint.items()
                if k != "optimizer_states"
            }
            entry.checkpoint["optimizer_states"] = list(checkpoint.get("optimizer_states", []))
        self._entries.append(entry)

    def remove(self, filepath: str) -> None:
        if self._entries:
            self._entries.append(_Entry(filepath))
        else:
            self._remove(filepath)

    # -- writing what is due -----------------------------------------------------------------

    def poll(self, module: nn.Module, pipe: Pipeline | None, names: StateNames) -> None:
        """Write and remove, in order, everything whose state is whole by now; call it at the
        end of every training step and after every drain, on every process alike."""
        while self._entries:
            entry = self._entries[0]
            if entry.checkpoint is None:
                self._remove(entry.filepath)
            else:
                if entry.snapshot is not None:
                    assert pipe is not None
                    if not self._due(pipe, entry):
                        return
                    self._fill(entry, module, pipe, names)
                self._write(entry.checkpoint, entry.filepath, entry.storage_options)
            self._entries.popleft()

    @staticmethod
    def _due(pipe: Pipeline, entry: _Entry) -> bool:
        assert entry.snapshot is not None
        if not isinstance(pipe.transport, DistributedTransport):
            return entry.snapshot.complete
        due = pipe.drained or pipe.minibatches_fed - 1 >= entry.due
        if due and not entry.snapshot.complete:
            raise RuntimeError(
                f"pipemare: the checkpoint of step {entry.snapshot.minibatch + 1} should be "
                "complete in every process by now and is not here; this is a bug, please report it"
            )
        return due

    @staticmethod
    def _fill(entry: _Entry, module: nn.Module, pipe: Pipeline, names: StateNames) -> None:
        checkpoint, snap = entry.checkpoint, entry.snapshot
        assert checkpoint is not None and snap is not None
        checkpoint["state_dict"] = checkpointing.module_state(module, pipe, names, snapshot=snap)
        checkpoint["optimizer_states"] = [
            checkpointing.optimizer_state(s.param_groups or [], snap, s.span)
            if isinstance(s, Deferred)
            else s
            for s in checkpoint["optimizer_states"]
        ]

    def abandon(self, warn: Callable[[str], Any] | None = None) -> list[str]:
        """Drop everything queued (after an error); returns the files never written, and
        names them through ``warn`` when given."""
        lost = self.pending
        for entry in self._entries:
            if entry.snapshot is not None:
                entry.snapshot.release()
        self._entries.clear()
        self._current = None
        if lost and warn is not None:
            warn(
                f"pipemare: {len(lost)} checkpoint(s) not written, their step's updates had not "
                f"reached every stage when the run stopped: {', '.join(lost)}; the files written "
                "before are intact"
            )
        return lost
