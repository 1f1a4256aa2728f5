"""Per-stage checkpoints: every process writes its own stage, nothing is gathered.

A model built on the meta device is never whole in any process, so its checkpoints are not
either. As Lightning's ``ModelParallelStrategy`` does by default, a checkpoint is a directory:
each process writes its own tensors with ``torch.distributed.checkpoint`` (DCP), in parallel,
and rank 0 adds ``meta.pt`` (Lightning's name for it) with everything that is not a tensor of
a stage: the loops, the callbacks, the schedulers, each optimiser's ``param_groups``, pipemare's
settings and the run's layout. The tensors are keyed by what the whole-model checkpoint keys
them by, never by stage:

- ``state_dict.<name>``: the LightningModule's state-dict entry ``name``;
- ``optimizer_states.<j>.state.<k>.<field>``: optimiser ``j``'s state of its ``k``-th
  parameter (``torch.optim``'s numbering over the whole model);
- ``pipemare.buffers.<correction>.<k>`` and ``pipemare.rng.<stage>``: the corrections' buffers
  and each stage's random stream.

So a run cut another way reads the same keys: at another P each process reads only the tensors
its new stage owns (:class:`ShardedCheckpoint`, lazily, key by key).
:func:`consolidate_checkpoint` turns the directory into one ordinary Lightning checkpoint (the
command ``pipemare consolidate``), and :func:`export_pretrained` into a Hugging Face
``save_pretrained`` directory, or a ``peft`` adapter's.

The directory appears whole or not at all: the processes write into a hidden
``.NAME.pipemare-partial`` beside it, which rank 0 renames into place once every shard and
``meta.pt`` are on disk.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from pipemare.lightning.checkpoint_io import atomic_save

__all__ = [
    "META",
    "ShardedCheckpoint",
    "ShardedEntries",
    "consolidate_checkpoint",
    "export_pretrained",
    "is_sharded",
    "pack",
    "read_local",
    "unpack",
    "write",
]

#: the file of what is not a stage's tensor (Lightning's ``_METADATA_FILENAME``)
META = "meta.pt"
#: the key in ``meta.pt`` that marks pipemare's format: its version, the module's keys in order,
#: and the names that share one tensor
FORMAT = "pipemare_shards"
_PARTIAL = ".pipemare-partial"
_OLD = ".pipemare-old"


_PACKED = b"pipemare-packed:"


def pack(value: Any) -> Any:
    """A list, tuple or dict as one value (DCP would split it into a key per item, which the
    reader does not put back together: an optimiser's list of tensors, a module's extra
    state); anything else as it is."""
    if not isinstance(value, (list, tuple, dict)):
        return value
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return _PACKED + buffer.getvalue()


def unpack(value: Any) -> Any:
    """What :func:`pack` packed, back."""
    if isinstance(value, bytes) and value.startswith(_PACKED):
        return torch.load(io.BytesIO(value[len(_PACKED) :]), weights_only=False)
    return value


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory of per-stage shards (DCP's ``.metadata`` and ``meta.pt``)."""
    p = Path(path)
    return p.is_dir() and (p / META).is_file() and (p / ".metadata").is_file()


def write(
    tensors: dict[str, Any],
    shared: dict[str, Any] | None,
    path: str | os.PathLike[str],
    barrier: Callable[[], None],
) -> None:
    """Write this process's ``tensors`` (nested dicts, see the module's keys) as its shard of
    the checkpoint ``path``; ``shared`` (rank 0's, None elsewhere) becomes ``meta.pt``.
    Collective: every process calls it, with the same ``path``."""
    import torch.distributed.checkpoint as dcp

    if "://" in str(path):
        raise ValueError(
            f"pipemare writes per-stage checkpoints to a filesystem every process shares, not to "
            f"{path}; pass save_distributed_checkpoint=False to write one file of the whole "
            "model there"
        )
    target = Path(path).absolute()
    partial = target.parent / f".{target.name}{_PARTIAL}"
    if shared is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a killed run's leftovers
    barrier()
    import torch.distributed as dist

    dcp.save(tensors, checkpoint_id=partial, no_dist=not dist.is_initialized())
    if shared is not None:  # DCP's save returned: every shard and .metadata are written
        atomic_save(shared, partial / META)
        _replace(partial, target)
    barrier()


def _replace(partial: Path, target: Path) -> None:
    old = target.parent / f".{target.name}{_OLD}"
    shutil.rmtree(old, ignore_errors=True)
    if target.is_dir():
        target.rename(old)
    elif target.exists():
        target.unlink()
    partial.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class ShardedCheckpoint:
    """A directory of per-stage shards, read key by key (never the whole at once).

    Args:
        path: the checkpoint directory (:func:`is_sharded`).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(path)
        found = FileSystemReader(self.path).read_metadata()
        self._entries = found.state_dict_metadata
        self._paths: dict[str, tuple[str, ...]] = {
            k: tuple(str(part) for part in v) for k, v in (found.planner_data or {}).items()
        }
        #: everything that is not a stage's tensor (``meta.pt``)
        self.meta: dict[str, Any] = torch.load(
            self.path / META, map_location="cpu", weights_only=False
        )
        form = self.meta.get(FORMAT)
        if not isinstance(form, Mapping) or form.get("version") != 1:
            raise ValueError(
                f"{self.path} is a distributed checkpoint that pipemare did not write (its "
                f"{META} has no {FORMAT!r} entry of version 1); load it with the strategy that "
                "wrote it"
            )
        self.order: list[str] = list(form["order"])
        self._groups: dict[str, list[str]] = {
            name: list(group) for group in form["ties"] for name in group
        }

    def keys_under(self, *prefix: str) -> dict[str, str]:
        """The saved keys under ``prefix``: the next part of their path -> the full key (for
        ``("state_dict",)``: the module's names)."""
        n = len(prefix)
        return {
            path[n]: key
            for key, path in self._paths.items()
            if path[:n] == prefix and len(path) == n + 1
        }

    def groups_under(self, *prefix: str) -> dict[str, dict[str, str]]:
        """The saved keys two levels under ``prefix``: e.g. a parameter's number -> its
        optimiser state's field -> the full key."""
        n = len(prefix)
        out: dict[str, dict[str, str]] = {}
        for key, path in self._paths.items():
            if path[:n] == prefix and len(path) == n + 2:
                out.setdefault(path[n], {})[path[n + 1]] = key
        return out

    def read(self, keys: Iterable[str]) -> dict[str, Any]:
        """The values of the saved ``keys`` (full keys), read in one pass over the files."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        target: dict[str, Any] = {}
        for key in keys:
            entry = self._entries[key]
            if isinstance(entry, TensorStorageMetadata):
                target[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
            else:
                target[key] = ""  # a value that is not a tensor: replaced by what was saved
        if target:
            with warnings.catch_warnings():  # "assuming ... a single process": as meant
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.load(target, checkpoint_id=self.path, no_dist=True)
        return target

    def state_dict(self) -> ShardedEntries:
        """The LightningModule's state dict, read lazily; a name the shards lack is read under
        another name of the same tensor (a tied weight saved once)."""
        saved = self.keys_under("state_dict")
        return ShardedEntries(self, saved, self.order, self._groups)

    def optimizer_states(self) -> list[dict[str, Any]]:
        """Each optimiser's ``state_dict()``, its per-parameter ``"state"`` read lazily
        (:class:`ShardedEntries` of dicts, keyed by ``int``), pipemare's buffers and random
        streams under ``"pipemare"`` likewise."""
        out = []
        for j, shared in enumerate(self.meta.get("optimizer_states", [])):
            state = dict(shared)
            groups = self.groups_under("optimizer_states", str(j), "state")
            state["state"] = ShardedEntries(self, groups, sorted(groups, key=int), key=int)
            if "pipemare" in state:
                extra = {
                    k: dict(v) if isinstance(v, Mapping) else v
                    for k, v in shared["pipemare"].items()
                }
                buffers = {
                    name: ShardedEntries(self, keys, sorted(keys, key=int), key=int)
                    for name, keys in self.groups_under("pipemare", "buffers").items()
                }
                extra["optimizer"]["buffers"] = buffers
                rng = self.keys_under("pipemare", "rng")
                extra["pipeline"]["rng"] = ShardedEntries(self, rng, sorted(rng, key=int), key=int)
                state["pipemare"] = extra
            out.append(state)
        return out

    def checkpoint(self) -> dict[str, Any]:
        """What Lightning's ``load_checkpoint`` returns: ``meta.pt``, with the state dict and
        the optimisers' states read lazily."""
        loaded = {k: v for k, v in self.meta.items() if k != FORMAT}
        loaded["state_dict"] = self.state_dict()
        loaded["optimizer_states"] = self.optimizer_states()
        return loaded


class ShardedEntries(Mapping[Any, Any]):
    """A mapping over saved entries, each read when asked for (:meth:`read` for many at once).

    Args:
        shards: the checkpoint.
        saved: a name -> its full key, or -> a dict of field -> full key (read as a dict).
        order: the names, in the order they are listed.
        groups: a name -> every name of the same tensor (read under another where it lacks).
        key: the type of the names when listed (``int`` for parameter numbers).
    """

    def __init__(
        self,
        shards: ShardedCheckpoint,
        saved: Mapping[str, Any],
        order: Iterable[str],
        groups: Mapping[str, list[str]] | None = None,
        key: Callable[[str], Any] = str,
    ) -> None:
        self._shards, self._saved, self._groups = shards, dict(saved), dict(groups or {})
        self._key = key
        self._order = [key(name) for name in order if self._source(name) is not None]

    def _source(self, name: str) -> str | None:
        if name in self._saved:
            return name
        return next((n for n in self._groups.get(name, ()) if n in self._saved), None)

    @override
    def __iter__(self) -> Iterator[Any]:
        return iter(self._order)

    @override
    def __len__(self) -> int:
        return len(self._order)

    @override
    def __contains__(self, name: object) -> bool:
        return self._source(str(name)) is not None

    @override
    def __getitem__(self, name: Any) -> Any:
        found = self.read([name])
        if not found:
            raise KeyError(name)
        return found[name]

    def read(self, names: Iterable[Any]) -> dict[Any, Any]:
        """The entries of ``names`` that were saved, read in one pass (others are left out)."""
        found = {n: self._source(str(n)) for n in names}
        sources = {n: s for n, s in found.items() if s is not None}
        keys = [k for s in dict.fromkeys(sources.values()) for k in _keys(self._saved[s])]
        values = self._shards.read(keys)
        out = {}
        for name, source in sources.items():
            entry = self._saved[source]
            if isinstance(entry, Mapping):
                out[name] = {field: unpack(values[k]) for field, k in entry.items()}
            else:
                out[name] = unpack(values[entry])
        return out


def _keys(entry: str | Mapping[str, str]) -> list[str]:
    return list(entry.values()) if isinstance(entry, Mapping) else [entry]


def read_local(entries: Mapping[Any, Any], names: Iterable[Any]) -> dict[Any, Any]:
    """The entries of ``names`` that ``entries`` holds: read in one pass from shards, taken
    from an ordinary dict otherwise."""
    if isinstance(entries, ShardedEntries):
        return entries.read(names)
    return {n: entries[n] for n in names if n in entries}


def consolidate_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole-model Lightning checkpoint the shards at ``path`` make up: what
    ``trainer.save_checkpoint`` writes with ``save_distributed_checkpoint=False``, which
    ``load_from_checkpoint`` reads on one device. Needs the whole model to fit in memory.

    Example (the command does the same)::

        torch.save(consolidate_checkpoint("epoch=0-step=40.ckpt"), "whole.ckpt")
        # python -m pipemare consolidate epoch=0-step=40.ckpt whole.ckpt
    """
    shards = ShardedCheckpoint(path)
    whole = shards.checkpoint()
    whole["state_dict"] = dict(whole["state_dict"].read(whole["state_dict"]))
    states = []
    for state in whole["optimizer_states"]:
        state = dict(state)
        state["state"] = state["state"].read(state["state"])
        extra = state.get("pipemare")
        if extra is not None:
            buffers = extra["optimizer"]["buffers"]
            extra["optimizer"]["buffers"] = {n: b.read(b) for n, b in buffers.items()}
            rng = extra["pipeline"]["rng"]
            extra["pipeline"]["rng"] = rng.read(rng)
        states.append(state)
    whole["optimizer_states"] = states
    return whole


def export_pretrained(
    path: str | os.PathLike[str], model: nn.Module, directory: str | os.PathLike[str]
) -> None:
    """Write a Hugging Face ``save_pretrained`` directory from a checkpoint (shards or one
    file): ``model`` (a ``transformers`` model, or a ``peft`` one, built on any device, meta
    included) takes the checkpoint's weights and saves itself, a ``peft`` model its adapter
    alone. The checkpoint's names are matched to the model's by their longest common ending
    (the LightningModule's attribute that holds the model is left off).

    Example::

        model = AutoModelForCausalLM.from_config(config)      # or a PeftModel
        export_pretrained("last.ckpt", model, "fine-tuned/")  # then from_pretrained("fine-tuned/")
    """
    if is_sharded(path):  # the weights only, not the optimiser's state
        lazy = ShardedCheckpoint(path).state_dict()
        state = lazy.read(lazy)
    else:
        state = _state_of_file(path)
    own = model.state_dict(keep_vars=True)
    prefix = _common_prefix(state, own)
    found = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    missing = [k for k in own if k not in found]
    if missing:
        raise ValueError(
            f"the checkpoint {os.fspath(path)!r} holds no value for {len(missing)} of the "
            f"model's tensors ({', '.join(missing[:4])}); pass the model the checkpoint trained"
        )
    model.load_state_dict({k: found[k] for k in own}, assign=True)
    model.save_pretrained(os.fspath(directory))  # type: ignore[operator]


def _state_of_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    return dict(loaded.get("state_dict", loaded))


def _common_prefix(state: Mapping[str, Any], own: Mapping[str, Any]) -> str:
    """The prefix that, put before the model's names, gives the checkpoint's: found from the
    model's longest name (the least likely to end another)."""
    name = max(own, key=len, default="")
    for key in state:
        if key == name or key.endswith(f".{name}"):
            return key[: -len(name)]
    return ""
