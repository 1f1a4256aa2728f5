"""Traces kept for reuse: a module cut again (``trainer.fit`` then ``validate`` and ``test``, a
sweep's next run, a deep copy) takes the graphs of an earlier cut of the same architecture
instead of tracing it again, which costs seconds for a small Hugging Face model (2 to 6 s
each on two CPU cores, the zoo's printed cut times) and minutes for a large one.

Two modules share a trace only where nothing the trace could bake in differs: the classes, the
names, shapes, dtypes and devices of every parameter and buffer and which of them are one tensor
(a tie), every other attribute of every submodule (a dropout's rate, a config's settings), the
call's structure, its non-tensor values and the sizes the trace keeps fixed, the split points,
the default dtype and the autocast state. A module with hooks, or an attribute of a kind not
known here, is traced each time. The kept graphs read the tensors of the module they are bound
to (:class:`~pipemare.model.segments.Segment`); they hold none of the traced module's own, so
keeping them keeps no model alive."""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["TRACES", "TraceStore", "trace_key"]


class _Unknown(Exception):
    """An attribute the key cannot describe: the module is traced each time."""


#: a module's own bookkeeping, described separately (tensors, children) or not traced into
#: the graph (hooks refuse the key; the train/eval flag is set by the trace itself)
_INTERNAL = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_is_full_backward_hook",
        "training",
    }
)
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _tensor(t: torch.Tensor) -> tuple:
    return ("tensor", tuple(t.shape), t.dtype, t.device.type, t.requires_grad)


def _value(v: Any, paths: dict[int, str], depth: int = 0) -> Hashable:
    """A hashable description of an attribute's value; raises :class:`_Unknown`."""
    if depth > 6:
        raise _Unknown
    if isinstance(v, (*_PLAIN, enum.Enum)):
        return (type(v), v)
    if isinstance(v, torch.Tensor):  # a tensor attribute is read at call time, not baked
        return _tensor(v)
    if isinstance(v, nn.Module):  # a module of the tree held twice (a tie, a back reference)
        if id(v) not in paths:
            raise _Unknown
        return ("module", paths[id(v)])
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_value(x, paths, depth + 1) for x in v))
    if isinstance(v, (set, frozenset)):
        return (type(v), tuple(sorted((_value(x, paths, depth + 1) for x in v), key=repr)))
    if isinstance(v, dict):
        items = [(_value(k, paths, depth + 1), _value(x, paths, depth + 1)) for k, x in v.items()]
        return (dict, tuple(sorted(items, key=repr)))
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)):
        return ("code", v)  # the same object in a copy of the module
    if isinstance(v, types.MethodType):  # bound to a module of the tree
        return ("method", v.__func__, _value(v.__self__, paths, depth + 1))
    if isinstance(v, functools.partial):
        return ("partial", _value((v.func, v.args, v.keywords), paths, depth + 1))
    hf = sys.modules.get("transformers")
    if hf is not None and isinstance(v, (hf.PretrainedConfig, hf.GenerationConfig)):
        return ("config", type(v), v.to_json_string(use_diff=False))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):  # peft's adapter configs
        fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        return ("dataclass", type(v), _value(fields, paths, depth + 1))
    raise _Unknown


def trace_key(
    module: nn.Module, args: tuple, kwargs: dict, options: Hashable, varying: Any
) -> Hashable | None:
    """What a trace of ``module(*args, **kwargs)`` with ``options`` (the cuts, ...) depends
    on, or None where it
    cannot be told (hooks, an attribute of an unknown kind): then it is not kept.
    ``varying(tensor)`` names the sizes the trace lets vary, left out of the key (a kept trace
    is checked against the new example's sizes before it is used)."""
    modules = list(module.named_modules(remove_duplicate=False))
    paths = {id(m): name for name, m in reversed(modules)}
    # where each tensor is first held: a tie (a head sharing its embedding's weight) is traced
    # as one input, so a tied module's graphs would compute an untied one's wrongly
    first: dict[int, str] = {}
    try:
        tree = []
        for name, m in modules:
            if any(getattr(m, hooks, None) for hooks in _HOOKS):
                return None
            attrs = tuple(
                (k, _value(v, paths)) for k, v in sorted(vars(m).items()) if k not in _INTERNAL
            )
            tensors = tuple(
                (
                    kind,
                    k,
                    None if t is None else (_tensor(t), first.setdefault(id(t), f"{name}.{k}")),
                )
                for kind, table in (("p", m._parameters), ("b", m._buffers))
                for k, t in table.items()
            )
            transient = tuple(sorted(m._non_persistent_buffers_set))
            tree.append((name, type(m), attrs, tensors, transient))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        inputs = tuple(
            _tensor_input(x, varying(x)) if isinstance(x, torch.Tensor) else _value(x, paths)
            for x in leaves
        )
    except _Unknown:
        return None
    state = (  # the grad mode is not: the cut always traces with grad enabled
        torch.get_default_dtype(),
        tuple(
            (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda")
        ),
    )
    return (tuple(tree), str(spec), inputs, options, state)


def _tensor_input(x: torch.Tensor, varying: Any) -> tuple:
    sizes = tuple(None if d in varying else s for d, s in enumerate(x.shape))
    return ("input", sizes, x.dtype, x.device.type, x.requires_grad)


class TraceStore:
    """The last ``size`` traces, by :func:`trace_key`. ``hits`` counts the cuts that reused
    one, ``misses`` those that traced a module whose key could be told (a module without a key
    counts as neither)."""

    def __init__(self, size: int = 8) -> None:
        self.size, self.hits, self.misses = size, 0, 0
        self._kept: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable) -> Any | None:
        """The trace kept under ``key`` (now the latest), or None."""
        found = self._kept.get(key)
        if found is not None:
            self._kept.move_to_end(key)
        return found

    def put(self, key: Hashable, traced: Any) -> None:
        """Keep ``traced`` under ``key``; the oldest goes beyond ``size``."""
        self._kept[key] = traced
        self._kept.move_to_end(key)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def clear(self) -> None:
        """Forget every trace and zero the counts."""
        self._kept.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._kept)


#: the process's kept traces (:func:`pipemare.model.segments.segment_module` uses them)
TRACES = TraceStore()
