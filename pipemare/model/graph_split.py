"""Cutting an exported graph into segments at module boundaries: which operations each segment
runs, which of the model's tensors it reads, and which values cross each cut."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from pipemare.model.blocks import Cut

__all__ = ["SegmentProgram", "UncuttableModelError", "cut_positions", "split_program"]

_STATE_KINDS = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
}


_SIZE_OPS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default}


class UncuttableModelError(ValueError):
    """The model cannot be cut into segments as asked; the message says why, where, and what
    to do instead."""

    #: whether the message quotes the trace (the user's line where it failed); a refusal that
    #: does not would say the same after a trace with the graph's source lines
    quotes_trace: bool = True


@dataclass
class SegmentProgram:
    """One segment of one traced mode (train or eval).

    ``graph_module(*state, *inputs)`` returns the values live after the segment (a tuple), or for
    the last segment the flat user outputs. ``state`` lists ``(kind, name)`` of the model's
    tensors it reads, in order: kind is ``"parameter"``, ``"buffer"`` or ``"constant"``.
    """

    graph_module: fx.GraphModule
    state: list[tuple[str, str]]
    inputs: list[str]
    outputs: list[str]
    input_nodes: list[fx.Node] = field(default_factory=list)  # first segment: for shape checks


def _box(value: Any) -> torch.Tensor:
    """A symbolic size crossing a cut travels as a 0-d tensor (the payload holds tensors only)."""
    return torch.tensor(value)


def _unbox(value: torch.Tensor) -> Any:
    return value.item()


def _write_back(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Apply a buffer update the traced graph returned instead of doing in place."""
    with torch.no_grad():
        buffer.copy_(value)


def _where(node: fx.Node) -> str:
    """The user's source line that produced ``node``, from the trace's stack (last frame)."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    lines = [line.strip() for line in trace if line.strip()]
    return " / ".join(lines[-2:]) if lines else f"graph node {node.name}"


def _module_paths(node: fx.Node) -> list[tuple[str, str]]:
    """(call key, module path) of every module ``node`` runs inside, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(key, path) for key, (path, _) in stack.items()]


def _is_sym(value: Any) -> bool:
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def cut_positions(compute: list[fx.Node], cuts: Sequence[Cut]) -> list[int]:
    """Where each cut falls in the graph's operation order (sorted, empty segments dropped).

    Raises:
        UncuttableModelError: a cut names a module that runs no operation, or a module whose
            calls fall on both sides of a cut (a block reused).
    """
    # per named module, in graph order: each of its operations' position -> the call it is in
    runs: dict[str, dict[int, str]] = {cut.module: {} for cut in cuts}
    for i, node in enumerate(compute):
        for key, path in _module_paths(node):
            if path in runs:
                runs[path][i] = key
    positions = set()
    for cut in cuts:
        if not runs[cut.module]:
            raise UncuttableModelError(
                f"split point {cut.module!r} names no module that runs in the model's forward "
                "(a misspelt name, a module that is never called, or one that computes nothing); "
                "name a module the forward calls, e.g. one of its blocks"
            )
        at = max(runs[cut.module]) + 1 if cut.after else min(runs[cut.module])
        if 0 < at < len(compute):
            positions.add(at)
    cuts_at = sorted(positions)
    for cut in cuts:
        # One call of the module may span cuts (another cut falls inside it: an attention
        # sublayer and an MLP sublayer on two stages); two calls on two sides of a cut may not
        ops = runs[cut.module]
        first = min(ops)
        segment = {i: bisect.bisect_right(cuts_at, i) for i in ops}
        reused = [i for i in ops if ops[i] != ops[first] and segment[i] != segment[first]]
        if reused:
            again = compute[reused[0]]
            raise UncuttableModelError(
                f"module {cut.module!r} is called more than once and its calls fall on both sides "
                f"of a cut (first at {_where(compute[first])}; again at {_where(again)}): the cut "
                f"{cut} is ambiguous. Cut at a module the forward calls once, or drop this split "
                "point so that all calls of the module stay in one segment"
            )
    return cuts_at


@dataclass
class _Graph:
    """The exported graph, classified: state placeholders, user inputs, operations, outputs."""

    state: dict[fx.Node, tuple[str, str]]
    user_inputs: list[fx.Node]
    compute: list[fx.Node]
    outputs: list[Any]  # flat user outputs: nodes or constants
    write_backs: list[tuple[fx.Node, fx.Node]]  # (buffer placeholder, new value)


def _classify(ep: ExportedProgram) -> _Graph:
    nodes = list(ep.graph.nodes)
    by_name = {n.name: n for n in nodes}
    state, user_inputs = {}, []
    for spec in ep.graph_signature.input_specs:
        node = by_name[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            user_inputs.append(node)
        elif spec.kind in _STATE_KINDS and spec.target is not None:
            state[node] = (_STATE_KINDS[spec.kind], spec.target)
        else:
            raise UncuttableModelError(
                f"the traced model takes a {spec.kind.name} input ({spec.arg.name}); only "
                "parameters, buffers, tensor constants and user inputs can be cut into segments"
            )
    output = nodes[-1]
    outs, write_backs = [], []
    buffer_node = {target: n for n, (kind, target) in state.items() if kind == "buffer"}
    for spec, value in zip(ep.graph_signature.output_specs, output.args[0], strict=True):
        if spec.kind == OutputKind.USER_OUTPUT:
            outs.append(value)
        elif spec.kind == OutputKind.BUFFER_MUTATION and spec.target in buffer_node:
            write_backs.append((buffer_node[spec.target], value))
        else:
            raise UncuttableModelError(
                f"the model's forward changes {spec.target or spec.arg.name} in place "
                f"({spec.kind.name}); only buffers may be updated in place by a segmented model. "
                "Move that update out of the forward"
            )
    # get_attr nodes (the subgraphs of no_grad, autocast or cond regions) are read like state
    compute = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]
    return _Graph(state, user_inputs, compute, outs, write_backs)


def _segment_of(g: _Graph, cuts_at: list[int]) -> dict[fx.Node, int]:
    seg = {n: bisect.bisect_right(cuts_at, i) for i, n in enumerate(g.compute)}
    for n in g.user_inputs:
        seg[n] = 0
    for n in g.compute:
        source = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if source is None:
            continue
        if n.target is operator.getitem and isinstance(source.meta.get("val"), (list, tuple)):
            seg[n] = seg[source]  # pieces of a multi-output op stay with it: lists never cross
        elif n.target in _SIZE_OPS:
            seg[n] = seg[source]  # a size read where its tensor is made: the tensor need not travel
    return seg


def _writes_input(node: fx.Node, value: fx.Node) -> bool:
    """Whether ``node`` is an in-place op that writes to ``value`` directly."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for arg, spec in zip(node.args, schema.arguments, strict=False):
        if arg is value and spec.alias_info is not None and spec.alias_info.is_write:
            return True
    return False


def split_program(ep: ExportedProgram, cuts: Sequence[Cut]) -> list[SegmentProgram]:
    """Cut ``ep``'s graph before (or after) the modules of ``cuts``.

    Values a later segment needs pass through the segments in between (skip connections);
    a symbolic size is recomputed from a tensor that crosses with it where one has that size,
    else it travels as a 0-d tensor. A buffer update the graph returns is written back in place
    by the segment that computes it.
    """
    g = _classify(ep)
    cuts_at = cut_positions(g.compute, cuts)
    n = len(cuts_at) + 1
    seg = _segment_of(g, cuts_at)
    back_at = {}
    for buf, value in g.write_backs:  # after the value exists and after every read of the old one
        back_at[buf] = max([seg[value]] + [seg[u] for u in buf.users if u.op != "output"])
    # uses[v] = the segments that read value v (the output node reads in the last segment)
    uses: dict[fx.Node, set[int]] = {}
    for u in g.compute:
        for v in u.all_input_nodes:
            if v not in g.state and v.op != "get_attr":
                uses.setdefault(v, set()).add(seg[u])
    for v in g.outputs:
        if isinstance(v, fx.Node):
            uses.setdefault(v, set()).add(n - 1)
    for buf, value in g.write_backs:
        uses.setdefault(value, set()).add(back_at[buf])
    tensors_in: list[list[fx.Node]] = [[] for _ in range(n)]
    sym_uses: list[list[fx.Node]] = [[] for _ in range(n)]
    for v, segments in uses.items():
        late = [k for k in segments if k > seg[v]]
        if not late:
            continue
        if _is_sym(v.meta.get("val")):
            for k in late:
                sym_uses[k].append(v)
        else:
            for k in range(seg[v] + 1, max(late) + 1):
                tensors_in[k].append(v)
    tensors_in[0] = [v for v in g.user_inputs if isinstance(v.meta.get("val"), torch.Tensor)]
    remat, boxed_in = _plan_sizes(seg, tensors_in, sym_uses)
    root = ep.graph_module  # holds the subgraphs that get_attr nodes name; no state
    return [_build(k, n, g, seg, back_at, tensors_in, remat[k], boxed_in, root) for k in range(n)]


def _plan_sizes(
    seg: dict[fx.Node, int], tensors_in: list[list[fx.Node]], sym_uses: list[list[fx.Node]]
) -> tuple[list[dict[fx.Node, tuple[fx.Node, int]]], list[list[fx.Node]]]:
    """Per segment, the sizes recomputed from an incoming tensor ``(tensor, dim)``, and the
    sizes that must travel boxed into each segment."""
    remat: list[dict[fx.Node, tuple[fx.Node, int]]] = [{} for _ in tensors_in]
    boxed_in: list[list[fx.Node]] = [[] for _ in tensors_in]
    for k, needed in enumerate(sym_uses):
        for v in needed:
            expr = getattr(getattr(v.meta.get("val"), "node", None), "expr", None)
            source = None
            for t in tensors_in[k]:
                shape = getattr(t.meta.get("val"), "shape", ())
                for d, size in enumerate(shape):
                    if (
                        isinstance(size, torch.SymInt)
                        and expr is not None
                        and size.node.expr == expr
                    ):
                        source = (t, d)
                        break
                if source:
                    break
            if source:
                remat[k][v] = source
            else:
                for j in range(seg[v] + 1, k + 1):
                    if v not in boxed_in[j]:
                        boxed_in[j].append(v)
    return remat, boxed_in


def _build(
    k: int,
    n: int,
    g: _Graph,
    seg: dict[fx.Node, int],
    back_at: dict[fx.Node, int],
    tensors_in: list[list[fx.Node]],
    remat: dict[fx.Node, tuple[fx.Node, int]],
    boxed_in: list[list[fx.Node]],
    root: torch.nn.Module,
) -> SegmentProgram:
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    mine = [u for u in g.compute if seg[u] == k]
    reads = {v for u in mine for v in u.all_input_nodes if v in g.state}
    reads |= {buf for buf, at in back_at.items() if at == k}
    state = [v for v in g.state if v in reads]
    for v in state:
        env[v] = graph.placeholder(v.name)
    for v in dict.fromkeys(v for u in mine for v in u.all_input_nodes if v.op == "get_attr"):
        env[v] = graph.node_copy(v)
    carried: dict[fx.Node, fx.Node] = {}  # boxed sizes as they travel
    for v in tensors_in[k]:
        env[v] = graph.placeholder(v.name)
        if k > 0 and any(_writes_input(u, v) for u in mine):
            env[v] = graph.call_function(torch.ops.aten.clone.default, (env[v],))  # not a leaf
    for v in boxed_in[k]:
        carried[v] = graph.placeholder(f"{v.name}_boxed")
        env[v] = graph.call_function(_unbox, (carried[v],))
    for v, (t, d) in remat.items():
        env[v] = graph.call_function(torch.ops.aten.sym_size.int, (env[t], d))
    if k == 0:
        for v in g.user_inputs:
            env.setdefault(v, v.meta.get("val"))  # non-tensor inputs: baked in at export
    for u in mine:
        env[u] = graph.node_copy(u, lambda a: env[a])
        if k + 1 < n and u in boxed_in[k + 1]:
            carried[u] = graph.call_function(_box, (env[u],))
    for buf, value in g.write_backs:
        if back_at[buf] == k:
            graph.call_function(_write_back, (env[buf], env[value]))
    if k == n - 1:
        graph.output(tuple(env[v] if isinstance(v, fx.Node) else v for v in g.outputs))
        outputs = [v.name if isinstance(v, fx.Node) else repr(v) for v in g.outputs]
    else:
        nxt = tensors_in[k + 1] + boxed_in[k + 1]
        graph.output(tuple(env[v] if v in tensors_in[k + 1] else carried[v] for v in nxt))
        outputs = [v.name for v in nxt]
    graph.lint()
    return SegmentProgram(
        graph_module=fx.GraphModule(root, graph, class_name=f"Segment{k}"),
        state=[g.state[v] for v in state],
        inputs=[v.name for v in tensors_in[k] + boxed_in[k]],
        outputs=outputs,
        input_nodes=list(tensors_in[0]) if k == 0 else [],
    )
