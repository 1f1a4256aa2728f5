"""pipemare's part of a Lightning checkpoint: what it holds, how it is gathered, when it is written.

A checkpoint is one ordinary Lightning checkpoint with the whole model. Each process holds its
own stages' weights, optimiser state, pipemare's correction buffers and random streams; saving
gathers them into the whole model's state on rank 0 (or on every rank, to give each process
the whole model back after a run), in the keys a plain module expects. pipemare's own state
goes with the user's optimiser state under the key ``"pipemare"``: ``"optimizer"`` (the
corrections' buffers and step count), ``"pipeline"`` (the stages' random streams) and
``"layout"`` (:func:`layout`: the cut, the schedule, N and the corrections, with their
``"described"`` settings). Loading needs no scattering: every process reads the whole
checkpoint and keeps its part.

During training the state is taken without draining the pipeline: draining there would make
every later step depend on how often the run checkpoints. Lightning asks for the model's and
the optimiser's state (``dump_checkpoint``) and hands the dict to ``save_checkpoint``; the
:class:`SaveQueue` answers with a :class:`~pipemare.engine.snapshot.Snapshot` of the step's
minibatch: each stage's state is copied as that stage reaches the point a drain would have left
it at, and the file is written, in order with the saves and removals queued before and after
it, once every stage has passed that point: :func:`~pipemare.engine.lagged.snapshot_lag` steps
later (with one process per stage, every process writes at that same step, since collecting
the stages' parts is a collective), or at the next drain (validation, the end of training).

So a checkpoint of step ``t`` holds exactly what a run that drained after step ``t`` holds,
its file appears ``L`` steps later, and a removal Lightning asks for after it (top-k
rotation) waits for it: the previous checkpoint is never gone before the new one is whole.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipemare.engine.lagged import snapshot_lag
from pipemare.engine.pipeline import Pipeline
from pipemare.engine.snapshot import Snapshot
from pipemare.engine.transport import DistributedTransport
from pipemare.lightning.shards import FORMAT, pack, read_local
from pipemare.lines import text
from pipemare.model.materialize import materialize, whole_state_collected
from pipemare.optim.chain import ChainedOptimizer

__all__ = [
    "Checkpoints",
    "Deferred",
    "SaveQueue",
    "StateNames",
    "consolidate",
    "layout",
    "load_optimizer_states",
    "load_pipemare_state",
    "module_state",
    "optimizer_state",
    "trained_layout",
    "warn_layout_changes",
    "warn_run_changes",
]

#: a stage module's state-dict key -> the LightningModule's own key for it
StateNames = Callable[[str], str]


def _gather(local: Any, all_ranks: bool) -> list[Any]:
    """Every process's ``local``, on every process or on rank 0 only (elsewhere an empty list)."""
    parts: list[Any] = [None] * dist.get_world_size()
    if all_ranks:
        dist.all_gather_object(parts, local)
        return parts
    rank = dist.get_rank()
    dist.gather_object(local, parts if rank == 0 else None, dst=0)
    return parts if rank == 0 else []


def module_state(
    module: nn.Module,
    pipe: Pipeline,
    names: StateNames,
    all_ranks: bool = False,
    snapshot: Snapshot | None = None,
) -> dict[str, Any]:
    """The whole module's state dict, gathered from the stages' processes (CPU tensors).

    Args:
        module: the LightningModule, part of which is cut into the pipeline's stages.
        pipe: this process's pipeline.
        names: a stage module's state-dict key -> the module's own key for it.
        all_ranks: gather on every rank (else rank 0 only; other ranks get ``{}``).
        snapshot: take the stages' state from it (default: the stages as they are now).
    """
    with whole_state_collected():
        return _module_state(module, pipe, names, all_ranks, snapshot)


def _module_state(
    module: nn.Module,
    pipe: Pipeline,
    names: StateNames,
    all_ranks: bool,
    snapshot: Snapshot | None,
) -> dict[str, Any]:
    local = local_module_state(module, pipe, names, snapshot)
    distributed = isinstance(pipe.transport, DistributedTransport)
    full: dict[str, Any] = {}
    for part in _gather(local, all_ranks) if distributed else [local]:
        full.update(part)
    if not full:
        return {}
    for group in tie_groups(module, pipe, names):  # a tensor held under several names
        found = [k for k in group if k in full]
        for k in group if found else ():
            full.setdefault(k, full[found[0]])
    return {k: full[k] for k in module.state_dict()}


def local_module_state(
    module: nn.Module,
    pipe: Pipeline,
    names: StateNames,
    snapshot: Snapshot | None,
    cpu: bool = True,
) -> dict[str, Any]:
    """This process's part of the whole module's state dict: its stages' entries under the
    module's names (a tied weight's copies left to its owner), and on rank 0 what no stage
    holds; nothing in a copy of the pipeline other than copy 0.

    Args:
        cpu: copy the tensors to the CPU (else detached where they are).
    """
    if snapshot is not None:
        stage_states = snapshot.module_state()
    else:
        stage_states = {i: pipe.stage_modules[i].state_dict() for i in pipe.local_stages}
    copies = {k for i in stage_states for k in pipe.ties.copy_keys(i)}  # the owner's entry counts

    def take(value: torch.Tensor) -> torch.Tensor:
        return value.detach().cpu() if cpu else value.detach()

    local = {
        names(k): take(v) for sd in stage_states.values() for k, v in sd.items() if k not in copies
    }
    if _other_copy(pipe):
        local = {}  # copy 0 holds the same weights; its buffers are the ones saved
    distributed = isinstance(pipe.transport, DistributedTransport)
    if not distributed or dist.get_rank() == 0:
        # what no stage holds (outside the pipelined module, or unused by its forward) is the
        # same in every process
        own = module.state_dict(keep_vars=True)
        held = {id(t) for m in pipe.stage_modules for t in m.state_dict(keep_vars=True).values()}
        local.update({k: take(v) for k, v in own.items() if id(v) not in held})
    return local


def tie_groups(module: nn.Module, pipe: Pipeline, names: StateNames) -> list[list[str]]:
    """The module's state-dict names that hold one tensor, in groups of two or more: one
    tensor under several names in the module, and a tied weight's owner with its copies."""
    groups: dict[int, list[str]] = {}
    for k, v in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(v), []).append(k)
    merged = [g for g in groups.values() if len(g) > 1]
    for tie in pipe.ties.ties:
        merged.append([names(tie.name), *(names(key) for key, _ in tie.copies.values())])
    out: list[list[str]] = []  # groups sharing a name are one
    for group in merged:
        joined = [g for g in out if set(g) & set(group)]
        for g in joined:
            out.remove(g)
        out.append(list(dict.fromkeys([*group, *(k for g in joined for k in g)])))
    return out


def _other_copy(pipe: Pipeline) -> bool:
    """Whether this process runs a copy of the pipeline other than copy 0 (D > 1): copy 0's
    state stands for all, the copies apply the same updates to the same weights."""
    return isinstance(pipe.transport, DistributedTransport) and pipe.transport.replica > 0


def _cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


def optimizer_state(
    param_groups: list[dict[str, Any]], snapshot: Snapshot, span: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The user's optimiser state for the whole model, with pipemare's own under "pipemare".

    Args:
        param_groups: the optimiser's ``state_dict()["param_groups"]`` (its settings).
        snapshot: the stages' state (:class:`~pipemare.engine.snapshot.Snapshot`).
        span: ``(offset, count)`` of this optimiser's parameters in the pipeline's numbering
            when the pipeline steps several, chained
            (:meth:`~pipemare.optim.chain.ChainedOptimizer.span`); pipemare's own state goes
            with the first.

    Each process's optimiser only ever stepped its own stages' parameters, so the
    per-parameter states of all processes are disjoint and merge into the whole model's.
    Other ranks get an empty dict (only rank 0 writes checkpoints).
    """
    per_param = snapshot.optimizer_state()
    local: dict[str, Any] = {
        "state": {k: {n: _cpu(v) for n, v in s.items()} for k, s in per_param.items()},
        "extra": snapshot.pipemare_state(),
    }
    distributed = isinstance(snapshot.pipe.transport, DistributedTransport)
    parts = (
        _gather(None if _other_copy(snapshot.pipe) else local, False) if distributed else [local]
    )
    parts = [p for p in parts if p is not None]
    if not parts:
        return {}
    first: dict[str, Any] = parts[0]["extra"]
    merged: dict[str, Any] = {"state": {}, "param_groups": param_groups}
    extra: dict[str, Any] = {
        "optimizer": dict(first["optimizer"], buffers={}),
        "pipeline": dict(first["pipeline"], rng={}),
        "layout": layout(snapshot.pipe),
    }
    for part in parts:
        merged["state"].update(part["state"])
        for name, buffers in part["extra"]["optimizer"]["buffers"].items():
            extra["optimizer"]["buffers"].setdefault(name, {}).update(
                {k: _cpu(v) for k, v in buffers.items()}
            )
        extra["pipeline"]["rng"].update(part["extra"]["pipeline"]["rng"])
    merged["state"] = dict(sorted(merged["state"].items()))
    if span is None:
        return {**merged, "pipemare": extra}
    offset, count = span
    merged["state"] = {k - offset: v for k, v in merged["state"].items() if 0 <= k - offset < count}
    return {**merged, "pipemare": extra} if offset == 0 else merged


def stage_shard(
    module: nn.Module,
    pipe: Pipeline,
    names: StateNames,
    snapshot: Snapshot,
    optimizer_states: Sequence[Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This process's shard of a per-stage checkpoint (:mod:`~pipemare.lightning.shards`):
    its tensors, keyed as the whole model's checkpoint keys them, and what rank 0 writes to
    ``meta.pt`` beside them: each optimiser's ``param_groups``, pipemare's settings and the
    layout, the module's names in order and the names that share a tensor.

    Args:
        optimizer_states: the checkpoint's ``"optimizer_states"`` (:class:`Deferred` each).
    """
    with whole_state_collected():
        weights = local_module_state(module, pipe, names, snapshot, cpu=False)
        order = list(module.state_dict(keep_vars=True))
        ties = tie_groups(module, pipe, names)
    per_param = {} if _other_copy(pipe) else snapshot.optimizer_state()
    extra = snapshot.pipemare_state()
    tensors: dict[str, Any] = {
        "state_dict": {k: pack(v) for k, v in weights.items()},
        "optimizer_states": {},
    }
    shared: list[dict[str, Any]] = []
    for j, entry in enumerate(optimizer_states):
        assert isinstance(entry, Deferred), "a per-stage checkpoint is taken from a snapshot"
        offset, count = entry.span or (0, None)
        state = {
            k - offset: v for k, v in per_param.items() if count is None or 0 <= k - offset < count
        }
        tensors["optimizer_states"][str(j)] = {
            "state": {str(k): {f: pack(x) for f, x in v.items()} for k, v in state.items()}
        }
        part: dict[str, Any] = {"param_groups": entry.param_groups or []}
        if offset == 0:
            part["pipemare"] = {
                "optimizer": dict(extra["optimizer"], buffers={}),
                "pipeline": dict(extra["pipeline"], rng={}),
                "layout": layout(pipe),
            }
        shared.append(part)
    if not _other_copy(pipe):
        tensors["pipemare"] = {
            "buffers": {
                name: {str(k): v for k, v in values.items()}
                for name, values in extra["optimizer"]["buffers"].items()
            },
            "rng": {str(i): r for i, r in extra["pipeline"]["rng"].items() if r is not None},
        }
    return tensors, {"optimizer_states": shared, "order": order, "ties": ties}


def layout(pipe: Pipeline) -> dict[str, Any]:
    """How ``pipe`` cuts and runs the model: what a resume compares against."""
    return {
        "stages": pipe.num_stages,
        "replicas": getattr(pipe.transport, "replicas", 1),
        "balance": list(pipe.balance),
        "schedule": pipe.schedule,
        "microbatches": pipe.microbatches,
        "corrections": [c.name for c in pipe.optimizer.corrections],
        # what the run's first lines say, e.g. for a validation of these weights to report
        "described": pipe.settings.describe(),
        "settings": pipe.settings.to_dict(),
    }


def trained_layout(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    """The layout (:func:`layout`) of the run that wrote a Lightning ``checkpoint``; None for
    a checkpoint pipemare did not write, or one written outside training."""
    for state in checkpoint.get("optimizer_states") or []:
        saved = state.get("pipemare", {}).get("layout") if isinstance(state, Mapping) else None
        if saved is not None:
            return dict(saved)
    return None


def load_pipemare_state(pipe: Pipeline, state: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Restore what :func:`optimizer_state` saved under "pipemare" (this process's part).

    A checkpoint from another partition, stage count or schedule still loads: the weights and
    the user's optimiser state are the whole model's either way. Returns, for the caller to
    announce, what does not carry over (each stage's random stream when the stages hold other
    layers, the buffers of corrections the new configuration does not run), and where this run
    differs from what the saved run derived from its length (T1's horizon is kept unless the
    config changed it: :meth:`~pipemare.optim.settings.RunSettings.resumed`).
    """
    saved = state.get("layout")
    now = layout(pipe)
    notes: list[str] = []
    pipeline_state = dict(state["pipeline"])
    if saved is not None and (saved["stages"], saved["balance"]) != (now["stages"], now["balance"]):
        pipeline_state["rng"] = {}
        notes.append(
            "the stages' random streams are reset: the checkpoint cut the model into "
            f"{saved['stages']} stages {saved['balance']}, this run into {now['stages']} "
            f"{now['balance']}"
        )
    optimizer_state = state["optimizer"]
    if saved is not None:
        dropped = sorted(set(optimizer_state.get("buffers", {})) - set(now["corrections"]))
        dropped = [n for n in dropped if optimizer_state["buffers"][n]]
        if dropped:
            names = " and ".join(
                [", ".join(dropped[:-1]), dropped[-1]] if dropped[:-1] else dropped
            )
            them = "them" if len(dropped) > 1 else "it"
            notes.append(f"the buffers of {names} are dropped: this run does not use {them}")
        started = sorted(set(now["corrections"]) - set(saved["corrections"]))
        if started:
            notes.append(f"{', '.join(started)} starts afresh: the checkpoint's run did not use it")
        for key in ("schedule", "microbatches"):
            if saved[key] != now[key]:
                notes.append(f"{key} changes from {saved[key]!r} to {now[key]!r}")
    run_notes = pipe.optimizer.load_state_dict(optimizer_state)
    pipe.load_state_dict(pipeline_state)
    return notes, run_notes


def warn_layout_changes(notes: list[str], warn: Callable[[str], Any]) -> None:
    """Say through ``warn`` what :func:`load_pipemare_state` could not carry over, if anything."""
    if notes:
        warn(text("resume.layout", notes="; ".join(notes)))


def warn_run_changes(notes: list[str], warn: Callable[[str], Any]) -> None:
    """Say through ``warn`` where the resumed run differs from the checkpointed run's derived
    settings (:func:`load_pipemare_state`'s second list), if anywhere."""
    if notes:
        warn(text("resume.run", notes="; ".join(notes)))


def load_optimizer_states(optimizers: Sequence[Any], states: Sequence[Any]) -> Any:
    """Load each optimiser's settings (``param_groups``), not yet its per-parameter state;
    return pipemare's part (what :func:`optimizer_state` saved under "pipemare"), or None
    where there is none. :func:`load_parameter_states` loads the rest once the stages are
    known."""
    pending = None
    for optimizer, state in zip(optimizers, states, strict=False):
        optimizer.load_state_dict({"state": {}, "param_groups": state["param_groups"]})
        if "pipemare" in state:
            pending = state["pipemare"]
    return pending


def load_parameter_states(
    pipe: Pipeline, optimizers: Sequence[Any], states: Sequence[Mapping[Any, Any]]
) -> None:
    """Load into each optimiser the saved per-parameter state of this process's stages'
    parameters only: the others' entries are never read (from shards) or copied."""
    local = {id(p) for i in pipe.local_stages for p in pipe.optimizer.stage_parameters(i)}
    for optimizer, saved in zip(optimizers, states, strict=False):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        mine = [k for k, p in enumerate(params) if id(p) in local]
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": read_local(saved, mine), "param_groups": groups})


def _local_pipemare_state(pipe: Pipeline, state: dict[str, Any]) -> dict[str, Any]:
    """pipemare's saved part with its buffers and random streams cut to this process's
    stages (read only those from shards)."""
    ordered = (p for g in pipe.optimizer.param_groups for p in g["params"])
    index = {id(p): k for k, p in enumerate(ordered)}
    mine = [index[id(p)] for i in pipe.local_stages for p in pipe.optimizer.stage_parameters(i)]
    optimizer = dict(state["optimizer"])
    buffers = optimizer.get("buffers", {})
    optimizer["buffers"] = {name: read_local(b, mine) for name, b in buffers.items()}
    pipeline = dict(state["pipeline"])
    pipeline["rng"] = read_local(pipeline.get("rng", {}), pipe.local_stages)
    return {**state, "optimizer": optimizer, "pipeline": pipeline}


def consolidate(module: nn.Module, pipe: Pipeline, names: StateNames, device: torch.device) -> None:
    """Give every process the whole model again (as DDP leaves it): each held its stages."""
    full = module_state(module, pipe, names, all_ranks=True)
    # storage for every tensor still on the meta device, the user's module's (a stage module
    # may hold a copy of a tied layer instead), ties kept; the state dict fills them
    for m in module.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)
    materialize(module, [module], device, init="none")
    module.load_state_dict(full)


# -- writing without draining -------------------------------------------------------------------


class Deferred(dict[str, Any]):
    """Stands for a state that a snapshot still collects; empty until the write fills it."""

    def __init__(
        self,
        snapshot: Snapshot,
        param_groups: list[dict[str, Any]] | None = None,
        span: tuple[int, int] | None = None,
        sharded: bool = False,
    ):
        super().__init__()
        self.snapshot = snapshot
        self.param_groups, self.span = param_groups, span
        #: written as per-stage shards (else gathered into one file)
        self.sharded = sharded


@dataclasses.dataclass
class _Entry:
    filepath: str
    checkpoint: dict[str, Any] | None = None  # None: a removal
    storage_options: Any = None
    snapshot: Snapshot | None = None
    due: int = 0  # the step (minibatch) at whose end every process has its part


class SaveQueue:
    """The strategy's saves and removals, in Lightning's order, each when its state is whole.

    Args:
        write: writes a complete checkpoint (the strategy's base ``save_checkpoint``).
        remove: removes a checkpoint file (the base ``remove_checkpoint``).
        write_shards: writes this process's shard and ``meta.pt``
            (:func:`pipemare.lightning.shards.write`, collective).
        sharded: whether the checkpoint at a path is written as per-stage shards now.
    """

    def __init__(
        self,
        write: Callable[[dict[str, Any], str, Any], None],
        remove: Callable[[str], None],
        write_shards: Callable[[dict[str, Any], dict[str, Any], str], None] | None = None,
        sharded: Callable[[str], bool] | None = None,
    ) -> None:
        self._write, self._remove = write, remove
        self._write_shards, self._is_sharded = write_shards, sharded
        self._entries: collections.deque[_Entry] = collections.deque()
        self._current: Snapshot | None = None  # taken by the dump in progress

    def __len__(self) -> int:
        return len(self._entries)

    def _sharded(self, path: str = "") -> bool:
        return self._is_sharded is not None and self._is_sharded(path)

    @property
    def pending(self) -> list[str]:
        """Files asked for and not written yet."""
        return [e.filepath for e in self._entries if e.checkpoint is not None]

    # -- Lightning's dump_checkpoint -----------------------------------------------------

    def _snapshot(self, pipe: Pipeline) -> Snapshot:
        minibatch = pipe.minibatches_fed - 1
        if self._current is None or self._current.minibatch != minibatch:
            # several saves of one step (a top-k file and last.ckpt) share one snapshot
            same = [e.snapshot for e in self._entries if e.snapshot is not None]
            if same and same[-1].minibatch == minibatch:
                self._current = same[-1]
            else:
                self._current = Snapshot(pipe, minibatch)
        return self._current

    @staticmethod
    def _ready_now(pipe: Pipeline, snap: Snapshot) -> bool:
        if not isinstance(pipe.transport, DistributedTransport):
            return snap.complete
        # every process must decide alike: only what the schedule tells, never local progress
        return pipe.drained or snapshot_lag(pipe.schedule, pipe.num_stages, pipe.microbatches) == 0

    def module_state(self, module: nn.Module, pipe: Pipeline, names: StateNames) -> dict[str, Any]:
        """``lightning_module_state_dict``: the whole model now, or a :class:`Deferred`."""
        snap = self._snapshot(pipe)
        if self._sharded():  # each process writes its part at the write, gathering nothing
            return Deferred(snap, sharded=True)
        if self._ready_now(pipe, snap):
            return module_state(module, pipe, names, snapshot=snap)
        return Deferred(snap)

    def optimizer_state(self, optimizer: Any, pipe: Pipeline) -> dict[str, Any]:
        """``optimizer_state``: the whole optimiser state now, or a :class:`Deferred`."""
        snap = self._snapshot(pipe)
        groups = copy.deepcopy(optimizer.state_dict()["param_groups"])
        chain = pipe.optimizer.optimizer  # several optimisers: this one's part of the chain
        span = chain.span(optimizer) if isinstance(chain, ChainedOptimizer) else None
        if self._sharded():
            return Deferred(snap, groups, span, sharded=True)
        if self._ready_now(pipe, snap):
            return optimizer_state(groups, snap, span)
        return Deferred(snap, groups, span)

    # -- Lightning's save_checkpoint / remove_checkpoint -------------------------------------

    def save(
        self, checkpoint: dict[str, Any], filepath: str, storage_options: Any, pipe: Pipeline | None
    ) -> None:
        self._current = None
        state = checkpoint.get("state_dict")
        snap = state.snapshot if isinstance(state, Deferred) else None
        if snap is None and not self._entries:
            self._write(checkpoint, filepath, storage_options)
            return
        entry = _Entry(filepath, checkpoint, storage_options, snap)
        if snap is not None:
            assert pipe is not None
            lag = snapshot_lag(pipe.schedule, pipe.num_stages, pipe.microbatches)
            entry.due = snap.minibatch + lag
            # the rest of the dict (loops, callbacks, schedulers) as it is at this step
            entry.checkpoint = {
                k: v if isinstance(v, Deferred) else copy.deepcopy(v)
                for k, v in checkpoint.items()
                if k != "optimizer_states"
            }
            entry.checkpoint["optimizer_states"] = list(checkpoint.get("optimizer_states", []))
        self._entries.append(entry)

    def remove(self, filepath: str) -> None:
        if self._entries:
            self._entries.append(_Entry(filepath))
        else:
            self._remove(filepath)

    # -- writing what is due -----------------------------------------------------------------

    def poll(self, module: nn.Module, pipe: Pipeline | None, names: StateNames) -> None:
        """Write and remove, in order, everything whose state is whole by now; call it at the
        end of every training step and after every drain, on every process alike."""
        while self._entries:
            entry = self._entries[0]
            if entry.checkpoint is None:
                self._remove(entry.filepath)
            else:
                if entry.snapshot is not None:
                    assert pipe is not None
                    if not self._due(pipe, entry):
                        return
                    if self._shard(entry, module, pipe, names):
                        self._entries.popleft()
                        continue
                    self._fill(entry, module, pipe, names)
                self._write(entry.checkpoint, entry.filepath, entry.storage_options)
            self._entries.popleft()

    @staticmethod
    def _due(pipe: Pipeline, entry: _Entry) -> bool:
        assert entry.snapshot is not None
        if not isinstance(pipe.transport, DistributedTransport):
            return entry.snapshot.complete
        due = pipe.drained or pipe.minibatches_fed - 1 >= entry.due
        if due and not entry.snapshot.complete:
            raise RuntimeError(text("checkpoint.incomplete", step=entry.snapshot.minibatch + 1))
        return due

    def _shard(self, entry: _Entry, module: nn.Module, pipe: Pipeline, names: StateNames) -> bool:
        """Write ``entry`` as per-stage shards if it was taken so; whether it was."""
        checkpoint, snap = entry.checkpoint, entry.snapshot
        assert checkpoint is not None and snap is not None
        state = checkpoint.get("state_dict")
        if not (isinstance(state, Deferred) and state.sharded):
            return False
        if not self._sharded(str(entry.filepath)):  # e.g. a remote path: one file after all
            return False
        assert self._write_shards is not None
        tensors, shared = stage_shard(
            module, pipe, names, snap, checkpoint.get("optimizer_states", [])
        )
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["optimizer_states"] = shared["optimizer_states"]
        meta[FORMAT] = {"version": 1, "order": shared["order"], "ties": shared["ties"]}
        self._write_shards(tensors, meta, entry.filepath)
        snap.release()
        return True

    @staticmethod
    def _fill(entry: _Entry, module: nn.Module, pipe: Pipeline, names: StateNames) -> None:
        checkpoint, snap = entry.checkpoint, entry.snapshot
        assert checkpoint is not None and snap is not None
        checkpoint["state_dict"] = module_state(module, pipe, names, snapshot=snap)
        checkpoint["optimizer_states"] = [
            optimizer_state(s.param_groups or [], snap, s.span) if isinstance(s, Deferred) else s
            for s in checkpoint["optimizer_states"]
        ]

    def abandon(self, warn: Callable[[str], Any] | None = None) -> list[str]:
        """Drop everything queued (after an error); returns the files never written, and
        names them through ``warn`` when given."""
        lost = self.pending
        for entry in self._entries:
            if entry.snapshot is not None:
                entry.snapshot.release()
        self._entries.clear()
        self._current = None
        if lost and warn is not None:
            warn(text("checkpoint.not_written", count=len(lost), files=", ".join(lost)))
        return lost


class Checkpoints:
    """A run's checkpoints: those in flight (:class:`SaveQueue`), the state a loaded one still
    has to give the pipeline, and how a loaded checkpoint's run was laid out.

    Args:
        write: writes a complete checkpoint file (the Lightning base's ``save_checkpoint``).
        remove: removes a checkpoint file (the base's ``remove_checkpoint``).
        warn: warns on rank 0 (a resume that changes the layout or the run says how).
        write_shards: writes this process's shard (see :class:`SaveQueue`).
        sharded: whether the checkpoint at a path is written as per-stage shards now.
    """

    def __init__(
        self,
        write: Callable[[dict[str, Any], str, Any], None],
        remove: Callable[[str], None],
        warn: Callable[[str], Any],
        write_shards: Callable[[dict[str, Any], dict[str, Any], str], None] | None = None,
        sharded: Callable[[str], bool] | None = None,
    ) -> None:
        self.saves = SaveQueue(write, remove, write_shards, sharded)
        self._warn = warn
        self._pending: dict[str, Any] | None = None  # pipemare's part of a loaded checkpoint
        #: the user's optimisers and their saved per-parameter states, until the stages exist
        self._parameter_states: tuple[list[Any], list[Mapping[Any, Any]]] | None = None
        #: how a loaded checkpoint's run was laid out and corrected (validate, test and
        #: predict report it: they restore no optimiser state)
        self.trained: dict[str, Any] | None = None

    @property
    def pending_layout(self) -> Mapping[str, Any] | None:
        """The layout of the run a loaded checkpoint continues, until the pipeline takes it."""
        return None if self._pending is None else self._pending.get("layout")

    def module_state(
        self, module: nn.Module, pipe: Pipeline | None, names: StateNames
    ) -> dict[str, Any]:
        """The whole model; during training the state each stage has once the step's
        minibatch reached it, collected without draining."""
        if pipe is None:
            return module.state_dict()
        return self.saves.module_state(module, pipe, names)

    def optimizer_state(self, optimizer: Any, pipe: Pipeline | None) -> dict[str, Any]:
        """The user's optimiser state for the whole model, plus pipemare's own under "pipemare"."""
        if pipe is None:
            return optimizer.state_dict()
        return self.saves.optimizer_state(optimizer, pipe)

    def forget_loaded(self) -> None:
        """Drop what a checkpoint loaded for an earlier run of the Trainer still held for its
        pipeline (a run that stopped before its first batch): a new run starts clean."""
        self._pending, self._parameter_states = None, None

    def note_trained(self, loaded: Mapping[str, Any]) -> None:
        """Keep how a loaded checkpoint's run was laid out and corrected."""
        self.trained = trained_layout(loaded)

    def load_optimizer_states(self, optimizers: Sequence[Any], states: Sequence[Any]) -> None:
        """Load the user's optimisers' settings now; keep their per-parameter state and
        pipemare's part for the pipeline, which knows this process's stages."""
        pending = load_optimizer_states(optimizers, states)
        self._parameter_states = (
            list(optimizers),
            [s.get("state", {}) for s in states],
        )
        if pending is not None:
            self._pending = pending

    def load_pending(self, pipe: Pipeline) -> bool:
        """Load the per-parameter states of ``pipe``'s stages and pipemare's part of a loaded
        checkpoint, once both exist, and say what the resume changed; whether there was a
        checkpoint's pipemare part."""
        if self._parameter_states is not None:
            load_parameter_states(pipe, *self._parameter_states)
            self._parameter_states = None
        if self._pending is None:
            return False
        notes, run_notes = load_pipemare_state(pipe, _local_pipemare_state(pipe, self._pending))
        self._pending = None
        warn_layout_changes(notes, self._warn)
        warn_run_changes(run_notes, self._warn)
        return True
