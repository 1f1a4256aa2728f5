"""Running an unchanged LightningModule's step functions through a pipeline.

The user's ``training_step`` calls its pipelined module (a ``self.gpt``, a ``self.net``) once.
To run it on a pipeline, that attribute is swapped, for the duration of one call, for a
stand-in:

- on the first stage a :class:`_Capture` records what the module receives (any positional and
  keyword arguments) and stops the step right there (the rest of the step runs on the last
  stage);
- on the last stage an :class:`_Inject` returns the pipeline's output (the module's own output
  structure: a tensor, a tuple, a Hugging Face ``ModelOutput``) instead of running the layers,
  so the rest of the user's step (loss, metrics, ``self.log``) runs on it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._dynamo import OptimizedModule
from typing_extensions import override

__all__ = ["ModuleAdapter", "loss_of"]


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

    def prepare(self, step: str, *args: Any) -> nn.Sequential:
        """The Sequential the pipeline runs; a module that is not one is cut into segments now,
        from what ``module.<step>(*args)`` passes it."""
        if self.sequential is None:
            from pipemare.model.segments import segment_module

            call_args, call_kwargs = self._capture(step, *args)
            start = time.perf_counter()
            self.sequential = segment_module(
                self.pipelined,
                call_args,
                call_kwargs,
                split_points=self.split_points,
                dynamic=self.dynamic_shapes,
            )
            self.cut_seconds = time.perf_counter() - start
        return self.sequential

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
