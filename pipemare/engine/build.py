"""A pipeline's parts, built from its arguments: argument checks, the transport, the balance,
the stages, gradient clipping and the replicas' gradient averaging."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipemare.engine.clip import DistributedNormBoard, GradClip, NormBoard, global_norm_lag
from pipemare.engine.replicas import GradientAverager, broadcast_state
from pipemare.engine.stage import Stage
from pipemare.engine.transport import DistributedTransport, InProcessTransport, Transport
from pipemare.model import partition
from pipemare.model.cuts import BALANCES
from pipemare.optim.optimizer import PipeMareOptimizer
from pipemare.optim.settings import RunSettings
from pipemare.schedule.actions import ScheduleSpec, spec

__all__ = [
    "check_arguments",
    "choose_balance",
    "default_device",
    "make_clip",
    "make_stages",
    "make_transport",
    "replica_averager",
]


def check_arguments(
    *,
    schedule: str,
    stages: Any,
    microbatches: Any,
    balance: Any,
    recompute: Any,
    compile: Any = False,
) -> ScheduleSpec:
    """Refuse a bad value of an argument the Pipeline and the strategy share, up front.

    Both call this one check, so one mistake gets one error in either: a ``ValueError`` for a
    value the argument cannot take, its kind included (``microbatches=2.5``,
    ``recompute="yes"``). ``TypeError`` is kept for an object of the wrong class (a model that
    is not an ``nn.Sequential``, a config that is not a ``PipeMareConfig``).

    Args:
        schedule: a name from :data:`~pipemare.schedule.actions.SCHEDULES`.
        stages: P, or None for the default.
        microbatches: N.
        balance: a name from :data:`~pipemare.model.cuts.BALANCES`, a list of layer counts,
            or None for the default.
        recompute: whether stages rerun their forward at backward time.
        compile: whether (True, or a dict of ``torch.compile``'s options) each stage's
            layers are compiled.

    Returns:
        What ``schedule`` means.

    Raises:
        ValueError: an unknown schedule or balance name, or a value out of range.
    """
    sp = spec(schedule)  # a clear error for an unknown name, with a did-you-mean
    if stages is not None and (
        isinstance(stages, bool) or not isinstance(stages, int) or stages < 1
    ):
        raise ValueError(f"stages must be a positive integer (a whole number >= 1), got {stages!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    counts = isinstance(balance, (list, tuple)) and all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in balance
    )
    named = isinstance(balance, str) and balance in BALANCES
    if balance is not None and not named and not (counts and len(balance) > 0):
        raise ValueError(
            f"balance must be one of {', '.join(BALANCES)} or a list of layer counts (a "
            f"whole number >= 1 per stage, e.g. [3, 2]), got {balance!r}"
        )
    if not isinstance(recompute, bool):
        raise ValueError(
            f"recompute must be True or False, got {recompute!r}; True keeps only each "
            "stage's inputs and reruns its forward at backward time"
        )
    compile_options(compile)
    return sp


#: what ``compile`` may set of ``torch.compile``'s keyword arguments
COMPILE_OPTIONS = ("backend", "mode", "dynamic", "fullgraph", "options")


def compile_options(value: Any) -> dict[str, Any] | None:
    """``torch.compile``'s keyword arguments for each stage from a ``compile`` argument: None
    for False, ``{}`` (its defaults: inductor) for True, the dict's own for a dict.

    Example:
        >>> compile_options(False), compile_options(True), compile_options({"backend": "eager"})
        (None, {}, {'backend': 'eager'})
    """
    if isinstance(value, bool):
        return {} if value else None
    if isinstance(value, Mapping) and all(k in COMPILE_OPTIONS for k in value):
        return dict(value)
    unknown = sorted(set(value) - set(COMPILE_OPTIONS)) if isinstance(value, Mapping) else None
    raise ValueError(
        f"compile must be True, False or a dict of torch.compile's options "
        f"({', '.join(COMPILE_OPTIONS)}), got {value!r}"
        + (f": {', '.join(map(repr, unknown))} is not one of them" if unknown else "")
    )


def default_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """``device``, or where the model is (CPU for a model without parameters)."""
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    return torch.device(device)


def make_transport(
    transport: str | Transport,
    stages: int | None,
    layers: int,
    device: torch.device,
    microbatches: int,
) -> Transport:
    """The transport ``transport`` names (or is), checked against ``stages``."""
    if isinstance(transport, str):
        transport = _named_transport(transport, stages, layers, device)
    if stages is not None and stages != transport.num_stages:
        raise ValueError(
            f"stages={stages} but the transport connects {transport.num_stages} stages"
        )
    if isinstance(transport, DistributedTransport):  # its errors name steps
        transport.watchdog.microbatches = microbatches
    return transport


def _named_transport(name: str, stages: int | None, layers: int, device: torch.device) -> Transport:
    if name == "inprocess":
        return InProcessTransport(stages if stages is not None else layers)
    if name == "distributed":
        return DistributedTransport(stages, device)
    raise ValueError(f"transport must be 'inprocess', 'distributed' or a Transport, got {name!r}")


def choose_balance(
    model: nn.Sequential, balance: Sequence[int] | str | None, stages: int
) -> list[int]:
    """Layers per stage: a list as given, ``"even"`` (the default, None) or by ``"params"``;
    the names chosen from a sample batch (:data:`~pipemare.model.cuts.FROM_A_SAMPLE`) are
    refused: a bare Pipeline has no batch to measure before it is built."""
    if balance is None or balance == "even":
        return partition.even_balance(len(model), stages)
    if balance == "params":
        return partition.balance_by_params(model, stages)
    if isinstance(balance, str):
        raise ValueError(
            f"balance={balance!r} is chosen from a sample batch, which a Pipeline does not have "
            "when it is built (the strategy measures its first batch); pass the counts instead, "
            "e.g. balance=pipemare.model.partition.balance_by_time(model, sample, stages), or "
            "'even' or 'params'"
        )
    if len(balance) != stages:
        raise ValueError(f"balance {list(balance)} has {len(balance)} entries for {stages} stages")
    return list(balance)


def make_stages(
    modules: Sequence[nn.Module],
    local: Sequence[int],
    sp: ScheduleSpec,
    optimizer: PipeMareOptimizer,
    *,
    predicts: bool,
    forward_context: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    microbatches: int,
    seed: int | None,
    recompute: bool,
    compile: dict[str, Any] | None = None,
    measure_saved: bool | None = None,
) -> list[Stage]:
    """The ``local`` stages of ``modules``, each with a random stream of its own, seeded from
    ``seed`` (default: ``torch.initial_seed()``). The last stage never recomputes. With
    ``compile`` (``torch.compile``'s options) each stage's layers are compiled."""
    base_seed = torch.initial_seed() if seed is None else seed
    return [
        Stage(
            i,
            modules[i],
            stashes=sp.stashes,
            track=not sp.flushes,
            backward_weight=optimizer.backward_weight if optimizer.moves_backward_weights else None,
            forward_context=forward_context,
            forward_weights=optimizer.forward_weights if predicts else None,
            microbatches=microbatches,
            seed=(base_seed + 7919 * (i + 1)) % 2**63,
            recompute=recompute and i < len(modules) - 1,
            compile=compile,
            measure_saved=measure_saved,
        )
        for i in local
    ]


def make_clip(
    norm: float | None,
    value: float | None,
    flushes: bool,
    transport: Transport,
    device: torch.device,
    microbatches: int,
) -> GradClip | None:
    """Clipping by the global norm over all stages or by value; None for neither.

    ``norm=math.inf`` exchanges every stage's norm and clips nothing by itself: clipping
    asked for at each update (a LightningModule's ``configure_gradient_clipping``) then has
    the global norm at hand.
    """
    if norm is not None and value is not None:
        raise ValueError("choose one of clip_grad_norm and clip_grad_value, not both")
    if norm is None and value is None:
        return None
    if value is not None:
        return GradClip("value", value, None, 0)
    board: NormBoard
    if isinstance(transport, DistributedTransport):
        board = DistributedNormBoard(transport.collective_group, device)
    else:
        board = NormBoard(transport.num_stages)
    lag = global_norm_lag(transport.num_stages, microbatches, flushes)
    return GradClip("norm", float(norm), board, lag)  # type: ignore[arg-type]


def replica_averager(
    transport: DistributedTransport, modules: Sequence[nn.Module]
) -> GradientAverager:
    """D copies of the pipeline: start every replica from copy 0's weights, and average the
    replicas' gradients before each update (:mod:`pipemare.engine.replicas`)."""
    (me,) = transport.local_stages
    group, ranks = transport.replica_group, transport.replica_ranks
    broadcast_state(modules[me], group, src=ranks[0])
    peer = ranks[1] if ranks[0] == dist.get_rank() else ranks[0]
    watchdog = transport.watchdog
    return GradientAverager(
        group, transport.replicas, wait=lambda work, what: watchdog.wait(work, peer, what)
    )


def check_settings(
    settings: RunSettings, schedule: str, stages: int, microbatches: int, balance: Sequence[int]
) -> None:
    """Refuse settings decided for another layout than the pipeline's."""
    built = (schedule, stages, microbatches, tuple(balance))
    decided = (settings.schedule, settings.stages, settings.microbatches, settings.balance)
    if decided != built:
        raise ValueError(
            f"the run's settings were decided for (schedule, P, N, cut) = {decided}, but the "
            f"pipeline is built as {built}"
        )
