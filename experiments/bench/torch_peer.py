"""Baseline throughput of torch's own ``torch.distributed.pipelining`` schedules on one rank.

Called on every rank of an initialised process group (gloo on CPU), it builds this rank's
stage(s) by hand from an ``nn.Sequential``, trains for a few steps with one of torch's
schedules and returns what this rank measured: wall time, compute time, p2p time and memory.
It is the torch baseline of a throughput comparison; pipemare's own half is measured elsewhere.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining import schedules as _torch_schedules

from pipemare.experiments.bench.memory import optimizer_bytes, tensor_bytes

TORCH_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")

# name -> (schedule class, virtual stages held by each rank)
_SCHEDULES: dict[str, tuple[type, int]] = {
    "GPipe": (ScheduleGPipe, 1),
    "1F1B": (Schedule1F1B, 1),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2),
}

# Longest a p2p wait may block during the first step before we call a peer lost; generous,
# since a rank's first receive waits for its predecessors' one-off shape inference too.
_FIRST_STEP_TIMEOUT = timedelta(seconds=300)

# The stage methods that do this rank's compute. None of them waits on communication in
# torch 2.13: receives are waited on by the schedule before it calls them, and they only read
# the already-filled receive buffers.
_STAGE_COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class _Clock:
    """Seconds spent inside wrapped callables while the clock is running."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.running = False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.running:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


class _SavedBytes:
    """Live and peak bytes of the tensors autograd keeps for backward.

    The pack hook hands autograd a holder instead of the tensor; the holder lives exactly as
    long as autograd keeps the saved value (it is dropped when the node runs without
    ``retain_graph`` or when the graph is freed), so its ``__del__`` marks the release.
    Storages are counted once however many holders share them (GELU and the next Linear save
    the same activation), and storages of this rank's parameters are skipped: a Linear saves a
    view of its weight, which is not activation memory.
    """

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.holders_per_storage: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.param_storages or storage.nbytes() == 0:
            return tensor
        count = self.holders_per_storage.get(key, 0)
        if count == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.holders_per_storage[key] = count + 1
        # Keep a detached alias: same storage and version counter, but no grad_fn. Autograd
        # hands pack hooks the tensor with its graph attached, and for an op that saves its
        # own output (log_softmax) holding that tensor makes node -> holder -> tensor -> node,
        # a cycle through C++ the garbage collector cannot see. Ordinary backward breaks it by
        # releasing saved values, but the zero-bubble input pass runs with retain_graph=True
        # and its weight pass never revisits those nodes, so they would leak every step.
        # The alias also keeps the storage (and so this key's address) alive until release.
        return _Holder(tensor.detach(), self, key, storage.nbytes())

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Holder) else packed

    def release(self, key: int, nbytes: int) -> None:
        count = self.holders_per_storage.pop(key) - 1
        if count:
            self.holders_per_storage[key] = count
        else:
            self.live -= nbytes

    @contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


class _Holder:
    """What autograd stores in place of a saved tensor; hands its bytes back when dropped."""

    __slots__ = ("key", "nbytes", "tensor", "tracker")

    def __init__(self, tensor: torch.Tensor, tracker: _SavedBytes, key: int, nbytes: int) -> None:
        self.tensor, self.tracker, self.key, self.nbytes = tensor, tracker, key, nbytes

    def __del__(self) -> None:
        self.tracker.release(self.key, self.nbytes)


def _check_arguments(
    schedule: str, balance: list[int], model: nn.Sequential, batch: int, microbatches: int
) -> int:
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {TORCH_SCHEDULES}, got {schedule!r}")
    stages_per_rank = _SCHEDULES[schedule][1]
    world = dist.get_world_size()
    if len(balance) != stages_per_rank * world:
        raise ValueError(
            f"{schedule} on {world} ranks needs {stages_per_rank * world} pieces in balance, "
            f"got {len(balance)}"
        )
    if min(balance) < 1 or sum(balance) != len(model):
        raise ValueError(
            f"balance {balance} must be positive and sum to the model's {len(model)} layers"
        )
    if microbatches < 1 or batch % microbatches:
        # Equal microbatches keep the mean of per-microbatch mean losses equal to the batch mean.
        raise ValueError(f"batch of {batch} rows does not split into {microbatches} microbatches")
    return stages_per_rank


def _pieces(model: nn.Sequential, balance: list[int]) -> list[nn.Sequential]:
    bounds = [0, *itertools.accumulate(balance)]
    layers = list(model)
    return [nn.Sequential(*layers[lo:hi]) for lo, hi in itertools.pairwise(bounds)]


def _build_stages(
    model: nn.Sequential, balance: list[int], stages_per_rank: int, device: torch.device
) -> list[PipelineStage]:
    """This rank's stages: pieces ``rank``, ``rank + P``, ... (torch's looped placement)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces = _pieces(model, balance)
    stages = []
    for local in range(stages_per_rank):
        index = rank + local * world
        # A private copy, so training here never touches the caller's model.
        submodule = copy.deepcopy(pieces[index]).to(device)
        stages.append(PipelineStage(submodule, index, len(pieces), device))
    return stages


def _build_schedule(name: str, stages: list[PipelineStage], microbatches: int) -> Any:
    cls, stages_per_rank = _SCHEDULES[name]
    loss_fn = nn.functional.cross_entropy
    # scale_grads=True divides the summed per-microbatch gradients by the number of
    # microbatches; with a mean loss per (equal-sized) microbatch that is exactly the gradient
    # of the whole batch's mean loss. It is torch's default; we spell it out on purpose.
    first = stages[0] if stages_per_rank == 1 else stages
    return cls(first, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


def _time_compute(stages: list[PipelineStage], schedule: Any, clock: _Clock) -> None:
    # Instance attributes shadow the class methods the schedule calls. The loss is computed by
    # the schedule, not the stage, so its forward is wrapped there; its backward already runs
    # inside backward_one_chunk.
    for stage in stages:
        for name in _STAGE_COMPUTE:
            setattr(stage, name, clock.wrap(getattr(stage, name)))
    schedule._compute_loss = clock.wrap(schedule._compute_loss)


class _P2PWatch:
    """Times the schedules' point-to-point traffic and can bound how long a wait may block.

    All of torch 2.13's schedules post their sends and receives through the module-level
    ``_batch_p2p`` (directly or via ``_sorted_batch_p2p``) and block only in
    ``_wait_batch_p2p``; both are looked up as module globals at call time, so swapping them
    for the duration of the run sees every p2p a step does. Posting is counted too: on gloo it
    only hands buffers to gloo's threads, but it is communication, not compute.
    """

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.timeout: timedelta | None = None

    def wait(self, works: list[dist.Work]) -> None:
        for work in works:
            if self.timeout is None:
                work.wait()
                continue
            try:
                work.wait(self.timeout)
            except RuntimeError as err:
                # gloo reports both a timeout and a peer that has gone away this way.
                raise RuntimeError(
                    "lost a peer in the first step (it failed, or sent nothing within "
                    f"{self.timeout.total_seconds():.0f} s): {_first_line(err)}"
                ) from err

    @contextmanager
    def installed(self) -> Iterator[None]:
        saved = _torch_schedules._batch_p2p, _torch_schedules._wait_batch_p2p
        _torch_schedules._batch_p2p = self.clock.wrap(saved[0])
        _torch_schedules._wait_batch_p2p = self.clock.wrap(self.wait)
        try:
            yield
        finally:
            _torch_schedules._batch_p2p, _torch_schedules._wait_batch_p2p = saved


def _sync(device: torch.device) -> None:
    # CPU kernels finish before they return; an accelerator's queue must drain before a
    # timestamp means anything.
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _step(
    schedule: Any,
    stages: list[PipelineStage],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    optimizer: torch.optim.Optimizer,
) -> torch.Tensor | None:
    """One optimiser step; returns the batch's mean loss on the rank holding the last stage."""
    args = (inputs,) if any(s.is_first for s in stages) else ()
    losses: list[torch.Tensor] = []
    if any(s.is_last for s in stages):
        schedule.step(*args, target=targets, losses=losses, return_outputs=False)
    else:
        schedule.step(*args, return_outputs=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack([loss.detach() for loss in losses]).mean() if losses else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _first_step(name: str, run: Callable[[], Any], p2p: _P2PWatch) -> Any:
    """Run the very first step, turning any failure of the schedule into a clear refusal.

    A rank that fails mid-step leaves its neighbours blocked on receives that never come, for
    the process group's whole timeout (30 min by default). During this step the waits are
    bounded instead, so the neighbours fail too; a gloo wait that times out also closes its
    connection, which in turn wakes whoever waits on the other end. The one-off shape
    exchange torch does inside this step uses blocking send/recv that only the process
    group's own timeout bounds.
    """
    p2p.timeout = _FIRST_STEP_TIMEOUT
    try:
        return run()
    except Exception as err:
        reason = _first_line(err)
        raise RuntimeError(f"unsupported: {name} on {dist.get_backend()}: {reason}") from err
    finally:
        p2p.timeout = None


def torch_pipeline_run(
    schedule: str,
    model: nn.Sequential,
    balance: list[int],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    microbatches: int,
    steps: int,
    warmup: int,
    lr: float = 1e-4,
    device: torch.device | str = "cpu",
) -> dict:
    """Train with one of torch's pipelining schedules and measure this rank.

    Call on every rank of an initialised default process group; ranks are pipeline ranks.
    Each rank copies its pieces of ``model`` (the caller's model is left untouched), wraps
    them in ``PipelineStage``s and runs ``warmup`` untimed then ``steps`` timed optimiser
    steps of SGD (momentum 0.9) on the mean cross-entropy of the whole batch.

    Args:
        schedule: One of ``TORCH_SCHEDULES``.
        model: The whole model, identical on every rank.
        balance: Layers per piece; ``P`` pieces for GPipe/1F1B, ``2P`` for the interleaved
            schedules, where rank ``r`` holds pieces ``r`` and ``r + P``.
        inputs: The minibatch input, the same on every rank.
        targets: Class indices, the same on every rank.
        microbatches: Microbatches per step; must divide the batch.
        steps: Timed optimiser steps.
        warmup: Untimed steps before them (at least 1 keeps torch's one-off shape inference
            out of the timed window).
        lr: Learning rate.
        device: Device of this rank's stages.

    Returns:
        A JSON-serialisable dict for this rank: ``rank``, ``schedule``, ``stages_per_rank``,
        ``wall_s``, ``step_s``, ``samples_per_s``, ``busy_s``, ``utilisation``, ``comm_s``,
        ``weights_bytes``, ``optimizer_bytes``, ``activation_peak_bytes`` and ``losses`` (the
        batch loss of every step, warmup first, on the rank holding the last stage; empty
        elsewhere). The pipeline's own step time is the largest ``wall_s`` over ranks.

    Raises:
        ValueError: If the schedule name, balance or microbatch count does not fit.
        RuntimeError: ``"unsupported: ..."`` if the schedule fails on its first step here.

    Example:
        >>> # On each of 2 ranks, after dist.init_process_group("gloo"):
        >>> # torch_pipeline_run("1F1B", mlp, [9, 8], x, y, microbatches=4, steps=5, warmup=2)
    """
    device = torch.device(device)
    stages_per_rank = _check_arguments(schedule, balance, model, len(inputs), microbatches)
    stages = _build_stages(model, balance, stages_per_rank, device)
    pipe = _build_schedule(schedule, stages, microbatches)
    params = [p for s in stages for p in s.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
    inputs, targets = inputs.to(device), targets.to(device)

    busy, comm, saved = _Clock(), _Clock(), _SavedBytes(params)
    p2p = _P2PWatch(comm)
    _time_compute(stages, pipe, busy)

    def run() -> torch.Tensor | None:
        return _step(pipe, stages, inputs, targets, optimizer)

    losses = []
    with p2p.installed():
        for k in range(warmup):
            losses.append(_first_step(schedule, run, p2p) if k == 0 else run())
        # Barriers fence the window but are not in it: the clocks start after the opening
        # barrier returns and stop before the closing one, so a rank's wall_s ends when its own
        # last step does, and barriers never reach the busy/comm clocks (they are collectives,
        # not schedule p2p).
        dist.barrier()
        _sync(device)
        busy.running = comm.running = True
        saved.reset_peak()
        start = time.perf_counter()
        with saved.hooks():
            for k in range(steps):
                losses.append(_first_step(schedule, run, p2p) if warmup == k == 0 else run())
        _sync(device)
        wall = time.perf_counter() - start
        busy.running = comm.running = False
        dist.barrier()

    step_s = wall / max(steps, 1)
    return {
        "rank": dist.get_rank(),
        "schedule": schedule,
        "stages_per_rank": stages_per_rank,
        "wall_s": wall,
        "step_s": step_s,
        "samples_per_s": len(inputs) / step_s if step_s > 0 else 0.0,
        "busy_s": busy.seconds,
        "utilisation": busy.seconds / wall if wall > 0 else 0.0,
        "comm_s": comm.seconds,
        "weights_bytes": tensor_bytes(params),
        "optimizer_bytes": optimizer_bytes(optimizer, params),
        "activation_peak_bytes": saved.peak,
        "losses": [float(loss) for loss in losses if loss is not None],
    }
