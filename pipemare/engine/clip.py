"""Gradient clipping across stages, by value or by the global norm of all stages' gradients.

A stage's update must know every stage's gradient norm. With a flushing schedule every stage
reaches update ``k`` in the same pipeline flush, so the norm is exact at no cost. In a
non-flushing pipeline, waiting for the other stages' current norms would re-create the flush;
instead a stage combines its own current norm with the others' norms of update ``k - lag``,
which the schedule guarantees have been computed by then (``lag = ceil((P-1)/N) + 1``: stage
``j`` runs update ``k - ceil(P/N)`` before its activations reach any later stage's update
``k``). The first ``lag`` updates have no such past and use the stage's own norm. Nothing ever
waits across minibatches, and the rule is deterministic, so the simulator and one process
per stage clip alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["DistributedNormBoard", "GradClip", "NormBoard", "global_norm_lag"]


def global_norm_lag(stages: int, microbatches: int, flushes: bool) -> int:
    """Updates between a stage's own gradient norm and the other stages' norms it combines."""
    return 0 if flushes else math.ceil((stages - 1) / microbatches) + 1


class NormBoard:
    """Where the stages of one process post squared gradient norms and read their sum."""

    def __init__(self, stages: int) -> None:
        self.stages = stages
        self._posts: dict[int, dict[int, float]] = {}
        self._reads: dict[int, int] = {}

    def post(self, stage: int, update: int, sq: float) -> None:
        self._posts.setdefault(update, {})[stage] = sq

    def ready(self, update: int) -> bool:
        return len(self._posts.get(update, ())) == self.stages

    def total(self, update: int) -> float:
        """Sum of every stage's squared norm for ``update``; freed once each stage read it."""
        value = sum(self._posts[update].values())
        self._reads[update] = self._reads.get(update, 0) + 1
        if self._reads[update] == self.stages:
            del self._posts[update], self._reads[update]
        return value


class DistributedNormBoard(NormBoard):
    """The same over processes: one asynchronous all-reduce per update, in update order."""

    def __init__(self, group: object, device: torch.device) -> None:
        super().__init__(stages=1)
        self._group, self._device = group, device
        self._pending: dict[int, tuple[object, torch.Tensor]] = {}

    def post(self, stage: int, update: int, sq: float) -> None:
        import torch.distributed as dist

        t = torch.tensor([sq], dtype=torch.float64, device=self._device)
        self._pending[update] = (dist.all_reduce(t, group=self._group, async_op=True), t)

    def ready(self, update: int) -> bool:
        return True  # total() blocks until every process has posted

    def total(self, update: int) -> float:
        work, t = self._pending.pop(update)
        work.wait()  # type: ignore[attr-defined]
        return float(t.item())


class GradClip:
    """Clips a stage's accumulated gradients right before its update.

    Args:
        algorithm: ``"norm"`` (global L2 norm over all stages) or ``"value"`` (elementwise).
        value: the clipping threshold.
        board: where stages exchange squared norms (``norm`` only).
        lag: see :func:`global_norm_lag`.
    """

    def __init__(self, algorithm: str, value: float, board: NormBoard | None, lag: int) -> None:
        if algorithm not in ("norm", "value"):
            raise ValueError(
                f"gradient clipping algorithm must be 'norm' or 'value', got {algorithm!r}"
            )
        if value <= 0:
            raise ValueError(f"the gradient clipping value must be positive, got {value}")
        if algorithm == "norm" and board is None:
            raise ValueError("clipping by norm needs a board to exchange norms on")
        self.algorithm, self.value, self.board, self.lag = algorithm, float(value), board, lag
        self._own: dict[tuple[int, int], float] = {}  # (stage, update) -> own squared norm
        self.last_norm: dict[int, float] = {}  # stage -> global norm used at its last update
        self._norms: dict[tuple[int, int], float] = {}  # read from the board, not settled yet

    @staticmethod
    def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        return [p.grad for p in params if p.grad is not None]

    def post(self, stage: int, update: int, params: Iterable[nn.Parameter]) -> None:
        """Publish this stage's squared gradient norm for ``update`` (now complete)."""
        if self.algorithm != "norm" or (stage, update) in self._own:
            return
        grads = self._grads(params)
        sq = float(sum(float(g.detach().float().pow(2).sum()) for g in grads))
        self._own[stage, update] = sq
        assert self.board is not None
        self.board.post(stage, update, sq)

    def ready(self, stage: int, update: int) -> bool:
        """Whether ``stage`` can clip ``update`` now (a distributed board always answers True,
        and so does a norm already read for it)."""
        if self.algorithm != "norm" or (stage, update) in self._norms:
            return True
        assert self.board is not None
        if self.lag == 0:
            return self.board.ready(update)
        return update < self.lag or self.board.ready(update - self.lag)

    def global_norm(self, stage: int, update: int) -> float:
        """The norm ``stage`` clips ``update`` against (see the module); read from the board
        once, then kept until :meth:`settle`."""
        have = self._norms.get((stage, update))
        if have is not None:
            return have
        assert self.board is not None
        own = self._own[stage, update]
        if self.lag == 0:
            total = self.board.total(update)
        elif update < self.lag:
            total = own
        else:
            past = update - self.lag
            total = self.board.total(past) - self._own.pop((stage, past)) + own
        norm = math.sqrt(max(total, 0.0))
        self._norms[stage, update] = norm
        self.last_norm[stage] = norm
        return norm

    @torch.no_grad()
    def apply(
        self,
        stage: int,
        update: int,
        params: Iterable[nn.Parameter],
        algorithm: str | None = None,
        value: float | None = None,
    ) -> None:
        """Clip ``stage``'s gradients for ``update`` in place, by this clip's algorithm and
        threshold or by those given. Without them this is the update's clipping and settles it;
        with them (a LightningModule's ``configure_gradient_clipping``, possibly several calls)
        the caller settles the update after the last call."""
        own_rule = algorithm is None and value is None
        algorithm = algorithm or self.algorithm
        value = self.value if value is None else float(value)
        grads = self._grads(params)
        if algorithm == "value":
            for g in grads:
                g.clamp_(-value, value)
        else:
            if self.algorithm != "norm":
                raise ValueError(
                    "clipping by norm needs every stage's gradient norm, and this clip "
                    "exchanges none (it was built to clip by value)"
                )
            coef = value / (self.global_norm(stage, update) + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        if own_rule:
            self.settle(stage, update)

    def settle(self, stage: int, update: int) -> None:
        """``stage`` is done with ``update``: its share of the board is read (clipped or not),
        so the other stages' norms it will combine later and the board's memory stay right."""
        if self.algorithm != "norm":
            return
        self.global_norm(stage, update)
        del self._norms[stage, update]
        if self.lag == 0:
            del self._own[stage, update]  # otherwise kept until update + lag
