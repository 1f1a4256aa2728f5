"""Every ``pipemare:`` line comes from one table (:mod:`pipemare.lines`): nothing else builds
one, every entry is used, every decision's subject is listed, and the reference page is the
table's."""

from __future__ import annotations

import ast
import functools
import pathlib
import string

import pytest
import yaml

from pipemare import lines
from pipemare.optim.settings import Decision

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: the installed package's folders (callbacks/ and experiments/ install inside pipemare)
FOLDERS = (ROOT / "pipemare", ROOT / "callbacks", ROOT / "experiments")
REGISTRY = ROOT / "pipemare" / "lines.py"
#: the calls that take a decision: its subject is the first argument
DECIDING = ("Decision",)
#: the methods that take one (a method call only: the planner's ``decide`` function is not)
DECIDING_METHODS = ("decide", "yields_to_accumulation")


@functools.cache
def sources() -> dict[pathlib.Path, ast.Module]:
    """Every module of the package but the registry, parsed."""
    return {
        path: ast.parse(path.read_text(), str(path))
        for folder in FOLDERS
        for path in sorted(folder.rglob("*.py"))
        if path != REGISTRY
    }


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that stand alone as statements (docstrings)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def prefixed(tree: ast.AST) -> list[int]:
    """The lines where a string (plain or f-string) that starts with a line's prefix is built;
    a docstring does not count."""
    skip = _docstrings(tree)
    inside = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip or id(node) in inside:
            continue
        first: ast.expr | None = node
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
        if (
            isinstance(first, ast.Constant)
            and isinstance(first.value, str)
            and first.value.startswith(lines.PREFIXES)
        ):
            found.append(node.lineno)
    return sorted(found)


def first_arguments(
    tree: ast.AST, names: tuple[str, ...], methods: tuple[str, ...] = ()
) -> list[tuple[str, int]]:
    """Each call of a function or method named in ``names``: its first argument where it is a
    string literal (else ``"?"``), and its line. A helper that forwards its own ``subject``
    parameter (``decide(subject, ...)`` calling ``Decision(subject, ...)``) is skipped: its
    callers are checked instead. ``methods``: names matched only as ``obj.name(...)``."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = isinstance(func, ast.Name) and func.id in names
        called = called or (isinstance(func, ast.Attribute) and func.attr in (*names, *methods))
        if not called or not node.args:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Name) and arg.id == "subject":
            continue
        literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
        out.append((arg.value if literal else "?", node.lineno))  # type: ignore[union-attr]
    return out


def test_no_module_but_the_registry_builds_a_line() -> None:
    """A string starting ``pipemare:`` (or ``pipemare layout:``) anywhere in the package
    outside :mod:`pipemare.lines` fails: printed, logged, warned or raised, it must come from
    the table, where the reference page documents it."""
    offences = [
        f"{path.relative_to(ROOT)}:{line}"
        for path, tree in sources().items()
        for line in prefixed(tree)
    ]
    assert offences == [], "build these lines with pipemare.lines.text(key, ...)"


def test_the_check_finds_each_way_of_building_a_line() -> None:
    source = '''
"""pipemare: a docstring is not a line."""
import warnings
def f(x):
    """pipemare: nor is this one."""
    print(f"pipemare: {x} stages")
    warnings.warn("pipemare: " + x)
    raise RuntimeError("pipemare layout: " f"{x}")
    return f"not pipemare: {x}", "the pipemare: word inside", f"pipemare:{x}"
'''
    assert prefixed(ast.parse(source)) == [6, 7, 8]


#: the calls that show the user a message: Python's warnings and Lightning's rank-zero ones
WARNING_CALLS = ("warn", "rank_zero_warn", "rank_zero_info")


def _inline(node: ast.expr) -> bool:
    """Whether a message is written at the call: a string literal, an f-string, or a sum or
    ``%`` of them."""
    if isinstance(node, ast.BinOp):
        return _inline(node.left) or _inline(node.right)
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def inline_warnings(tree: ast.AST) -> list[int]:
    """The lines where a warning's message is written at the call rather than taken from the
    table (``warnings.warn(text(key, ...))``, or a name holding such a line)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in WARNING_CALLS and _inline(node.args[0]):
            found.append(node.lineno)
    return sorted(found)


def test_every_warning_a_run_gives_comes_from_the_table() -> None:
    """A warning, unprefixed or not, is a line the run prints: written at the call, it would
    escape the reference page and the prefix."""
    offences = [
        f"{path.relative_to(ROOT)}:{line}"
        for path, tree in sources().items()
        for line in inline_warnings(tree)
    ]
    assert offences == [], "warn with pipemare.lines.text(key, ...), a line of the table"


def test_the_warning_check_finds_each_inline_message() -> None:
    source = """
import warnings
def f(x, said):
    warnings.warn(f"{x} is ignored")
    rank_zero_warn("a " + x)
    self.package.rank_zero_info("%s" % x)
    warnings.warn(said)
    warnings.warn(text("key", x=x), stacklevel=2)
"""
    assert inline_warnings(ast.parse(source)) == [4, 5, 6]


def _imports_text(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.ImportFrom)
        and n.module == "pipemare.lines"
        and any(a.name == "text" and a.asname is None for a in n.names)
        for n in tree.body
    )


def test_every_line_is_used_and_every_key_used_is_a_line() -> None:
    """Every key passed to ``text`` (in the modules importing it) is a line of the table, and
    every line of the table is passed somewhere."""
    used = {
        key: f"{path.relative_to(ROOT)}:{line}"
        for path, tree in sources().items()
        if _imports_text(tree)
        for key, line in first_arguments(tree, ("text",))
    }
    assert {k: v for k, v in used.items() if k not in lines.LINES} == {}
    assert sorted(set(lines.LINES) - set(used)) == []


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def test_each_call_passes_the_fields_its_line_names() -> None:
    """A call of ``text`` names exactly its line's fields (a missing one would fail only when
    the line prints, often on a failure path no test reaches); a call that also unpacks a
    mapping (``**shown``) names none outside them."""
    wrong = []
    for path, tree in sources().items():
        if not _imports_text(tree):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "text"):
                continue
            key = node.args[0].value  # type: ignore[attr-defined]
            named = {k.arg for k in node.keywords if k.arg is not None}
            unpacks = len(named) < len(node.keywords)
            fields = _fields(lines.LINES[key].template)
            if named - fields or (not unpacks and named != fields):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {key}: {sorted(named)}")
    assert wrong == []


def test_every_decision_subject_is_listed_and_every_listed_one_is_decided() -> None:
    """The subjects decided in the code (literals: a computed one would escape this check,
    so none may be computed) are exactly the reference's."""
    decided = {
        subject: f"{path.relative_to(ROOT)}:{line}"
        for path, tree in sources().items()
        for subject, line in first_arguments(tree, DECIDING, DECIDING_METHODS)
    }
    computed = {s: where for s, where in decided.items() if s == "?"}
    assert computed == {}, "decide with a literal subject"
    assert sorted(set(decided) - set(lines.DECISIONS)) == []
    assert sorted(set(lines.DECISIONS) - set(decided)) == []


def test_a_decision_with_a_subject_not_listed_is_refused() -> None:
    assert str(Decision("microbatches", "N=4", "N = P")) == "microbatches: N=4 (N = P)"
    with pytest.raises(ValueError, match=r"not in pipemare\.lines\.DECISIONS"):
        Decision("microbatch count", "N=4", "N = P")


def _dummy(spec: str) -> object:
    """A value a field with format ``spec`` accepts: a number where the spec formats one."""
    return 1234.5 if spec and spec[-1] in "defgn%" else "x"


@pytest.mark.parametrize("key", sorted(lines.LINES))
def test_each_line_formats_from_its_named_fields(key: str) -> None:
    """Each template fills from named fields only, leaves no brace, and starts with the prefix;
    a field it does not name is refused."""
    line = lines.LINES[key]
    parsed = string.Formatter().parse(line.template)
    fields = {name: _dummy(spec) for _, name, spec, _ in parsed if name is not None}
    assert all(name.isidentifier() for name in fields)
    out = lines.text(key, **fields)
    assert out.startswith(lines.PREFIXES) and "{" not in out and "}" not in out
    if fields:
        with pytest.raises(KeyError):
            lines.text(key)


def test_the_reference_page_is_the_table_and_in_the_navigation() -> None:
    """``docs/lines.md`` is what :func:`pipemare.lines.reference` writes from the table, with a
    section for every line and a row for every decision subject.
    When it fails: ``python -c "import pipemare.lines as l; l.write_reference()"``."""
    page = (ROOT / "docs" / "lines.md").read_text()
    assert page == lines.reference()
    for key, line in lines.LINES.items():
        assert f"### `{key}`" in page and line.template in page
    for subject in lines.DECISIONS:
        assert f"| `{subject}` |" in page
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert "lines.md" in str(nav)
