"""A stage-by-stage picture of a running pipeline, taken without draining it.

A non-flushing pipeline never has a moment when every stage holds the same minibatch's
weights: when step ``t`` ends, the last stage has applied the update of minibatch ``t`` (or
nearly) while stage 0 still has the updates of minibatches ``t - L + 1 .. t`` ahead of it.
Draining the pipeline to save would change what every later step computes. A
:class:`Snapshot` of minibatch ``t`` instead copies each stage's state at the point in that
stage's own action stream where a drain after minibatch ``t`` would leave it:

- its module buffers (e.g. BatchNorm statistics) and random stream right after its forward
  of the minibatch's last microbatch (later forwards move them, updates do not);
- its weights, optimiser state and correction buffers right after its update of minibatch
  ``t`` (forwards of later microbatches before that update leave them alone).

The copies are taken by hooks as the stage reaches those points, so the run goes on exactly
as if nothing were saved; the snapshot is complete once every local stage applied update
``t`` (:func:`pipemare.engine.lagged.snapshot_lag` steps later). Resuming from it continues like a
run that drained after minibatch ``t``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipemare.schedule.actions import Action, Op

if TYPE_CHECKING:
    from pipemare.engine.pipeline import Pipeline

__all__ = ["Snapshot"]


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _copy_state(module: nn.Module, parameters: bool) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s state dict entries: its parameters, or everything else. A frozen
    parameter (no gradient) is held by reference: no update changes it."""
    return {
        k: v.detach() if isinstance(v, nn.Parameter) and not v.requires_grad else _copy(v)
        for k, v in module.state_dict(keep_vars=True).items()
        if isinstance(v, nn.Parameter) == parameters
    }


class _StageParts:
    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] | None = None
        self.rng: torch.Tensor | None = None
        self.params: dict[str, torch.Tensor] | None = None
        self.optimizer: dict[int, dict[str, Any]] = {}
        self.corrections: dict[str, dict[int, torch.Tensor]] = {}


class Snapshot:
    """Each local stage's state as a drain after minibatch ``minibatch`` would leave it.

    Args:
        pipe: the running pipeline.
        minibatch: the last minibatch the state includes; default the last one fed.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from pipemare import Pipeline
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> pipe = Pipeline(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                 nn.functional.cross_entropy, stages=3, microbatches=1)
        >>> _ = pipe.step((torch.randn(2, 4), torch.tensor([0, 1])))
        >>> snap = Snapshot(pipe)
        >>> snap.complete  # stage 0 has not yet applied minibatch 0's update
        False
        >>> pipe.drain()
        >>> snap.complete
        True
    """

    def __init__(self, pipe: Pipeline, minibatch: int | None = None) -> None:
        self.pipe = pipe
        fed = pipe.minibatches_fed
        self.minibatch = fed - 1 if minibatch is None else minibatch
        if not -1 <= self.minibatch < fed:
            raise ValueError(f"minibatch {minibatch} has not been fed ({fed} were)")
        opt = pipe.optimizer
        self._position = {
            id(p): k for k, p in enumerate(p for g in opt.param_groups for p in g["params"])
        }
        self._parts = {s.index: _StageParts() for s in pipe.stages}
        self._stage = {s.index: s for s in pipe.stages}
        self._last_forward = (self.minibatch + 1) * pipe.microbatches - 1
        done = pipe.executor.done
        for i in self._parts:
            if done[i].get(Op.FORWARD, -1) >= self._last_forward:
                self._take_forward(i)
            if done[i].get(Op.UPDATE, -1) >= self.minibatch:
                self._take_update(i)
        if not self.complete:
            pipe.executor.watchers.append(self._watch)

    @property
    def complete(self) -> bool:
        """Whether every local stage's part has been taken."""
        return all(p.params is not None and p.buffers is not None for p in self._parts.values())

    def _watch(self, stage: int, action: Action) -> None:
        parts = self._parts.get(stage)
        if parts is None:
            return
        if action.op is Op.FORWARD and action.index == self._last_forward:
            self._take_forward(stage)
        elif action.op is Op.UPDATE and action.index == self.minibatch:
            self._take_update(stage)
        if self.complete:
            self.pipe.executor.watchers.remove(self._watch)

    def _take_forward(self, i: int) -> None:
        parts = self._parts[i]
        parts.buffers = _copy_state(self.pipe.stage_modules[i], parameters=False)
        parts.rng = self._stage[i].rng_state()

    def _take_update(self, i: int) -> None:
        parts = self._parts[i]
        parts.params = _copy_state(self.pipe.stage_modules[i], parameters=True)
        opt = self.pipe.optimizer
        params = opt.stage_parameters(i)
        for p in params:
            state = opt.optimizer.state.get(p)
            if state:
                parts.optimizer[self._position[id(p)]] = {k: _copy(v) for k, v in state.items()}
        mine = {id(p) for p in params}
        for c in opt.corrections:
            parts.corrections[c.name] = {
                self._position[id(p)]: _copy(b) for p, b in c.buffers().items() if id(p) in mine
            }

    def _require_complete(self) -> None:
        if not self.complete:
            raise RuntimeError(
                f"the snapshot of minibatch {self.minibatch} is not complete yet: a local "
                "stage has not applied that minibatch's update"
            )

    def module_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per local stage, its module's state dict (keys relative to the stage's module)."""
        self._require_complete()
        out = {}
        for i, parts in self._parts.items():
            assert parts.params is not None and parts.buffers is not None
            order = self.pipe.stage_modules[i].state_dict(keep_vars=True)
            merged = {**parts.params, **parts.buffers}
            out[i] = {k: merged[k] for k in order}
        return out

    def optimizer_state(self) -> dict[int, dict[str, Any]]:
        """The user's optimiser's per-parameter state of the local stages, keyed as
        ``torch.optim`` keys it (the parameter's position over the param groups)."""
        self._require_complete()
        return {k: v for parts in self._parts.values() for k, v in parts.optimizer.items()}

    def pipemare_state(self) -> dict[str, Any]:
        """pipemare's own state, as :meth:`Pipeline.state_dict` and
        :meth:`PipeMareOptimizer.state_dict` (without the user's optimiser) lay it out."""
        self._require_complete()
        buffers: dict[str, dict[int, torch.Tensor]] = {
            c.name: {} for c in self.pipe.optimizer.corrections
        }
        for parts in self._parts.values():
            for name, values in parts.corrections.items():
                buffers[name].update(values)
        return {
            # every setting recorded up to minibatch t has been used by then
            "optimizer": {
                "buffers": buffers,
                "hparams": {},
                "waiting": {},
                "run": self.pipe.optimizer.run_state(),
            },
            "pipeline": {
                "minibatches": self.minibatch + 1,
                "rng": {i: parts.rng for i, parts in self._parts.items()},
            },
        }

    def release(self) -> None:
        """Stop watching (e.g. a save that will not happen after all)."""
        if self._watch in self.pipe.executor.watchers:
            self.pipe.executor.watchers.remove(self._watch)
