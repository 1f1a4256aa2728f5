"""The tree is the architecture: folders import downward only, modules never in a cycle, and
every module and class stays readable in one sitting."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Where each installed package's files are (callbacks/ and experiments/ install inside pipemare).
SOURCES = {
    "pipemare": ROOT / "pipemare",
    "pipemare.callbacks": ROOT / "callbacks",
    "pipemare.experiments": ROOT / "experiments",
}

#: Each layer and the layers below it that it may import; a layer may always import itself.
#: ``face`` is the public API (``pipemare/__init__.py``), ``command`` the ``pipemare`` command.
MAY_IMPORT: dict[str, set[str]] = {
    "schedule": set(),
    "model": set(),
    "optim": {"schedule"},
    "engine": {"schedule", "model", "optim"},
    "planner": {"schedule", "model", "optim", "engine"},
    "lightning": {"schedule", "model", "optim", "engine", "planner"},
    "face": {"schedule", "model", "optim", "engine", "planner", "lightning"},
    "callbacks": {"schedule", "model", "optim", "engine", "planner", "lightning", "face"},
}
MAY_IMPORT["experiments"] = set(MAY_IMPORT) - {"experiments"}
MAY_IMPORT["command"] = set(MAY_IMPORT) - {"command"}

MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300


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
    if len(parts) == 1 or parts[1] in ("_moved",):
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


def oversized(sources: dict[str, pathlib.Path]) -> list[str]:
    """Modules over :data:`MAX_MODULE_LINES` lines and classes over :data:`MAX_CLASS_LINES`."""
    bad = []
    for name, path in modules(sources).items():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            bad.append(f"module {name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    bad.append(f"class {name}.{node.name}: {size} lines")
    return bad


def test_every_layer_imports_only_the_layers_below_it() -> None:
    edges = graph(SOURCES)
    assert {layer(name) for name in edges} <= set(MAY_IMPORT), "a folder without a layer"
    assert upward_imports(edges) == []


def test_no_modules_import_each_other_in_a_cycle() -> None:
    assert cycles(graph(SOURCES)) == []


def test_the_library_has_no_module_or_class_too_long_to_read_in_one_sitting() -> None:
    assert oversized({k: v for k, v in SOURCES.items() if k != "pipemare.experiments"}) == []


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> dict[str, pathlib.Path]:
    for rel, text in files.items():
        path = tmp_path / "pipemare" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"pipemare": tmp_path / "pipemare"}


def test_the_checks_find_an_upward_import_a_cycle_and_a_long_class(tmp_path) -> None:
    sources = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/stage.py": "def f():\n    from pipemare.lightning import strategy\n",
            "lightning/__init__.py": "",
            "lightning/strategy.py": "from . import hooks\n",
            "lightning/hooks.py": "from pipemare.lightning.strategy import X\n",
            "optim/__init__.py": "",
            "optim/big.py": "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES,
        },
    )
    edges = graph(sources)
    assert upward_imports(edges) == [
        "pipemare.engine.stage (engine) -> pipemare.lightning.strategy (lightning)"
    ]
    assert cycles(edges) == [["pipemare.lightning.hooks", "pipemare.lightning.strategy"]]
    assert oversized(sources) == [f"class pipemare.optim.big.Big: {MAX_CLASS_LINES + 1} lines"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("pipemare.watchdog", "pipemare.engine.watchdog"),
        ("pipemare.telemetry", "pipemare.engine.telemetry"),
        ("pipemare.layout", "pipemare.engine.layout"),
        ("pipemare.clip", "pipemare.engine.clip"),
        ("pipemare.corrections", "pipemare.optim.corrections"),
        ("pipemare.corrections.stability", "pipemare.optim.stability"),
        ("pipemare.strategy", "pipemare.lightning.strategy"),
        ("pipemare.experiments.classifiers", "pipemare.experiments.tasks.classifiers"),
        ("pipemare.experiments.sharpness", "pipemare.experiments.studies.sharpness"),
    ],
)
def test_the_flat_layouts_import_paths_still_import_the_same_module(old: str, new: str) -> None:
    import importlib

    import pipemare  # noqa: F401  (installs the old names)

    assert importlib.import_module(old) is importlib.import_module(new)


def test_an_old_module_path_still_runs_with_python_m() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pipemare.experiments.sharpness", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "--delay" in out.stdout
