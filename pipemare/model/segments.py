"""Any module as an ``nn.Sequential`` of segments cut at its block boundaries, each reading the
user's own parameters and buffers (the same tensors, so ties and names survive)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import re
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import Dim, ExportedProgram
from torch.nn.modules.module import register_module_buffer_registration_hook
from torch.utils import _pytree as pytree

from pipemare.lines import text
from pipemare.model.blocks import Cut, as_cuts, block_cuts, pp_plan_cuts
from pipemare.model.graph_split import SegmentProgram, UncuttableModelError, split_program
from pipemare.model.traces import TRACES, trace_key

__all__ = [
    "DYNAMIC_SHAPES",
    "Segment",
    "SegmentedModule",
    "UncuttableModelError",
    "cache_off",
    "default_cuts",
    "export_module",
    "segment_module",
    "source_names",
]


#: which input sizes a traced module accepts changing (see :func:`segment_module`)
DYNAMIC_SHAPES = ("auto", "all")


class Segment(nn.Module):
    """One piece of a cut model. ``forward(values)`` takes the tuple of values live at its
    input cut (the first segment: the user's input tensors, flattened) and returns the tuple
    live at its output cut (the last: the model's own output structure).

    Its parameters and buffers are the user's own tensor objects, registered under the user's
    names; the train and eval graphs (traced separately) read them by those names at call time,
    so ``.to()`` and ``load_state_dict`` reach both.
    """

    def __init__(
        self,
        index: int,
        programs: dict[bool, SegmentProgram],
        tensors: dict[tuple[str, str], tuple[torch.Tensor, bool]],
        out_spec: pytree.TreeSpec | None,
        range_constraints: dict[bool, dict[Any, Any]] | None,
    ) -> None:
        super().__init__()
        self.index = index
        self._programs = programs
        self._out_spec = out_spec
        self._range_constraints = range_constraints
        self._register([key for p in programs.values() for key in p.state], tensors)
        self._slots: dict[bool, list[tuple[nn.Module, str]]] = {}

    def _register(
        self,
        keys: list[tuple[str, str]],
        tensors: dict[tuple[str, str], tuple[torch.Tensor, bool]],
    ) -> None:
        for key in sorted(set(keys)):
            tensor, persistent = tensors[key]
            kind, name = key
            owner, attr = self._holder(name if kind != "constant" else _constant_name(name))
            if kind == "parameter":
                if attr not in owner._parameters:
                    owner.register_parameter(attr, tensor)  # type: ignore[arg-type]
            elif not hasattr(owner, attr):
                owner.register_buffer(attr, tensor, persistent=persistent and kind == "buffer")

    #: what a copy shares with the original: the traced graphs (immutable once built; they
    #: hold fake tensors that cannot be copied) read the copy's own tensors through its slots
    _SHARED = ("_programs", "_out_spec", "_range_constraints")

    def __deepcopy__(self, memo: dict[int, Any]) -> Segment:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key in self._SHARED else copy.deepcopy(value, memo)
        return new

    def _holder(self, name: str) -> tuple[nn.Module, str]:
        """The module that holds ``name`` (created on first use) and the attribute name."""
        owner: nn.Module = self
        *path, attr = name.split(".")
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        return owner, attr

    def _program(self, mode: bool) -> SegmentProgram:
        program = self._programs.get(mode)
        if program is None:
            raise RuntimeError(
                "these segments were traced for training only (segment_module(..., "
                "eval_graph=False)); call SegmentedModule.trace_eval() before running them in "
                "eval mode"
            )
        return program

    def _state_slots(self, mode: bool) -> list[tuple[nn.Module, str]]:
        slots = self._slots.get(mode)
        if slots is None:
            state = self._program(mode).state
            slots = [self._holder(n if k != "constant" else _constant_name(n)) for k, n in state]
            missing = [
                n
                for (k, n), (owner, attr) in zip(state, slots, strict=True)
                if not hasattr(owner, attr)
            ]
            if missing:  # a copy made before trace_eval added what only eval mode reads
                raise RuntimeError(
                    f"segment {self.index} was copied before its eval graph was traced, and "
                    f"that graph reads {', '.join(missing)}, which the copy does not hold; call "
                    "SegmentedModule.trace_eval() before copying the segments"
                )
            self._slots[mode] = slots
        return slots

    def _add_eval(
        self,
        program: SegmentProgram,
        tensors: dict[tuple[str, str], tuple[torch.Tensor, bool]],
        constraints: dict[Any, Any],
    ) -> None:
        """Take the eval-mode graph traced after the cut (:meth:`SegmentedModule.trace_eval`),
        registering what only it reads; copies share the graphs, so they see it too."""
        self._register(program.state, tensors)
        self._programs[False] = program
        if self._range_constraints is not None:
            self._range_constraints[False] = constraints

    def forward(self, values: Any) -> Any:
        program = self._program(self.training)
        values = (values,) if isinstance(values, torch.Tensor) else tuple(values)
        if len(values) != len(program.inputs):
            raise ValueError(
                f"segment {self.index} takes {len(program.inputs)} values "
                f"({', '.join(program.inputs)}), got {len(values)}"
            )
        if self._range_constraints is not None:
            _check_shapes(program, values, self._range_constraints[self.training])
        state = [getattr(owner, attr) for owner, attr in self._state_slots(self.training)]
        out = program.graph_module(*state, *values)
        if self._out_spec is not None:
            return pytree.tree_unflatten(list(out), self._out_spec)
        return tuple(out)

    def extra_repr(self) -> str:
        program = self._programs.get(self.training, self._programs[True])
        return f"index={self.index}, inputs={program.inputs}, outputs={program.outputs}"


def _constant_name(name: str) -> str:
    return "_constants." + name.replace(".", "_")


def _check_shapes(program: SegmentProgram, values: tuple, constraints: dict[Any, Any]) -> None:
    """The first segment refuses inputs whose shapes the trace does not cover (else a shape the
    model branches on could silently take the traced branch)."""
    from torch._export.utils import _check_input_constraints_for_graph

    flat: list[Any] = [((pytree.SequenceKey(i),), v) for i, v in enumerate(values)]
    try:
        _check_input_constraints_for_graph(program.input_nodes, flat, constraints)
    except RuntimeError as err:
        raise ValueError(
            f"the model was cut for inputs of other shapes: {err}. Only the batch and the "
            "sequence length may vary by default; for other sizes (images' height and width) "
            "cut it with dynamic='all' (PipeMareStrategy(dynamic_shapes='all'), "
            "segment_module(..., dynamic='all')), or with example inputs of the shapes it will "
            "see"
        ) from err


class SegmentedModule(nn.Sequential):
    """A module cut into segments; ``self(self.flatten_inputs(*args, **kwargs))`` equals
    ``module(*args, **kwargs)``. Attributes: ``cuts`` (the cuts taken, in order),
    ``call_defaults`` (keyword arguments every call gets unless it passes its own, e.g.
    ``{"use_cache": False}``: see :func:`cache_off`)."""

    def __init__(
        self,
        segments: list[Segment],
        cuts: list[Cut],
        in_spec: pytree.TreeSpec,
        constants: list[Any],
        signature: tuple[list[str], int],
        call_defaults: dict[str, Any] | None = None,
        traced: _Traced | None = None,
        source: nn.Module | None = None,
    ) -> None:
        super().__init__(*segments)
        self.call_defaults = dict(call_defaults or {})
        # the cut and the module it was bound to, for trace_eval (a weak reference: the
        # segments do not keep the user's module alive, and a copy traces from the same one)
        self._traced = traced
        self._source = weakref.ref(source) if source is not None else None
        self._positional, self._num_args = signature  # parameter names; how many came by position
        self.cuts = cuts
        self._in_spec = in_spec
        self._constants = constants  # the non-tensor inputs the trace baked in (None: a tensor)

    def _as_traced(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments passed positionally or by keyword as the example passed them."""
        given, kwargs, names = list(args), dict(kwargs), self._positional
        while len(given) > self._num_args and len(given) <= len(names):
            name = names[len(given) - 1]
            kwargs[name] = given.pop()
        while len(given) < min(self._num_args, len(names)) and names[len(given)] in kwargs:
            given.append(kwargs.pop(names[len(given)]))
        return tuple(given), kwargs

    def flatten_inputs(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        """The user's call arguments as the first segment's input: their tensors, flattened.

        Raises:
            ValueError: the arguments differ in structure, or in a non-tensor value, from the
                example the model was cut with.
        """
        from torch.export._tree_utils import reorder_kwargs

        args, kwargs = self._as_traced(args, {**self.call_defaults, **kwargs})
        with contextlib.suppress(ValueError):  # the spec check below says what differs
            kwargs = reorder_kwargs(kwargs, self._in_spec)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise ValueError(
                f"the segments were cut for arguments shaped {self._in_spec}, got {spec}; "
                "cut the model again with example arguments like the ones you pass"
            )
        for leaf, baked in zip(leaves, self._constants, strict=True):
            if baked is not None and not isinstance(leaf, torch.Tensor) and leaf != baked:
                raise ValueError(
                    f"argument value {leaf!r} differs from {baked!r}, which the segments were "
                    "cut with (non-tensor arguments are baked into the traced graph); cut the "
                    "model again with this value, or pass it as a tensor"
                )
        return tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    def accepts(self, *args: Any, **kwargs: Any) -> bool:
        """Whether the segments take this call (its structure, values and sizes) in every mode
        they were traced in."""
        try:
            values = self.flatten_inputs(*args, **kwargs)
            first: Segment = self[0]  # type: ignore[assignment]
            constraints = first._range_constraints or {}
            for mode, program in first._programs.items():
                _check_shapes(program, values, constraints[mode])
        except ValueError:
            return False
        return True

    @property
    def has_eval_graph(self) -> bool:
        """Whether the eval-mode graphs are traced (see :meth:`trace_eval`)."""
        first: Segment = self[0]  # type: ignore[assignment]
        return False in first._programs

    def trace_eval(self) -> None:
        """Trace the eval-mode graphs now, for segments cut with ``eval_graph=False``
        (nothing to do otherwise): from the module they were cut from, with the example it was
        cut with, at the same cuts; what only eval mode reads is registered as at the cut.

        Raises:
            UncuttableModelError: eval mode cannot be traced, or cuts into a different number
                of segments.
            RuntimeError: the module the segments were cut from is gone.
        """
        if self.has_eval_graph:
            return
        module = self._source() if self._source is not None else None
        if self._traced is None or module is None:
            raise RuntimeError(
                "the module these segments were cut from is gone, so their eval graphs cannot "
                "be traced; cut it again with segment_module(..., eval_graph=True)"
            )
        with torch.inference_mode(False), torch.enable_grad():
            self._traced.add_eval(module)
        self._traced.install_eval(self, module)


def _dynamic_shapes(
    module: nn.Module, args: tuple, kwargs: dict, every: bool = False
) -> dict[str, Any]:
    """Which sizes may vary between calls (``Dim.AUTO``): the batch of every tensor argument
    (microbatches differ in size from the example batch) and the sequence length of token-like
    ones (token ids, masks and labels, rank 1 or 2; embeddings ``(batch, length, width)``), as
    padding to each batch's longest sequence needs; with ``every``, every size. Images and other
    inputs of rank 4 or more keep their other sizes by default: making them symbolic costs a
    windowed vision transformer's trace minutes (a tiny Swin: 87 s against 2 s on torch 2.13)."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments

    def spec(x: Any) -> Any:
        return {d: Dim.AUTO for d in _varying(x, every)} if isinstance(x, torch.Tensor) else None

    return {name: pytree.tree_map(spec, value) for name, value in bound.items()}


def _varying(x: torch.Tensor, every: bool) -> Sequence[int]:
    """The sizes of input ``x`` a trace lets vary (:func:`_dynamic_shapes`)."""
    return range(x.dim()) if every or x.dim() <= 2 else (0, 1) if x.dim() == 3 else (0,)


@contextlib.contextmanager
def _keywords_named(module: nn.Module, kwargs: dict) -> Any:
    """While open, ``module.forward`` names each keyword the call passes into its ``**kwargs``
    as a parameter of its own (the call itself unchanged). ``torch.export`` then sees one
    argument per keyword: given dynamic shapes, torch 2.13 files a ``**kwargs`` forward's
    keywords both under the ``**kwargs`` name and at the top level, and refuses every such
    trace as a mismatch (measured: a two-line ``forward(self, **kw)`` wrapper, and
    ``peft``'s ``PeftModel``)."""
    signature = inspect.signature(module.forward)
    params = list(signature.parameters.values())
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    extra = [name for name in kwargs if name not in named]
    if not extra or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        yield
        return
    own = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in extra]
    bound = module.forward

    def forward(*args: Any, **kw: Any) -> Any:
        return bound(*args, **kw)

    forward.__signature__ = signature.replace(parameters=params[:-1] + own)  # type: ignore[attr-defined]
    missing = object()
    before = module.__dict__.get("forward", missing)  # a hook's own forward (accelerate)
    module.forward = forward
    try:
        yield
    finally:
        if before is missing:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = before


def export_module(
    module: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    training: bool = True,
    dynamic: str = "auto",
    stack_traces: bool = True,
) -> ExportedProgram:
    """Trace ``module`` in train or eval mode with ``torch.export`` (non-strict; the sizes
    ``dynamic`` names may vary where the model allows, else the example's sizes are fixed).
    Without ``stack_traces`` the graph's nodes keep no source lines (``stack_trace``), which
    saves a share of the trace's time (:func:`_export_and_cut`).

    Raises:
        UncuttableModelError: the forward cannot be traced into one graph; the message names
            the construct and the user's line.
    """
    kwargs = dict(kwargs or {})
    was_training = module.training
    module.train(training)
    names = {id(m): name for name, m in module.named_modules()}
    assigned: list[str] = []

    def traced_assignment(owner: nn.Module, name: str, value: Any) -> None:
        # A traced value set as a buffer: the forward runs `self.buf = ...`, which the exported
        # graph drops (measured on torch 2.13); in-place updates are kept.
        if isinstance(value, FakeTensor) and id(owner) in names:
            assigned.append(".".join(filter(None, (names[id(owner)], name))))

    hook = register_module_buffer_registration_hook(traced_assignment)
    skip_lines = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = skip_lines or not stack_traces
    try:
        with _keywords_named(module, kwargs):
            try:
                shapes = _dynamic_shapes(module, args, kwargs, every=dynamic == "all")
                ep = torch.export.export(module, args, kwargs, strict=False, dynamic_shapes=shapes)
            except Exception as dynamic_err:
                if _CACHE_OUTPUT.search(str(dynamic_err)):
                    raise  # the output's kind, not a size: a trace of fixed sizes fails alike
                assigned.clear()
                ep = torch.export.export(module, args, kwargs, strict=False)
                _warn_static(module, f"{type(dynamic_err).__name__}: {dynamic_err}")
            else:
                if _batch_fixed(ep):
                    _warn_static(module, "its forward fixes the batch size (a reshape or a "
                                 "size written into the model)")  # fmt: skip
    except Exception as err:
        message, quotes_trace = _explain(err, module, args, kwargs)
        refusal = UncuttableModelError(message)
        refusal.quotes_trace = quotes_trace
        raise refusal from err
    finally:
        torch.fx.config.do_not_emit_stack_traces = skip_lines
        hook.remove()
        module.train(was_training)
    if assigned:
        raise UncuttableModelError(
            f"{type(module).__name__}'s forward assigns a new tensor to buffer "
            f"{', '.join(sorted(set(assigned)))} (`self.buf = ...`), an update a traced graph "
            "loses. Update the buffer in place instead: `self.buf.copy_(...)` or "
            "`self.buf.mul_(m).add_(...)` under torch.no_grad()"
        )
    return ep


def _batch_fixed(ep: ExportedProgram) -> bool:
    """Whether the trace fixed the batch: no tensor input's first size stayed symbolic (a size
    the forward pins is still a ``SymInt``, of a constant value)."""
    firsts = [
        node.meta["val"].shape[0]
        for node in ep.graph.nodes
        if node.op == "placeholder"
        and node.name in ep.graph_signature.user_inputs
        and isinstance(node.meta.get("val"), torch.Tensor)
        and node.meta["val"].dim() > 0
    ]
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return bool(firsts) and all(is_concrete_int(size) for size in firsts)


#: while a cut traces, the warnings :func:`_warn_static` gave (a reuse of the trace repeats them)
_warned: list[str] | None = None


def _warn_static(module: nn.Module, reason: str) -> None:
    """Say that ``module`` was traced for the example's sizes only, and why."""
    reason = " ".join(reason.split())[:300]
    said = text("trace.static", module=type(module).__name__, reason=reason)
    if _warned is not None:
        _warned.append(said)
    warnings.warn(said, stacklevel=3)


def _eager_error(module: nn.Module, args: tuple, kwargs: dict) -> Exception | None:
    """What the module's own forward raises on the example (run once, without gradients, on
    copies of the arguments, its random state kept), or None: then the trace is at fault."""
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), (args, kwargs))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            module(*args, **kwargs)
    except Exception as err:
        return err
    return None


def _cache_receiver(module: nn.Module) -> tuple[nn.Module, inspect.Parameter] | None:
    """The module whose forward decides ``use_cache`` for a call to ``module``, and that
    parameter: ``module`` itself where its forward names it, else the first module (nearest
    first) reached through forwards that take ``**kwargs`` and so pass it on (``peft``'s
    ``PeftModel`` to its ``LoraModel`` to the Hugging Face model; a wrapper of the user's own
    whose ``forward(self, **kw)`` calls ``self.model(**kw)``); None where no such module is."""
    frontier = [module]
    while frontier:
        deeper: list[nn.Module] = []
        for candidate in frontier:
            params = inspect.signature(candidate.forward).parameters
            if "use_cache" in params:
                return candidate, params["use_cache"]
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                deeper.extend(candidate.children())
        frontier = deeper
    return None


def cache_off(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``{"use_cache": False}`` where ``module`` would build a key/value cache for generation
    and the call leaves ``use_cache`` to it (Hugging Face's causal LMs and encoder–decoders:
    ``config.use_cache`` is True as they ship), directly or through wrappers whose forward
    passes ``**kwargs`` on (``peft``'s adapters); else ``{}``. A cache cannot travel between
    stages, and training does not read it; the config keeps its setting (Hugging Face's
    gradient checkpointing switches it off per call the same way). Models that cannot generate
    (a classifier whose config carries ``use_cache`` anyway) are left alone."""
    found = _cache_receiver(module)
    if "use_cache" in kwargs or found is None:
        return {}
    receiver, named = found
    can_generate = getattr(receiver, "can_generate", None)
    if callable(can_generate) and not can_generate():
        return {}
    config = getattr(receiver, "config", None)
    if named.default is None and config is not None:  # Hugging Face: None defers to the config
        wanted = bool(getattr(config, "use_cache", False))
    else:
        wanted = named.default is True
    return {"use_cache": False} if wanted else {}


#: a trace refused for the key/value cache its forward returns (:func:`_explain`)
_CACHE_OUTPUT = re.compile(r"Found <class '[\w.]*(cache_utils\.\w+|Cache)'> in output")


def _explain(err: Exception, module: nn.Module, args: tuple, kwargs: dict) -> tuple[str, bool]:
    """The refusal's message, and whether it quotes the trace (the user's line where it failed):
    only then would a trace again with the graph's source lines (:func:`_export_and_cut`) say
    more."""
    message = str(err)
    found = re.search(r"The following call raised this error:\n(.*?)\n\n", message, re.S)
    where = " ".join(found.group(1).split()) if found else message.strip().splitlines()[0][:300]
    name = type(module).__name__
    if _CACHE_OUTPUT.search(message):
        return (
            f"cannot cut {name} into segments: its forward returns a key/value cache for "
            "generation, which cannot travel between stages. Leave use_cache out of the call "
            "(pipemare then switches the cache off for the pipelined calls, as Hugging Face's "
            "gradient checkpointing does) or pass use_cache=False"
        ), False
    own = _eager_error(module, args, kwargs)
    if own is not None:
        return (
            f"cannot cut {name} into segments: its forward fails on the example batch on its "
            f"own, before any cut: {type(own).__name__}: {own}. Fix the model or its "
            "configuration; pipemare runs it as it is"
        ), False
    data_dependent = "data-dependent" in message or "GuardOnDataDependent" in type(err).__name__
    construct = (
        "data-dependent control flow (a Python branch, loop or .item() on a tensor's values)"
        if data_dependent
        else f"a construct torch.export cannot capture ({type(err).__name__})"
    )
    return (
        f"cannot cut {type(module).__name__} into segments: its forward has {construct} at "
        f"{where}. pipemare traces the forward into one graph to cut it. Express it with "
        "tensor operations (torch.where, torch.cond), make it depend on shapes only, or move "
        "it out of the pipelined module into the step before or after the call"
    ), True


def _state_names(module: nn.Module, eps: list[ExportedProgram]) -> list[tuple[str, str, Any]]:
    """Every state name the traced graphs read, and for a constant the forward makes itself
    (not an attribute of the module) the trace's tensor."""
    found: dict[tuple[str, str], Any] = {}
    for ep in eps:
        for kind, name in {k for p in ep.graph_signature.input_specs for k in [_key(p)] if k}:
            owner_name, _, attr = name.rpartition(".")
            own = getattr(module.get_submodule(owner_name), attr, None)
            made = kind == "constant" and not isinstance(own, torch.Tensor)
            found[(kind, name)] = ep.constants[name] if made else None
    return [(kind, name, made) for (kind, name), made in sorted(found.items())]


def _key(spec: Any) -> tuple[str, str] | None:
    kinds = {"PARAMETER": "parameter", "BUFFER": "buffer", "CONSTANT_TENSOR": "constant"}
    return (kinds[spec.kind.name], spec.target) if spec.kind.name in kinds else None


def source_names(segments: nn.Sequential) -> dict[str, str]:
    """Each parameter's and persistent buffer's key in ``segments.state_dict()`` mapped to its
    key in the user module's own ``state_dict()`` (``"3.transformer.h.2.ln_1.weight"`` to
    ``"transformer.h.2.ln_1.weight"``); a tied tensor appears once per segment holding it."""
    out = {}
    for key in segments.state_dict(keep_vars=True):
        name = key.partition(".")[2]
        if not name.startswith("_constants."):
            out[key] = name
    return out


def segment_module(
    module: nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    split_points: Sequence[str | Cut] | None = None,
    dynamic: str = "auto",
    eval_graph: bool = True,
) -> SegmentedModule:
    """Cut ``module`` into segments at its block boundaries (or before the named modules).

    Args:
        module: any module whose forward ``torch.export`` can trace; it is not changed.
        args: example positional arguments for ``module(*args, **kwargs)``: a batch of at
            least 2.
        kwargs: example keyword arguments, likewise.
        split_points: module names, each a cut before that module (``"transformer.h.2"``), or
            :class:`Cut`s. By default, the model's own pipeline plan (Hugging Face
            ``_pp_plan``) where it ships one, else around each of its repeated blocks.
        dynamic: which input sizes may differ from the example's: ``"auto"`` the batch, and the
            length of token-like inputs (rank 1 to 3); ``"all"`` every size, images' too.
        eval_graph: trace the eval-mode graph now as well (a second ``torch.export``, about
            as long as the first). False traces it when
            :meth:`SegmentedModule.trace_eval` is called; until then the segments run in
            train mode only (what a fit without validation needs).

    A module that builds a key/value cache for generation (Hugging Face's causal LMs and
    encoder–decoders, ``config.use_cache`` True as they ship) is traced and called with
    ``use_cache=False`` unless the call passes ``use_cache`` itself
    (:attr:`SegmentedModule.call_defaults`, :func:`cache_off`).

    Returns:
        A :class:`SegmentedModule` whose segments share the module's parameters and buffers.

    Raises:
        UncuttableModelError: the forward cannot be traced, or cut where asked.

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        ...     def forward(self, x):
        ...         for block in self.blocks:
        ...             x = torch.relu(block(x))
        ...         return x
        >>> net, x = Net(), torch.randn(2, 4)
        >>> seg = segment_module(net, (x,))
        >>> [("after " if cut.after else "before ") + cut.module for cut in seg.cuts]
        ['before blocks.0', 'before blocks.1', 'before blocks.2', 'after blocks.2']
        >>> len(seg)  # the last relu runs after blocks.2: a segment of its own
        4
        >>> torch.equal(seg(seg.flatten_inputs(x)), net(x))
        True
    """
    # Traced as for training whatever mode the caller is in (a validation's inference mode, a
    # no_grad block): every call of the segments runs the same graphs, as fit's, and a kept
    # trace serves fit, validate and test alike.
    with torch.inference_mode(False), torch.enable_grad():
        return _segment(module, args, kwargs, split_points, dynamic, eval_graph)


def default_cuts(module: nn.Module) -> list[Cut]:
    """Where :func:`segment_module` cuts ``module`` unless told: the model's own pipeline plan
    (Hugging Face ``_pp_plan``) where it ships one, else around each of its repeated blocks."""
    return pp_plan_cuts(module) or block_cuts(module)


def _segment(
    module: nn.Module,
    args: tuple,
    kwargs: dict | None,
    split_points: Sequence[str | Cut] | None,
    dynamic: str,
    eval_graph: bool,
) -> SegmentedModule:
    # Fresh copies: export traces an input passed twice (or a view of another) as one value, and
    # the graph would then read the wrong argument once they differ.
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().clone(), (tuple(args), dict(kwargs or {}))
    )
    defaults = cache_off(module, kwargs)
    kwargs = {**defaults, **kwargs}
    cuts = default_cuts(module) if split_points is None else as_cuts(split_points)
    if dynamic not in DYNAMIC_SHAPES:
        raise ValueError(f"dynamic must be one of {DYNAMIC_SHAPES}, got {dynamic!r}")
    options: tuple[Any, ...] = (tuple(cuts), dynamic, tuple(sorted(defaults.items())))
    on_meta = any(p.is_meta for p in module.parameters())
    if on_meta:
        # built on the meta device: traced there, every tensor on meta (the key too: a
        # rebuild after a run, with this process's stage real, takes the same graphs), and
        # kept for the device the inputs came on, which the graphs name
        options = (*options, ("meta", str(_inputs_device(args, kwargs))))
    with _all_on_meta(module) if on_meta else contextlib.nullcontext():
        key = trace_key(module, args, kwargs, options, lambda x: _varying(x, dynamic == "all"))
    kept = TRACES.get(key) if key is not None else None
    if kept is not None:
        segmented = kept.bind(module)
        if segmented.accepts(*args, **kwargs):  # else the trace fixed a size that differs
            TRACES.hits += 1
            for message in kept.warned:
                warnings.warn(message, stacklevel=2)
            if eval_graph:  # kept from a cut made for training only: its eval graphs now
                segmented.trace_eval()
            return segmented
    if on_meta:
        traced = _trace_on_meta(module, args, kwargs, cuts, dynamic, defaults, eval_graph)
    else:
        traced = _trace(module, args, kwargs, cuts, dynamic, defaults, eval_graph)
    if key is not None:
        TRACES.misses += 1
        TRACES.put(key, traced)
    return traced.bind(module)


def _trace_on_meta(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    cuts: list[Cut],
    dynamic: str,
    defaults: dict[str, Any],
    eval_graph: bool,
) -> _Traced:
    """Trace a module whose parameters are on the meta device (built in ``configure_model``):
    the inputs and, for the trace only, every real parameter and buffer (a rebuild after a run
    finds this process's stage real) go to the meta device too, so that no weight is needed;
    the graphs then make the tensors they create (``torch.arange(..., device=x.device)``) on
    the device the real inputs came on, and read the module's own tensors when called."""
    device = _inputs_device(args, kwargs)
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: torch.empty_like(t, device="meta"), (args, kwargs)
    )
    with _all_on_meta(module):
        traced = _trace(module, args, kwargs, cuts, dynamic, defaults, eval_graph)
    _check_made_on_meta(module, traced.state)
    for programs in traced.programs.values():
        for program in programs:
            _move_created(program.graph_module, torch.device("meta"), device)
    return dataclasses.replace(traced, on_meta=True, device=device)


def _check_made_on_meta(module: nn.Module, state: list[tuple[str, str, Any]]) -> None:
    made = [name for kind, name, tensor in state if tensor is not None and tensor.is_meta]
    if made:
        raise UncuttableModelError(
            f"{type(module).__name__} was built on the meta device, and its forward makes "
            f"tensor constant(s) {', '.join(made)} that a trace there cannot give values to; "
            "build the model in __init__ (each process then moves only its own stage), or "
            "register them as buffers in __init__"
        )


def _inputs_device(args: tuple, kwargs: dict) -> torch.device:
    """The device of the call's first tensor (the CPU without one): where a trace made on
    the meta device makes its tensors."""
    tensors = (t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    return next((t.device for t in tensors), torch.device("cpu"))


@contextlib.contextmanager
def _all_on_meta(module: nn.Module) -> Iterator[None]:
    """Every parameter and buffer of ``module`` on the meta device for the block (a rebuild
    after a run finds this process's stage real and the others on meta), put back after; a
    tensor held in two places stays one."""
    held: list[tuple[dict[str, Any], str, torch.Tensor]] = [
        (store, name, t)
        for m in module.modules()
        for store in (m._parameters, m._buffers)
        for name, t in store.items()
        if t is not None and not t.is_meta
    ]
    stand_ins: dict[int, torch.Tensor] = {}
    for store, name, t in held:
        if id(t) not in stand_ins:
            meta = t.detach().to("meta")
            is_param = isinstance(t, nn.Parameter)
            stand_ins[id(t)] = nn.Parameter(meta, t.requires_grad) if is_param else meta
        store[name] = stand_ins[id(t)]
    try:
        yield
    finally:
        for store, name, t in held:
            store[name] = t


def _move_created(gm: torch.fx.GraphModule, old: torch.device, new: torch.device) -> None:
    """Make the tensors ``gm`` creates on ``old`` (a ``device=`` argument) on ``new``."""
    changed = False
    for node in gm.graph.nodes:
        if node.kwargs.get("device") == old:
            node.kwargs = {**node.kwargs, "device": new}
            changed = True
        if any(isinstance(a, torch.device) and a == old for a in node.args):
            node.args = tuple(
                new if isinstance(a, torch.device) and a == old else a for a in node.args
            )
            changed = True
    if changed:
        gm.recompile()


@dataclasses.dataclass(frozen=True)
class _Traced:
    """A module's cut, apart from its tensors: bound to a module (the traced one, or another
    with the same :func:`~pipemare.model.traces.trace_key`) it gives its segments."""

    programs: dict[bool, list[SegmentProgram]]
    #: every state name the graphs read: kind, name, and the trace's own tensor for a constant
    #: the forward makes (None: the module's tensor of that name)
    state: list[tuple[str, str, torch.Tensor | None]]
    out_spec: pytree.TreeSpec
    range_constraints: dict[bool, dict[Any, Any]]
    in_spec: pytree.TreeSpec
    baked: list[Any]
    signature: tuple[list[str], int]
    cuts: list[Cut]
    defaults: dict[str, Any]
    #: what tracing warned (:func:`_warn_static`)
    warned: tuple[str, ...] = ()
    #: for an eval graph traced later (``eval_graph=False``): the example call (its tensors on
    #: the meta device where the module was traced there), until :meth:`add_eval` uses it
    example: list[Any] = dataclasses.field(default_factory=list)
    dynamic: str = "auto"
    #: traced on the meta device; the device its graphs make their tensors on
    on_meta: bool = False
    device: torch.device | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> _Traced:
        return self  # immutable once traced, apart from the eval graphs added to it (shared)

    def _tensors(self, module: nn.Module) -> dict[tuple[str, str], Any]:
        tensors: dict[tuple[str, str], Any] = {}
        for kind, name, made in self.state:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            tensor = getattr(owner, attr, None) if made is None else made
            persistent = attr not in getattr(owner, "_non_persistent_buffers_set", set())
            tensors[(kind, name)] = (tensor, persistent)
        return tensors

    def bind(self, module: nn.Module) -> SegmentedModule:
        tensors = self._tensors(module)
        n = len(self.programs[True])
        segments = [
            Segment(
                i,
                {mode: programs[i] for mode, programs in self.programs.items()},
                tensors,
                self.out_spec if i == n - 1 else None,
                dict(self.range_constraints) if i == 0 else None,
            )
            for i in range(n)
        ]
        return SegmentedModule(
            segments,
            self.cuts,
            self.in_spec,
            self.baked,
            self.signature,
            self.defaults,
            traced=self,
            source=module,
        )

    def add_eval(self, module: nn.Module) -> None:
        """Trace ``module`` (this cut's, or one with its trace key) in eval mode and cut that
        graph as the train graph was; kept here, so later binds take it at once."""
        if False in self.programs:
            return
        args, kwargs = self.example
        with _all_on_meta(module) if self.on_meta else contextlib.nullcontext():
            ep, programs = _export_and_cut(module, args, kwargs, self.cuts, False, self.dynamic)
            state = _state_names(module, [ep])
        if len(programs) != len(self.programs[True]):
            raise UncuttableModelError(
                f"the cuts give {len(self.programs[True])} segments in train mode but "
                f"{len(programs)} in eval mode; choose split points whose modules run in both"
            )
        if self.on_meta:
            assert self.device is not None
            _check_made_on_meta(module, state)
            for program in programs:
                _move_created(program.graph_module, torch.device("meta"), self.device)
        known = {(kind, name) for kind, name, _ in self.state}
        self.state.extend(entry for entry in state if (entry[0], entry[1]) not in known)
        self.range_constraints[False] = ep.range_constraints
        self.programs[False] = programs
        self.example.clear()

    def install_eval(self, segmented: SegmentedModule, module: nn.Module) -> None:
        """Give ``segmented`` (bound to ``module``) the eval graphs :meth:`add_eval` traced."""
        tensors = self._tensors(module)
        for i, segment in enumerate(segmented):
            assert isinstance(segment, Segment)
            segment._add_eval(self.programs[False][i], tensors, self.range_constraints[False])


def _cut_program(ep: ExportedProgram, cuts: list[Cut], training: bool) -> list[SegmentProgram]:
    """``ep`` cut at ``cuts``; a cut the eval-mode graph cannot take says so (its module may
    run in train mode only)."""
    try:
        return split_program(ep, cuts)
    except UncuttableModelError as err:
        if training:
            raise
        raise UncuttableModelError(
            f"in eval mode: {err} (the train-mode graph took this cut; choose split points "
            "whose modules run in both modes)"
        ) from err


def _export_and_cut(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    cuts: list[Cut],
    training: bool,
    dynamic: str,
) -> tuple[ExportedProgram, list[SegmentProgram]]:
    """Trace ``module`` in one mode and cut its graph at ``cuts``. The trace keeps no source
    lines: recording one per graph node took 8-22% of a Hugging Face model's trace (the median
    CPU time of five traces each of GPT-2, Qwen3, T5 and BART of two blocks; torch 2.13, this
    project's CPUs). Only errors quote them, so where the trace or the cut fails it is made
    again with them, and that error is raised (unless the refusal quotes no line)."""
    try:
        ep = export_module(
            module, args, kwargs, training=training, dynamic=dynamic, stack_traces=False
        )
        return ep, _cut_program(ep, cuts, training)
    except UncuttableModelError as err:
        if not err.quotes_trace:  # the same words again: nothing to add
            raise
        ep = export_module(module, args, kwargs, training=training, dynamic=dynamic)
        return ep, _cut_program(ep, cuts, training)


def _trace(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    cuts: list[Cut],
    dynamic: str,
    defaults: dict[str, Any],
    eval_graph: bool = True,
) -> _Traced:
    """Trace ``module`` in train and eval mode (train mode only without ``eval_graph``) and
    cut each graph at ``cuts``."""
    global _warned
    warned: list[str] = []
    _warned = warned
    eps: dict[bool, ExportedProgram] = {}
    programs: dict[bool, list[SegmentProgram]] = {}
    try:
        for mode in (True, False) if eval_graph else (True,):
            eps[mode], programs[mode] = _export_and_cut(module, args, kwargs, cuts, mode, dynamic)
    finally:
        _warned = None
    if eval_graph and len(programs[True]) != len(programs[False]):
        raise UncuttableModelError(
            f"the cuts give {len(programs[True])} segments in train mode but "
            f"{len(programs[False])} in eval mode; choose split points whose modules run in both"
        )
    from torch.export._tree_utils import reorder_kwargs

    in_spec = eps[True].call_spec.in_spec
    leaves = pytree.tree_leaves((args, reorder_kwargs(kwargs, in_spec)))
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(module.forward).parameters.values()
    return _Traced(
        programs=programs,
        state=_state_names(module, list(eps.values())),
        out_spec=eps[True].call_spec.out_spec,
        range_constraints={mode: ep.range_constraints for mode, ep in eps.items()},
        in_spec=in_spec,
        baked=[None if isinstance(x, torch.Tensor) else x for x in leaves],
        signature=([p.name for p in params if p.kind in kinds], len(args)),
        cuts=list(cuts),
        defaults=defaults,
        warned=tuple(warned),
        example=[] if eval_graph else [args, kwargs],
        dynamic=dynamic,
    )
