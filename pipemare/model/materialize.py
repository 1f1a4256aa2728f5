"""A model built without its weights: parameters on the meta device, one stage made real.

A model too big for one device is built the way Lightning's ``ModelParallelStrategy`` and
torchtitan build it: every parameter on the meta device (shapes, no storage), the model cut
there, and each process then gives real storage only to the layers of its own stage, which it
initialises (each module's ``reset_parameters()``, or the model's own init hook) or reads from
a file of one device's weights, tensor by tensor.

Buffers stay real while the model is built (:func:`meta_parameters`): a rotary embedding's
``inv_freq`` or a causal mask is computed in ``__init__`` and has no ``reset_parameters()`` to
compute it again, so it must never pass through the meta device. They are small.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipemare.lines import text

__all__ = [
    "INIT_HOOKS",
    "has_meta",
    "init_method",
    "load_stage_weights",
    "materialize",
    "meta_parameters",
    "replace_parameters",
    "to_meta",
    "warn_on_meta_state",
    "whole_state_collected",
    "with_data",
]

#: model-level init hooks, looked for in this order on the pipelined module: torchtitan's
#: models define ``init_weights()``; it runs over the whole model, whose other stages' tensors
#: are on the meta device, where initialising does nothing
INIT_HOOKS = ("init_weights",)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Inside: every parameter a module registers goes to the meta device; buffers stay real.

    Example:
        >>> with meta_parameters():
        ...     layer = nn.BatchNorm1d(4)
        >>> layer.weight.device.type, layer.running_mean.device.type
        ('meta', 'cpu')
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and not param.is_meta:
            self._parameters[name] = with_data(param, param.detach().to("meta"))

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def with_data(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter like ``param`` (its class, ``requires_grad`` and attributes: peft's, ...)
    over ``data``: where ``param.data = data`` cannot go (between the meta device and a real
    one)."""
    new = type(param)(data, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is on the meta device."""
    return any(p.is_meta for p in module.parameters())


def replace_parameters(root: nn.Module, new: Mapping[int, nn.Parameter]) -> None:
    """Put ``new[id(p)]`` in every place of ``root`` that holds ``p``: a parameter two layers
    share (a tied embedding and head) stays shared."""
    for module in root.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in new:
                module._parameters[name] = new[id(p)]


def to_meta(layers: nn.Module, root: nn.Module) -> None:
    """Send ``layers`` (another process's stage) to the meta device, freeing their storage;
    a parameter they share with a layer elsewhere in ``root`` is replaced there too, so that
    ``root`` keeps its ties (``module.to("meta")`` gives each holder a parameter of its own).
    Buffers that no state dict holds (non-persistent, e.g. rotary frequencies) stay: nothing
    could give them back, and gathering the model needs them."""
    moved: dict[int, nn.Parameter] = {}
    for p in layers.parameters():
        if id(p) not in moved and not p.is_meta:
            moved[id(p)] = with_data(p, p.detach().to("meta"))
    replace_parameters(root, moved)
    replace_parameters(layers, moved)
    for m in layers.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and name not in m._non_persistent_buffers_set:
                m._buffers[name] = b.to("meta")


def materialize(
    root: nn.Module,
    layers: Iterable[nn.Module],
    device: torch.device,
    init: str = "reset_parameters",
    only: Iterable[nn.Parameter] | None = None,
) -> dict[int, nn.Parameter]:
    """Give the meta parameters of ``layers`` (this process's stage, inside ``root``) real,
    initialised storage on ``device``; move their real buffers there.

    Args:
        root: the whole pipelined model: where a parameter is shared with a layer of another
            stage, that layer gets the real one too (so a later cut still sees the tie).
        layers: the layers this process runs.
        device: where they run.
        init: ``"reset_parameters"``: each module that holds a parameter calls its own
            ``reset_parameters()``; ``"init_weights"`` (:data:`INIT_HOOKS`): ``root``'s hook
            runs once over the whole model; ``"none"``: storage only (weights loaded after).
        only: the parameters to make real, where ``layers`` hold others too (a traced
            model's segments: ``layers`` are then the modules that own these parameters).

    Returns:
        The parameters made real: ``id`` of the meta one -> the real one.

    Raises:
        TypeError: a module holds a parameter of its own but has no ``reset_parameters()``
            and ``root`` no init hook, named with the fixes.
    """
    modules = list({id(m): m for layer in layers for m in layer.modules()}.values())
    wanted = None if only is None else {id(p) for p in only}
    meta = {
        id(p): p
        for m in modules
        for p in m.parameters(recurse=False)
        if p.is_meta and (wanted is None or id(p) in wanted)
    }
    owners = [m for m in modules if any(id(p) in meta for p in m.parameters(recurse=False))]
    if init == "reset_parameters":
        _check_resettable(owners, meta)
    made = {pid: with_data(p, torch.empty_like(p, device=device)) for pid, p in meta.items()}
    for m in owners:  # Hugging Face skips a module flagged as initialised (at its meta build)
        m.__dict__.pop(_HF_DONE, None)
    for p in made.values():
        p.__dict__.pop(_HF_DONE, None)
    replace_parameters(root, made)
    for m in modules:
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                raise TypeError(
                    f"buffer {name!r} of {type(m).__name__} is on the meta device: it cannot be "
                    "computed again; build the model with its buffers real (pipemare's "
                    "configure_model and init_module(empty_init=True) keep them real)"
                )
            if b is not None:
                m._buffers[name] = b.to(device)
    with torch.no_grad():
        if init == "reset_parameters":
            for m in owners:
                m.reset_parameters()  # type: ignore[operator]
        elif init in INIT_HOOKS:
            getattr(root, init)()
    return made


#: the flag Hugging Face's ``initialize_weights`` sets on a module (and a parameter) it has
#: initialised, and skips thereafter: set at a meta build, where nothing was initialised
_HF_DONE = "_is_hf_initialized"


def _check_resettable(modules: list[nn.Module], meta: Mapping[int, nn.Parameter]) -> None:
    missing: dict[str, list[str]] = {}
    for m in modules:
        own = [n for n, p in m.named_parameters(recurse=False) if id(p) in meta]
        if own and not callable(getattr(m, "reset_parameters", None)):
            missing.setdefault(type(m).__name__, own)
    if missing:
        shown = "; ".join(f"{k} ({', '.join(v)})" for k, v in missing.items())
        raise TypeError(
            f"the model was built on the meta device, and these modules hold parameters of "
            f"their own but have no reset_parameters() to initialise them: {shown}. Give each "
            "a reset_parameters() method, give the pipelined model an init_weights() method "
            "that initialises all of it, or start from saved weights "
            "(PipeMareStrategy(weights='one_device.pt'))"
        )


def init_method(root: nn.Module) -> str:
    """How a meta-built ``root`` is initialised: its own hook (:data:`INIT_HOOKS`) where it
    has one, else each module's ``reset_parameters()``."""
    for hook in INIT_HOOKS:
        if callable(getattr(root, hook, None)):
            return hook
    return "reset_parameters"


def load_stage_weights(
    path: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    wanted: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    strip: tuple[str, ...] = (),
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """Copy into each tensor of ``wanted`` (name -> this process's tensor, or pairs of them
    where one name fills several tensors: a tied weight and its copy on another stage) its
    value from ``path``, reading only those tensors: a safetensors file tensor by tensor, a
    ``torch.save`` file memory-mapped (``mmap=True``), so the other stages' bytes are never
    read.

    Args:
        path: a ``.safetensors`` file, or a ``torch.save`` of a state dict (a Lightning
            checkpoint's ``state_dict`` entry is found too), or a state dict in memory.
        wanted: the names (as the pipelined model names them) and tensors to fill.
        strip: prefixes that the file may leave off a name (the pipelined module's path in
            the LightningModule, for a file of that module's own state dict).
        aliases: other names of the same tensor, tried where the file lacks a name (a head
            tied to the embedding, which Hugging Face's ``save_pretrained`` leaves out).

    Returns:
        The names that were not in the file (their tensors are left as they are).
    """
    source: Callable[[str], torch.Tensor | None]
    if isinstance(path, Mapping):  # a state dict in memory (a checkpoint Lightning loaded)
        held = path
        path = "the checkpoint's state_dict"

        def source(key: str) -> torch.Tensor | None:
            value = held.get(key)
            return value if isinstance(value, torch.Tensor) else None

    elif (path := _weights_file(os.fspath(path))).endswith((".safetensors", ".index.json")):
        source = _safetensors_source(path)
    else:
        state: Any = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]

        def source(key: str) -> torch.Tensor | None:
            value = state.get(key)
            return value if isinstance(value, torch.Tensor) else None

    missing = []
    pairs = wanted.items() if isinstance(wanted, Mapping) else wanted
    with torch.no_grad():
        for name, tensor in pairs:
            names = [
                form
                for known in (name, *(aliases or {}).get(name, ()))
                for stripped in (known, *(known[len(p) :] for p in strip if known.startswith(p)))
                for form in dict.fromkeys((stripped, _base_name(stripped)))
            ]
            value = next((v for v in map(source, names) if v is not None), None)
            if value is None:
                if name not in missing:
                    missing.append(name)
                continue
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{path}: {name} has shape {tuple(value.shape)}, the model's is "
                    f"{tuple(tensor.shape)}; the file holds another model's weights"
                )
            tensor.copy_(value)
    return missing


def _weights_file(path: str) -> str:
    """A ``save_pretrained`` directory's weights: its sharded index, else its one file."""
    if not os.path.isdir(path):
        return path
    for name in ("model.safetensors.index.json", "model.safetensors"):
        if os.path.exists(os.path.join(path, name)):
            return os.path.join(path, name)
    raise ValueError(
        f"weights={path!r} is a directory without model.safetensors or "
        "model.safetensors.index.json; give a save_pretrained directory, a .safetensors file or "
        "a torch.save of a state dict"
    )


def _safetensors_source(path: str) -> Callable[[str], torch.Tensor | None]:
    """A tensor by name from a safetensors file, or from the shards a Hugging Face index
    (``model.safetensors.index.json``) maps names to: each shard opened on first use, and only
    the tensors asked for read from it."""
    from safetensors import safe_open

    if path.endswith(".index.json"):
        with open(path) as f:
            where = json.load(f)["weight_map"]
        folder = os.path.dirname(path)
    else:
        where = None
    handles: dict[str, tuple[Any, set[str]]] = {}

    def source(key: str) -> torch.Tensor | None:
        file = path if where is None else where.get(key)
        if file is None:
            return None
        if file not in handles:
            handle = safe_open(os.path.join(folder, file) if where else file, "pt")
            handles[file] = handle, set(handle.keys())
        handle, keys = handles[file]
        return handle.get_tensor(key) if key in keys else None

    return source


def _base_name(name: str) -> str:
    """The name a Hugging Face base model's file gives a tensor that ``peft`` wrapped:
    ``base_model.model.`` before it and ``.base_layer`` inside it left out."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model.") :]
    return name.replace(".base_layer.", ".")


#: set while pipemare itself reads a module's state dict, filling the other stages' tensors
_COLLECTING = contextvars.ContextVar("pipemare_collecting_state", default=False)


@contextlib.contextmanager
def whole_state_collected() -> Iterator[None]:
    """Around pipemare's own reading of a module whose other stages are on the meta device (a
    checkpoint gathers their values): :func:`warn_on_meta_state` stays quiet."""
    token = _COLLECTING.set(True)
    try:
        yield
    finally:
        _COLLECTING.reset(token)


def warn_on_meta_state(module: nn.Module, gather: str) -> Any:
    """Warn when ``module.state_dict()`` is taken while tensors of it are on the meta device:
    they hold no values, and ``torch.save`` would write them without a word.

    Args:
        module: a module this process holds only a stage of.
        gather: the call that gives the process the whole model, named in the warning.

    Returns:
        the hook's handle (``.remove()`` it once the module is whole again).
    """

    def warn(mod: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        if prefix or _COLLECTING.get():
            return  # a submodule of the module asked, or pipemare collecting the whole model
        empty = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_meta]
        if empty:
            said = text(
                "stage.state_dict",
                module=type(mod).__name__,
                empty=len(empty),
                total=len(state),
                first=empty[0],
                gather=gather,
            )
            warnings.warn(said, stacklevel=3)

    return module.register_state_dict_post_hook(warn)
