"""Activation recomputation: keep a microbatch's inputs and rerun its forward at backward time.

The forward runs without a graph and keeps only the stage's inputs; the backward reruns the
forward first, at the weights the backward would see anyway
(:meth:`~pipemare.engine.stage.Stage.weight_at`). So *every* term of a delayed gradient,
activations included, comes from backward-time weights: for ``a = σ(W x)`` the rerun gives
``σ'(W_bkwd x)`` where the default keeps ``σ'(W_fwd x)``; ``x``, the stage's input, is the one
the earlier stages sent at forward time either way. Where the backward's weights are the
forward's (``gpipe``, ``1f1b``, and ``pipedream``, whose rerun runs on the stashed version)
recomputation gives exactly the default's gradients. Under ``async`` and ``pipemare`` it gives
a different gradient: the exact vector-Jacobian product of the stage at its backward-time
weights, taken at the forward-time input and the output gradient the later stages send back.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from pipemare.engine.randomness import RngState, replayed

__all__ = ["Rerun", "accumulate", "rerun"]


@dataclasses.dataclass
class Rerun:
    """What a recomputing stage keeps of a microbatch instead of its activations."""

    inputs: Any  # exactly what the module was called with
    rng: RngState


def rerun(
    module: nn.Module,
    params: Mapping[str, nn.Parameter],
    weight_at: Callable[[nn.Parameter], torch.Tensor],
    kept: Rerun,
    forward_context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Run ``module``'s forward on ``kept`` again, with a graph, with each of its ``params``
    (by name) replaced by ``weight_at(param)``, the weights its backward uses.

    Returns its outputs and the weights as leaves, whose ``.grad`` the backward fills.
    """
    weights = {
        name: weight_at(p).detach().requires_grad_(p.requires_grad) for name, p in params.items()
    }
    # copies: the rerun must not update running statistics (BatchNorm) a second time
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    with torch.enable_grad(), replayed(kept.rng), forward_context():
        outputs = torch.func.functional_call(module, {**weights, **buffers}, (kept.inputs,))
    return outputs, weights


@torch.no_grad()
def accumulate(params: Mapping[str, nn.Parameter], weights: Mapping[str, torch.Tensor]) -> None:
    """Add the rerun's weight gradients to the parameters' ``.grad``, as autograd would."""
    for name, p in params.items():
        g = weights[name].grad
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
