"""Muon for the hidden weight matrices and AdamW for the rest, as one ``torch.optim`` optimiser.

Muon (Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks") keeps a
momentum average of each weight matrix's gradient and steps along its orthogonalisation,
``U Vᵀ`` of the average's SVD ``U Σ Vᵀ``, approximated by five iterations of a quintic
Newton-Schulz map with coefficients (3.4445, -4.7750, 2.0315) taken from that write-up.
Embeddings, the output head, norms and biases are stepped by AdamW (the recipe of the NanoGPT
speedruns and of Moonlight, Liu et al. 2025, arXiv 2502.16982). With Moonlight's scaling
``0.2 · sqrt(max(rows, cols))`` Muon's update has AdamW's RMS, so one learning rate and one
weight decay serve both kinds of group (``adjust_lr="match_rms_adamw"``, the default here).

Lightning's automatic optimisation takes one optimiser, so the two kinds live in one:
:class:`MuonAdamW` over groups that say which they are (``use_muon``), which
:func:`muon_param_groups` builds from a module. Both kinds keep their momentum as an average
(Muon's buffer is ``lerp``-ed like Adam's first moment), which is what the staleness
corrections read (:func:`pipemare.optim.corrections.base.momentum_is_average`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["MuonAdamW", "embedding_ids", "muon_param_groups", "orthogonalize", "step_each"]

#: Coefficients of the quintic Newton-Schulz iteration (Jordan et al., 2024).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

_MUON = {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "adjust_lr": "match_rms_adamw"}
_ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8}


@torch.no_grad()
def orthogonalize(matrix: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """An approximation of ``U Vᵀ`` for ``matrix = U Σ Vᵀ``: its singular values pushed near 1.

    Example:
        >>> s = torch.linalg.svdvals(orthogonalize(torch.randn(8, 4)))
        >>> bool(((s > 0.6) & (s < 1.3)).all())
        True
    """
    a, b, c = NS_COEFFICIENTS
    x = matrix.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(matrix.dtype)


def step_each(
    optimizer: torch.optim.Optimizer,
    closure: Callable[[], Any] | None,
    update: Callable[[torch.Tensor, dict[str, Any]], None],
) -> Any:
    """An optimiser's ``step``: the closure's loss (if any), then ``update(p, group)`` for
    every parameter that has a gradient."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                update(p, group)
    return loss


def _muon_scale(shape: torch.Size, adjust: str) -> float:
    rows, cols = shape
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"adjust_lr must be 'match_rms_adamw' or 'original', got {adjust!r}")


def embedding_ids(module: nn.Module) -> set[int]:
    """The ``id`` of every ``nn.Embedding`` parameter of ``module`` (a tied head's weight too)."""
    return {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}


def muon_param_groups(
    module: nn.Module, exclude: Iterable[str] = (), **settings: Any
) -> list[dict[str, Any]]:
    """Two param groups of ``module``: Muon for the hidden matrices, AdamW for everything else.

    Muon gets the 2-D weight of every ``nn.Linear`` except the last one in the module's order
    (the classifier or language-model head) and any weight shared with an ``nn.Embedding``
    (a tied head); AdamW gets embeddings, the head, norms, biases and convolutions. ``exclude``
    names more parameters for AdamW (as ``named_parameters`` spells them); ``settings``
    (``lr``, ``weight_decay``, ...) go into both groups.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
        >>> [len(g["params"]) for g in muon_param_groups(net)]
        [2, 4]
    """
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    skip = set(exclude)
    hidden = {id(m.weight) for m in linears[:-1]} - embedding_ids(module)
    muon: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (muon if id(p) in hidden and p.ndim == 2 and name not in skip else rest).append(p)
    return [
        {"params": muon, "use_muon": True, **settings},
        {"params": rest, "use_muon": False, **settings},
    ]


class MuonAdamW(torch.optim.Optimizer):
    """One optimiser stepping Muon groups (``use_muon=True``) and AdamW groups (``False``).

    Args:
        params: groups that each say ``use_muon`` (e.g. :func:`muon_param_groups`).
        lr: both kinds' learning rate unless a group sets its own.
        weight_decay: decoupled, both kinds.
        momentum: Muon's momentum.
        nesterov: whether Muon's momentum is Nesterov's.
        ns_steps: Muon's Newton-Schulz iterations.
        adjust_lr: how Muon's update is scaled: "match_rms_adamw" to AdamW's RMS, "original"
            by ``sqrt(max(1, rows/cols))``.
        betas: AdamW's.
        eps: AdamW's.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
        >>> opt = MuonAdamW(muon_param_groups(net), lr=1e-3)
        >>> net(torch.randn(3, 4)).sum().backward(); opt.step()
        >>> sorted(opt.state[net[2].weight]), sorted(opt.state[net[3].weight])
        (['momentum_buffer'], ['exp_avg', 'exp_avg_sq', 'step'])
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"lr and weight_decay must be >= 0, got {lr} and {weight_decay}")
        self._kinds = {
            True: {"momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                   "adjust_lr": adjust_lr},
            False: {"betas": betas, "eps": eps},
        }  # fmt: skip
        super().__init__(list(params), {"lr": lr, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict) or "use_muon" not in param_group:
            raise ValueError(
                "MuonAdamW needs param groups that say which kind they are: pass "
                "pipemare.optim.muon_param_groups(model), or dicts with use_muon=True (2-D "
                "weight matrices) or use_muon=False (everything else)"
            )
        kind = bool(param_group["use_muon"])
        group = {**self._kinds[kind], **param_group}
        params = group["params"]
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        if kind:
            bad = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
            if bad:
                raise ValueError(
                    f"Muon steps 2-D weight matrices only; a use_muon group holds parameters of "
                    f"shapes {bad}: give them to a use_muon=False (AdamW) group"
                )
            _muon_scale(torch.Size((1, 1)), group["adjust_lr"])  # refuse a bad setting now
        super().add_param_group(group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return step_each(self, closure, self._step)

    def _step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        if group["use_muon"]:
            self._muon(p, group)
        else:
            self._adamw(p, group)

    def _muon(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(p)
        m, grad = group["momentum"], p.grad
        assert grad is not None
        buf.lerp_(grad, 1 - m)
        direction = grad.lerp(buf, m) if group["nesterov"] else buf
        update = orthogonalize(direction, group["ns_steps"])
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(update, alpha=-lr * _muon_scale(p.shape, group["adjust_lr"]))

    def _adamw(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**t))
