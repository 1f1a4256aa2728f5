"""AdamW in a rotated basis: the basis-rotation remedy for stale gradients, without a stash.

Jung, Shin and Lee (ICML 2026, arXiv 2602.03515) trace Adam's sensitivity to delay to the
misalignment between the Hessian's eigenbasis and the coordinate axes: Adam normalises each
coordinate on its own, so where the stiff directions are not coordinates its trajectory
oscillates, and a delayed update taken along an oscillation points the wrong way by the time
it lands. Rotating Adam into an estimate of the eigenbasis removes the oscillation; they report
76.8% (1B parameters) and 81.7% (3B, 32 stages) fewer iterations than the best asynchronous
baseline, in runs that keep weight stashing.

Here the basis is estimated the way SOAP does it (Vyas et al., 2024, arXiv 2409.11321), from
the Kronecker factors of the gradient's second moment, Shampoo's approximation of the
Gauss-Newton curvature. For a weight matrix ``W`` (``m × n``; a convolution's kernel is read as
``out × rest``) with gradient ``G``::

    G̃ = Q_Lᵀ G Q_R,   m ← β1 m + (1 - β1) G,   m̃ = Q_Lᵀ m Q_R
    v ← β2 v + (1 - β2) G̃²                (v lives in the rotated basis)
    W ← (1 - η λ) W - η Q_L [m̃/(1 - β1^t)] / [sqrt(v/(1 - β2^t)) + ε] Q_Rᵀ
    L ← β_s L + (1 - β_s) G Gᵀ,   R ← β_s R + (1 - β_s) Gᵀ G
    Q_L, Q_R ← eigenvectors of L, R       (after each of the first ``every`` steps, then
                                           after every ``every``-th)

So a step runs in the basis the earlier gradients gave. A matrix's first gradient only seeds
the factors and moves nothing (as SOAP does): stepped in AdamW's basis instead, it would leave
a coordinate-basis ``v`` that, carried into the eigenbasis, smears the stiff directions' large
second moment over the flat ones for the rest of the run (``v`` averages all steps alike);
stepped in its own basis, its singular vectors, every entry of ``G̃`` off the diagonal is
rounding noise that Adam's division blows up to a full step.

The first moment stays in the weights' basis (rotation is linear, so rotating the average is
averaging the rotated gradients while the basis holds): a new basis needs no transport of it,
and the corrections read and set ``betas`` as they do Adam's. The second moment stays where it
is when the basis is re-derived, each entry with the eigenvector of the same rank (as SOAP
keeps it). Carrying it over by the squared overlaps of old and new eigenvectors was tried: on
the misaligned quadratic of the tests, whose eigenvectors are exact, it got 100 times closer
to the minimum under delay; on the character model it trained worse (validation loss 2.146
against 2.108, gpipe, P = 8, one seed), where near-equal eigenvalues' vectors turn from one
derivation to the next and the overlaps smear ``v`` across them.

Directions no earlier gradient has reached (a factor's eigenvalue at rounding level: a dead
unit, or, in the first steps, what a rank-deficient batch gradient has not spanned yet) are
left unstepped until one does, as Adam leaves a coordinate whose gradient is zero; the basis
is re-derived after each of the first ``every`` steps so that the early factors' gaps close
quickly. A side longer than ``max_dim`` keeps the identity (no factor is kept for it); vectors
(biases, norms) and scalars are stepped by plain AdamW.

Memory per ``m × n`` matrix beyond AdamW's two moments: ``L``, ``R``, ``Q_L``, ``Q_R``, i.e.
``2(m² + n²)`` numbers (four weight-sized buffers for a square matrix). This is optimiser
state, not a correction's buffer; :func:`extra_state_bytes` counts it, and the planner's and
the benchmark's memory columns include it with the rest of the optimiser's state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pipemare.optim.muon import embedding_ids, step_each

__all__ = ["RotatedAdamW", "extra_state_bytes", "rotated_param_groups"]

_FACTORS = ("left", "right", "q_left", "q_right")


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _wide(p: torch.Tensor) -> torch.dtype:
    """The dtype the rotation runs in: float32, or float64 for float64 weights."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _drop_unvisited(
    values: torch.Tensor, vectors: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Zero the eigenvectors whose eigenvalue is rounding noise (``n · ε · λ_max`` of a float32
    factor): directions no gradient has reached. Rotated onto such a direction, a gradient is
    only rounding error, which Adam's division would blow up to a full step; zeroed, they are
    not stepped, as Adam leaves a coordinate whose gradient is zero (a dead unit's row)."""
    floor = values.shape[-1] * torch.finfo(dtype).eps * values.abs().max()
    return vectors * (values > floor).to(vectors.dtype)


def extra_state_bytes(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None
) -> int:
    """Bytes of the basis factors (``L``, ``R``, ``Q_L``, ``Q_R``) beyond AdamW's own state, for
    ``params`` (default: all); 0 for an optimiser that keeps none."""
    states = (
        optimizer.state.values() if params is None else [optimizer.state.get(p, {}) for p in params]
    )
    return sum(
        t.numel() * t.element_size()
        for state in states
        for key, t in state.items()
        if key in _FACTORS and isinstance(t, torch.Tensor)
    )


def rotated_param_groups(
    module: nn.Module, exclude: Iterable[str] = (), **settings: Any
) -> list[dict[str, Any]]:
    """Two param groups of ``module`` for :class:`RotatedAdamW`: rotated, and stepped by plain
    AdamW (``rotate=False``): the embeddings and the head, which the Muon recipe leaves to AdamW
    too (convolutions, which it also leaves, are rotated here).

    AdamW gets every ``nn.Embedding``'s weight, the last ``nn.Linear``'s (the classifier or
    language-model head, tied or not) and the parameters ``exclude`` names (as
    ``named_parameters`` spells them); every other matrix is rotated, and vectors are AdamW's in
    either group. On the protocol's tied GPT, rotating the embedding's vocabulary side made
    synchronous training slower than Adam's, and leaving it to AdamW made it faster
    (docs/results.md). A likely reason: an embedding's gradient touches only the rows its
    batch's tokens name, so a factor over the vocabulary follows whichever tokens came lately.
    ``settings`` (``lr``, ``weight_decay``, ...) go into both groups.

    Example:
        >>> net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10))
        >>> [(len(g["params"]), g["rotate"]) for g in rotated_param_groups(net)]
        [(3, True), (2, False)]
    """
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    plain_ids = embedding_ids(module) | ({id(linears[-1].weight)} if linears else set())
    skip = set(exclude)
    rotated: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (plain if id(p) in plain_ids or name in skip else rotated).append(p)
    return [
        {"params": rotated, "rotate": True, **settings},
        {"params": plain, "rotate": False, **settings},
    ]


class RotatedAdamW(torch.optim.Optimizer):
    """AdamW whose second moment lives in each weight matrix's estimated eigenbasis (see the
    module for the update and its memory).

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr: learning rate.
        betas: ``(β1, β2)``, AdamW's.
        eps: AdamW's.
        weight_decay: decoupled, as AdamW's.
        shampoo_beta: ``β_s``, the decay of the factors ``L`` and ``R`` (SOAP's 0.95).
        every: steps between eigendecompositions of the factors (SOAP's 10).
        max_dim: a side longer than this keeps the identity basis (an embedding's vocabulary).
        rotate: ``False`` steps a group's matrices by plain AdamW (see
            :func:`rotated_param_groups`).

    Example:
        >>> net = torch.nn.Linear(4, 3)
        >>> opt = RotatedAdamW(net.parameters(), lr=1e-3)
        >>> net(torch.randn(5, 4)).sum().backward(); opt.step()
        >>> sorted(opt.state[net.weight])  # the first gradient seeded the factors
        ['exp_avg', 'exp_avg_sq', 'left', 'q_left', 'q_right', 'right', 'started', 'step']
        >>> sorted(opt.state[net.bias])  # a vector: AdamW's state
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        shampoo_beta: float = 0.95,
        every: int = 10,
        max_dim: int = 2048,
        rotate: bool = True,
    ) -> None:
        if lr < 0 or weight_decay < 0 or eps < 0:
            raise ValueError(
                f"lr, weight_decay and eps must be >= 0, got {lr}, {weight_decay} and {eps}"
            )
        if not all(0.0 <= b < 1.0 for b in (*betas, shampoo_beta)):
            raise ValueError(
                f"betas and shampoo_beta must lie in [0, 1), got {betas} and {shampoo_beta}"
            )
        if not (isinstance(every, int) and every >= 1) or not (
            isinstance(max_dim, int) and max_dim >= 0
        ):
            raise ValueError(
                f"every must be a whole number >= 1 and max_dim one >= 0, got {every!r} and "
                f"{max_dim!r}"
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "shampoo_beta": shampoo_beta,
            "every": every,
            "max_dim": max_dim,
            "rotate": rotate,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        rotate = self.param_groups[-1]["rotate"]
        if not isinstance(rotate, bool):
            raise ValueError(
                f"a param group's rotate must be True or False, got {rotate!r}: pass "
                "rotated_param_groups(model), or groups that say rotate=True or rotate=False"
            )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return step_each(self, closure, self._step)

    def _step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        grad = p.grad
        assert grad is not None
        state = self.state[p]
        # a matrix keeps the kind of state it began with, should its group's flag change
        rotated = "q_left" in state if state else p.ndim >= 2 and group["rotate"]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if rotated:  # the second moment in the rotated basis, as a float32 matrix
                rows, cols = _as_matrix(p).shape
                state["started"] = min(rows, cols) > group["max_dim"]  # no factor to seed
                state["exp_avg_sq"] = p.new_zeros((rows, cols), dtype=_wide(p))
                for key, side in (("left", rows), ("right", cols)):
                    keep = side <= group["max_dim"]
                    state[key] = p.new_zeros((side, side) if keep else (0, 0), dtype=_wide(p))
                    eye = torch.eye(side, dtype=_wide(p), device=p.device)
                    # the identity until the first gradient seeds it (or if its eigh fails)
                    state["q_" + key] = eye if keep else state[key].clone()
            else:
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if rotated and not state["started"]:  # the first gradient only seeds the basis
            state["started"] = True
            self._update_basis(state, _as_matrix(grad).to(_wide(p)), group, 0)
            return
        state["step"] += 1
        t = int(state["step"])
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        if rotated:  # in the basis the earlier gradients gave
            raw = _as_matrix(grad).to(_wide(p))
            g = self._rotate(state, raw)
            m = self._rotate(state, _as_matrix(state["exp_avg"]).to(_wide(p)))
        else:
            g, m = grad, state["exp_avg"]
        v = state["exp_avg_sq"]
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        direction = m / denom / (1 - beta1**t)
        if rotated:
            direction = self._rotate(state, direction, back=True).view_as(p)
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(direction.to(p.dtype), alpha=-lr)
        if rotated:
            self._update_basis(state, raw, group, t)

    @staticmethod
    def _update_basis(
        state: dict[str, Any], g: torch.Tensor, group: dict[str, Any], t: int
    ) -> None:
        """After the step: fold ``G Gᵀ`` and ``Gᵀ G`` into the factors; re-derive the basis when
        it is due."""
        due = t <= group["every"] or t % group["every"] == 0
        for key, gram in (("left", lambda: g @ g.T), ("right", lambda: g.T @ g)):
            factor = state[key]
            if factor.numel() == 0:
                continue
            factor.lerp_(gram(), 1 - group["shampoo_beta"])
            if not due:
                continue
            try:
                values, vectors = torch.linalg.eigh(factor.double())
            except RuntimeError:  # no convergence on a degenerate factor: keep the old basis
                continue
            kept = _drop_unvisited(values, vectors, factor.dtype)
            # largest first: an entry of v stays with the rank of its eigenvalue, as in SOAP
            state["q_" + key] = kept.flip(-1).to(factor.dtype)

    @staticmethod
    def _rotate(state: dict[str, Any], x: torch.Tensor, back: bool = False) -> torch.Tensor:
        """``Q_Lᵀ x Q_R``, or ``Q_L x Q_Rᵀ`` with ``back`` (a side without a factor: identity)."""
        q_left, q_right = state["q_left"], state["q_right"]
        if q_left.numel():
            x = (q_left @ x) if back else (q_left.T @ x)
        if q_right.numel():
            x = (x @ q_right.T) if back else (x @ q_right)
        return x
