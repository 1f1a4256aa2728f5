"""The tree is the architecture: folders import downward only, modules never in a cycle, no
function works on another class's private state, and each public name means one thing."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Where each installed package's files are (callbacks/ and experiments/ install inside pipemare).
SOURCES = {
    "pipemare": ROOT / "pipemare",
    "pipemare.callbacks": ROOT / "callbacks",
    "pipemare.experiments": ROOT / "experiments",
}

#: Each layer and the layers below it that it may import; a layer may always import itself.
#: ``face`` is the public API (``pipemare/__init__.py``), ``command`` the ``pipemare`` command.
#: ``lines``, the table of every line a run prints, lies below them all.
MAY_IMPORT: dict[str, set[str]] = {
    "lines": set(),
    "schedule": {"lines"},
    "model": {"lines"},
    "optim": {"lines", "schedule"},
    "engine": {"lines", "schedule", "model", "optim"},
    "planner": {"lines", "schedule", "model", "optim", "engine"},
    "lightning": {"lines", "schedule", "model", "optim", "engine", "planner"},
    "face": {"lines", "schedule", "model", "optim", "engine", "planner", "lightning"},
    "callbacks": {"lines", "schedule", "model", "optim", "engine", "planner", "lightning", "face"},
}
#: The library's part of the ``pipemare`` command (Lightning's CLI, the console): never the
#: experiments, so that ``pipemare fit`` runs on the core install.
MAY_IMPORT["cli"] = set(MAY_IMPORT)
MAY_IMPORT["experiments"] = set(MAY_IMPORT) - {"experiments"}
MAY_IMPORT["command"] = set(MAY_IMPORT) - {"command"}

#: Public names that may be defined in several modules, and why.
SHARED_NAMES = {
    "main",  # each command module's entry point (``python -m`` and ``pipemare COMMAND``)
}


def modules(sources: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Every module's dotted name and file (a package by its ``__init__.py``)."""
    found = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def layer(name: str) -> str:
    """The layer a module belongs to, from its dotted name."""
    parts = name.split(".")
    if len(parts) == 1:
        return "face"
    if parts[1] == "__main__":
        return "command"
    return parts[1]


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file (in functions and under
    ``TYPE_CHECKING`` too: a lazy import is still a dependency)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return {target for target in out if target in known and target != name}


def graph(sources: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    found = modules(sources)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a layer that ``a``'s layer may not import."""
    bad = []
    for name, targets in sorted(edges.items()):
        own = layer(name)
        for target in sorted(targets):
            other = layer(target)
            if other != own and other not in MAY_IMPORT[own]:
                bad.append(f"{name} ({own}) -> {target} ({other})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _parsed(sources: dict[str, pathlib.Path]) -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in modules(sources).items()}


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def private_state(trees: dict[str, ast.Module]) -> set[str]:
    """The private names this project's classes define: ``self._x = ...`` in a method, or a
    ``_x`` defined in a class body. Third-party internals (``Tensor._base``, a Lightning
    trainer's ``_active_loop``) are not here: no helper of ours could move into torch."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets: list[ast.expr] = []
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.Assign):
                        targets = item.targets
                    elif isinstance(item, ast.AnnAssign):
                        targets = [item.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id in ("self", "cls")
                    ):
                        names.add(target.attr)
    return {name for name in names if _is_private(name)}


def _annotation(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.strip()
    if isinstance(node, ast.Name):
        return node.id
    return None


_Function = tuple[str, "ast.FunctionDef | ast.AsyncFunctionDef", "str | None"]


def _functions(tree: ast.Module) -> Iterator[_Function]:
    """Each function with its qualified name and the class it is a method of (or None)."""

    def walk(node: ast.AST, prefix: str, owner: str | None) -> Iterator[_Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.", child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child, owner
                yield from walk(child, f"{prefix}{child.name}.", None)
            else:
                yield from walk(child, prefix, owner)

    yield from walk(tree, "", None)


def foreign_private_access(sources: dict[str, pathlib.Path]) -> list[str]:
    """``module.func: param._attr`` for each function that reads or writes the private state
    of an object it was handed. A method may touch the private state of another instance of
    its own class (a parameter named ``other`` or annotated with the class); anything else
    belongs in the object's class, or the state belongs to the helper."""
    trees = _parsed(sources)
    private = private_state(trees)
    bad: set[str] = set()
    for module, tree in trees.items():
        for qualname, func, owner in _functions(tree):
            arguments = func.args
            params = {
                arg.arg
                for arg in [
                    *arguments.posonlyargs,
                    *arguments.args,
                    *arguments.kwonlyargs,
                    *filter(None, [arguments.vararg, arguments.kwarg]),
                ]
                if arg.arg not in ("self", "cls")
                and not (owner and (arg.arg == "other" or _annotation(arg.annotation) == owner))
            }
            for node in ast.walk(func):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in params
                    and node.attr in private
                ):
                    bad.add(f"{module}.{qualname}: {node.value.id}.{node.attr}")
    return sorted(bad)


def duplicate_names(sources: dict[str, pathlib.Path]) -> list[str]:
    """``name: module, module`` for each public top-level function or class defined in more
    than one module (outside :data:`SHARED_NAMES`): one concept, one definition."""
    where: dict[str, list[str]] = {}
    for module, tree in _parsed(sources).items():
        for node in tree.body:
            named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if named and not node.name.startswith("_") and node.name not in SHARED_NAMES:
                where.setdefault(node.name, []).append(module)
    return [f"{name}: {', '.join(mods)}" for name, mods in sorted(where.items()) if len(mods) > 1]


def test_every_layer_imports_only_the_layers_below_it() -> None:
    edges = graph(SOURCES)
    assert {layer(name) for name in edges} <= set(MAY_IMPORT), "a folder without a layer"
    assert upward_imports(edges) == []


def test_no_modules_import_each_other_in_a_cycle() -> None:
    assert cycles(graph(SOURCES)) == []


def test_no_function_works_on_the_private_state_of_an_object_it_is_handed() -> None:
    assert foreign_private_access(SOURCES) == []


def test_each_public_name_is_defined_in_one_module() -> None:
    assert duplicate_names(SOURCES) == []


#: A class whose methods touch their own and a same-class peer's state (fine), a
#: third-party object's internals (not ours to move) and a stranger's state (an offence).
_QUEUE = """
class Queue:
    _limit = 4

    def __init__(self):
        self._items = []

    def merge(self, other):
        self._items += other._items

    def same(self, peer: "Queue"):
        return self._items == peer._items

    def steal(self, victim):
        return victim._items.pop()

    def view_base(self, tensor):
        return tensor._base
"""


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> dict[str, pathlib.Path]:
    for rel, text in files.items():
        path = tmp_path / "pipemare" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"pipemare": tmp_path / "pipemare"}


def test_the_checks_find_each_offence(tmp_path) -> None:
    sources = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/stage.py": "def f():\n    from pipemare.lightning import strategy\n",
            "lightning/__init__.py": "",
            "lightning/strategy.py": "from . import hooks\n",
            "lightning/hooks.py": "from pipemare.lightning.strategy import X\n",
            "engine/queue.py": _QUEUE,
            "engine/drain.py": "def drain(queue):\n    queue._items.clear()\n",
            "optim/__init__.py": "",
            "optim/build.py": "def build():\n    pass\n\n\ndef main():\n    pass\n",
            "engine/build.py": "class build:\n    pass\n\n\ndef main():\n    pass\n",
        },
    )
    edges = graph(sources)
    assert upward_imports(edges) == [
        "pipemare.engine.stage (engine) -> pipemare.lightning.strategy (lightning)"
    ]
    assert cycles(edges) == [["pipemare.lightning.hooks", "pipemare.lightning.strategy"]]
    assert foreign_private_access(sources) == [
        "pipemare.engine.drain.drain: queue._items",
        "pipemare.engine.queue.Queue.steal: victim._items",
    ]
    assert duplicate_names(sources) == ["build: pipemare.engine.build, pipemare.optim.build"]
