"""Recording ``self.log`` calls made per microbatch, and replaying them once per step on every rank.

The user's step runs once per microbatch on the last stage. Lightning must see one value per
step, identical on every rank (loggers write from rank 0, and ModelCheckpoint, EarlyStopping
and LR schedulers decide from ``callback_metrics`` everywhere). So the calls are recorded,
combined over the microbatches (weighted by their size: the mean of a per-sample mean over the
minibatch is the minibatch's value; ``reduce_fx="sum"``, ``"max"`` and ``"min"`` combine
accordingly), sent to every rank, and replayed through the real ``LightningModule.log``.

torchmetrics objects are replayed as themselves: their state lives on the last stage only, and
their ``compute()`` at epoch end syncs it over the processes as it would under DDP (the other
ranks contribute empty states). Only the step value (``_forward_cache``) and the update count
are copied across.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["LogRecorder", "Record", "merge_records"]


def _is_metric(value: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    return isinstance(value, Metric)


def _reduce_name(kwargs: dict[str, Any]) -> str:
    fx = kwargs.get("reduce_fx", "mean")
    name = fx if isinstance(fx, str) else getattr(fx, "__name__", "mean")
    return {"avg": "mean", "amax": "max", "amin": "min"}.get(name, name)


@dataclasses.dataclass
class Record:
    """One logged name, combined over a step's microbatches."""

    name: str
    kwargs: dict[str, Any]
    value: float | None = None  # plain values
    weight: float = 0.0
    metric: str | None = None  # torchmetrics: the metric's attribute path in the module
    forward_cache: torch.Tensor | None = None
    update_count: int = 0

    def add(self, value: float, weight: float) -> None:
        fx = _reduce_name(self.kwargs)
        if self.value is None:
            self.value = value * weight if fx == "mean" else value
        elif fx == "mean":
            self.value += value * weight
        elif fx == "sum":
            self.value += value
        elif fx == "max":
            self.value = max(self.value, value)
        elif fx == "min":
            self.value = min(self.value, value)
        else:
            raise ValueError(
                f"self.log({self.name!r}, reduce_fx={self.kwargs.get('reduce_fx')!r}) cannot be "
                "combined over microbatches; use 'mean', 'sum', 'max' or 'min'"
            )
        self.weight += weight

    def result(self) -> float:
        assert self.value is not None
        return self.value / self.weight if _reduce_name(self.kwargs) == "mean" else self.value


def merge_records(parts: list[list[Record]]) -> list[Record]:
    """One step's records from each copy of the pipeline (D data-parallel copies), combined
    as the microbatches are: the mean over copies of equal share (each copy's weights sum to
    one), the sum, the max or the min. A torchmetrics record keeps copy 0's step value; its
    state stays with each copy's last stage and ``compute()`` syncs all of them at epoch end.
    """
    merged: dict[str, Record] = {}
    for records in parts:
        for r in records:
            have = merged.get(r.name)
            if have is None:
                merged[r.name] = dataclasses.replace(r, kwargs=dict(r.kwargs))
            elif r.metric is not None:
                have.update_count = max(have.update_count, r.update_count)
            elif r.value is not None:
                fx = _reduce_name(r.kwargs)
                if have.value is None:
                    have.value, have.weight = r.value, r.weight
                elif fx in ("mean", "sum"):
                    have.value += r.value
                    have.weight += r.weight
                else:
                    pick = max if fx == "max" else min
                    have.value = pick(have.value, r.value)
    return list(merged.values())


class LogRecorder:
    """Stands in for ``LightningModule.log`` while the user's steps run, then replays."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.records: dict[str, Record] = {}
        self._weight = 1.0
        self._batch_size: int | None = None
        self._metric_paths = {id(m): n for n, m in module.named_modules() if _is_metric(m)}

    def recording(self, weight: float, batch_size: int | None = None) -> Callable[..., None]:
        """A ``log`` replacement for one microbatch carrying ``weight`` of the minibatch.

        ``batch_size`` (the minibatch's) is given to the replayed ``log`` unless the user
        passed one: a record is replayed during a later step, whose batch may differ in size
        (e.g. a validation loader's last batch), and Lightning weights epoch means by it.
        """
        self._weight, self._batch_size = weight, batch_size
        return self._log

    def _log(self, name: str, value: Any, **kwargs: Any) -> None:
        kwargs.pop("sync_dist_group", None)  # a process group does not travel between ranks
        if self._batch_size is not None and kwargs.get("batch_size") is None:
            kwargs["batch_size"] = self._batch_size
        record = self.records.setdefault(name, Record(name, kwargs))
        if _is_metric(value):
            path = self._metric_paths.get(id(value))
            if path is None:
                raise ValueError(
                    f"self.log({name!r}, metric) needs the torchmetrics object to be an attribute "
                    "of the LightningModule so every rank can find it"
                )
            record.metric = path
            cache = getattr(value, "_forward_cache", None)
            record.forward_cache = cache.detach().cpu() if isinstance(cache, torch.Tensor) else None
            record.update_count = int(getattr(value, "_update_count", 0))
            return
        if isinstance(value, torch.Tensor):
            value = value.detach().float().item()
        record.add(float(value), self._weight)

    def take(self) -> list[Record]:
        """The combined records of this step (and forget them)."""
        records, self.records = list(self.records.values()), {}
        return records

    def replay(self, records: list[Record], log: Callable[..., None], device: torch.device) -> None:
        """Call the real ``log`` once per record, identically on every rank."""
        for r in records:
            if r.metric is not None:
                metric: Any = self.module.get_submodule(r.metric)
                if r.forward_cache is not None:
                    metric._forward_cache = r.forward_cache.to(device)
                # The state stays on the last stage; its update count tells compute() on the
                # other ranks that syncing (not updating locally) is expected here.
                metric._update_count = max(int(metric._update_count), r.update_count)
                log(r.name, metric, **r.kwargs)
            else:
                log(r.name, torch.tensor(r.result(), device=device), **r.kwargs)
