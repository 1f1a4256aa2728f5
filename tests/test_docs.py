"""The documentation site: it builds in strict mode, and everything its API pages render has a
docstring (mkdocstrings leaves an undocumented object out silently, so only a test sees it)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
#: a `::: identifier` line of an API page and the indented options below it
_DIRECTIVE = re.compile(r"^::: (?P<ident>[\w.]+)\n(?P<body>(?:[ \t]+.*\n|\n(?=[ \t]))*)", re.M)


def directives() -> list[tuple[str, dict[str, Any]]]:
    """Every object the API pages render, with the mkdocstrings options it is rendered with."""
    found = []
    for page in sorted(API.glob("*.md")):
        for match in _DIRECTIVE.finditer(page.read_text()):
            body = yaml.safe_load(textwrap.dedent(match["body"])) or {}
            found.append((match["ident"], body.get("options") or {}))
    return found


def resolve(identifier: str) -> Any:
    """The object a dotted identifier names: a module, or an attribute of one."""
    module, _, rest = identifier, "", ""
    while True:
        try:
            obj: Any = importlib.import_module(module)
            break
        except ModuleNotFoundError:
            module, _, last = module.rpartition(".")
            rest = f"{last}.{rest}" if rest else last
    for name in filter(None, rest.split(".")):
        obj = getattr(obj, name)
    return obj


def own_doc(cls: type) -> str | None:
    """A class's own docstring (not a base's, nor the signature a dataclass writes in)."""
    doc = vars(cls).get("__doc__")
    if not doc or doc.startswith(f"{cls.__name__}("):
        return None
    return doc


def member_doc(cls: type, name: str) -> str | None:
    """A member's docstring, its own or, for an override, the one it overrides (as
    ``inspect.getdoc`` finds it, through every base of ``cls``)."""
    for klass in cls.__mro__:
        raw = vars(klass).get(name)
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if isinstance(raw, property) or inspect.isfunction(raw):
            doc = inspect.getdoc(raw)
            if doc:
                return doc
    return None


def public_methods(cls: type) -> list[str]:
    """The functions and properties a class defines itself under public names."""
    names = []
    for name, raw in vars(cls).items():
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if not name.startswith("_") and (inspect.isfunction(raw) or isinstance(raw, property)):
            names.append(name)
    return names


def undocumented(identifier: str, obj: Any, options: dict[str, Any]) -> list[str]:
    """What of ``obj``, as its page renders it, has no docstring."""
    missing = []
    if isinstance(obj, ModuleType):
        if not inspect.getdoc(obj):
            missing.append(identifier)
        names = options.get("members") or getattr(obj, "__all__", [])
        for name in names:
            missing += undocumented(f"{identifier}.{name}", getattr(obj, name), {})
    elif inspect.isclass(obj):
        if not own_doc(obj):
            missing.append(identifier)
        names = options.get("members") or public_methods(obj)
        names = [*names, *(options.get("inherited_members") or [])]
        missing += [f"{identifier}.{name}" for name in names if not member_doc(obj, name)]
    elif inspect.isroutine(obj) and not inspect.getdoc(obj):
        missing.append(identifier)
    return missing


def test_every_object_the_api_pages_render_has_a_docstring():
    rendered = directives()
    assert len(rendered) >= 10, rendered
    missing = [
        name for ident, options in rendered for name in undocumented(ident, resolve(ident), options)
    ]
    assert not missing, f"no docstring: {missing}"


def test_the_api_reference_names_every_name_the_package_exports():
    import pipemare

    text = "\n".join(page.read_text() for page in API.glob("*.md"))
    absent = [name for name in pipemare.__all__ if not re.search(rf"\b{name}\b", text)]
    assert not absent, f"not in docs/api/: {absent}"


def build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of the project in ``project`` into ``site``."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=project,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    done = build(ROOT, site)
    assert done.returncode == 0, done.stderr[-4000:]
    strategy = (site / "api" / "strategy" / "index.html").read_text()
    assert "PipeMareStrategy" in strategy and "reported_step" in strategy
    assert "microbatches" in strategy  # the arguments' table, from the class docstring
    callbacks = (site / "api" / "callbacks" / "index.html").read_text()
    assert "StalenessMonitor" in callbacks
    results = (site / "results" / "index.html").read_text()
    plot = "experiments/results/protocol/mnist_protocol.png"
    assert plot in results and (site / plot).is_file()


def test_a_docstring_naming_a_missing_object_fails_the_build(tmp_path):
    """The site's docstring hook over a one-module site: a Sphinx role that names an object
    becomes a link to it, one that names nothing fails the strict build, named."""
    package = tmp_path / "src" / "tiny"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        '"""A tiny module: :func:`~tiny.here` is here, :class:`Gone` is not."""\n\n\n'
        'def here():\n    """Here."""\n'
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("::: tiny\n")
    extension = {f"{ROOT}/docs/hooks.py:DocstringMarkup": {"packages": ["tiny"]}}
    python = {"paths": ["src"], "options": {"extensions": [extension]}}
    config = {
        "site_name": "tiny",
        "theme": {"name": "mkdocs"},
        "plugins": ["autorefs", {"mkdocstrings": {"handlers": {"python": python}}}],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    site = tmp_path / "site"
    done = build(tmp_path, site)
    assert done.returncode != 0
    assert ":class:`Gone` names no object" in done.stderr, done.stderr[-4000:]
    assert "here` names no object" not in done.stderr
    page = (site / "index.html").read_text()
    assert 'href="#tiny.here"' in page


def test_the_scaling_pages_launchers_agree_with_its_trainers():
    """docs/scaling-up.md's multi-node recipes, read as the launch tests read them: each
    launcher starts as many processes per node, and as many nodes, as its Trainer asks for."""
    from support import recipes

    torchrun = recipes.options(recipes.command("torchrun-nodes"))
    trainer = recipes.trainer_counts("nodes-train")
    assert int(torchrun["nproc-per-node"]) == trainer["devices"]
    assert int(torchrun["nnodes"]) == trainer["num_nodes"]
    assert trainer["devices"] % trainer["stages"] == 0  # each pipeline inside a node
    slurm, _ = recipes.sbatch("slurm-batch")
    trainer = recipes.trainer_counts("slurm-train")
    assert int(slurm["ntasks-per-node"]) == int(slurm["gpus-per-node"]) == trainer["devices"]
    assert int(slurm["nodes"]) == trainer["num_nodes"]
