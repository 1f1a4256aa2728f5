"""Running an unchanged LightningModule's step functions through a pipeline.

The user's ``training_step`` calls its ``nn.Sequential`` once. To run it on a pipeline, the
Sequential attribute is swapped, for the duration of one call, for a stand-in:

- on the first stage a :class:`_Capture` records what the Sequential receives and stops the
  step right there (the rest of the step, the loss, runs on the last stage);
- on the last stage an :class:`_Inject` returns the pipeline's output instead of running the
  layers, so the rest of the user's step (loss, metrics, ``self.log``) runs on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleAdapter", "loss_of"]


class _Captured(BaseException):  # BaseException: a user's `except Exception` must not swallow it
    def __init__(self, value: Any) -> None:
        super().__init__("pipemare captured the Sequential's input")
        self.value = value


class _StandIn(nn.Module):
    """Takes the Sequential's place during a step; the step may only call it."""

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
    def forward(self, x: Any) -> Any:
        raise _Captured(x)


class _Inject(_StandIn):
    def __init__(self, output: Any, owner: str = "the module", path: str = "net") -> None:
        super().__init__(owner, path)
        self.output, self.calls = output, 0

    def forward(self, x: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(
                "the pipelined nn.Sequential was called twice in one step; pipemare runs it "
                "once per microbatch. Call it once per step, or pipeline a different module"
            )
        return self.output


class ModuleAdapter:
    """Calls a LightningModule's step functions with its Sequential swapped for a stand-in.

    Args:
        module: the user's LightningModule.
        path: dotted path of the pipelined Sequential inside ``module``.
    """

    def __init__(self, module: nn.Module, path: str) -> None:
        self.module, self.path = module, path
        parent, _, attr = path.rpartition(".")
        self._parent = module.get_submodule(parent) if parent else module
        self._attr = attr
        self.sequential = getattr(self._parent, attr)

    def check_no_outside_parameters(self) -> None:
        """Trainable parameters outside the Sequential would be trained on one stage only."""
        inside = {id(p) for p in self.sequential.parameters()}
        outside = [
            n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in inside
        ]
        if outside:
            shown = ", ".join(outside[:4]) + (", ..." if len(outside) > 4 else "")
            raise ValueError(
                f"{type(self.module).__name__} has trainable parameters outside "
                f"{self.path} ({shown}); pipemare only pipelines {self.path}, so these would "
                f"train on one stage and go stale on the others. Move those layers into the "
                f"nn.Sequential (e.g. nn.Sequential(embedding, *blocks, head)) or freeze them"
            )

    @contextlib.contextmanager
    def _swapped(self, stand_in: nn.Module) -> Iterator[None]:
        self._parent._modules[self._attr] = stand_in
        try:
            yield
        finally:
            self._parent._modules[self._attr] = self.sequential

    def capture_input(self, step: str, *args: Any) -> Any:
        """Run ``module.<step>(*args)`` up to its Sequential call; return the Sequential's input."""
        with self._swapped(_Capture(type(self.module).__name__, self.path)):
            try:
                getattr(self.module, step)(*args)
            except _Captured as captured:
                return captured.value
        raise RuntimeError(
            f"{type(self.module).__name__}.{step} returned without calling {self.path}; "
            f"pipemare needs the step to pass its input through {self.path}"
        )

    def run_with_output(self, step: str, output: Any, *args: Any) -> Any:
        """Run ``module.<step>(*args)``, the Sequential returning ``output``; return the result."""
        inject = _Inject(output, type(self.module).__name__, self.path)
        with self._swapped(inject):
            result = getattr(self.module, step)(*args)
        if inject.calls == 0:
            raise RuntimeError(
                f"{type(self.module).__name__}.{step} did not call {self.path}; pipemare needs "
                f"the step to pass its input through {self.path}"
            )
        return result


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
