"""Build-time glue of the documentation site (MkDocs hooks and griffe extensions).

- The tables and plots under ``experiments/results`` become site files at their repository
  paths, so the pages show and link them without a copy in ``docs/``. The pages write them as
  ``../experiments/results/...``, which GitHub resolves too; the links are shortened by one
  ``../`` for the site.
- mkdocstrings reads the package from a tree of links laid out as it installs: griffe finds
  submodules by walking folders, and ``callbacks/`` and ``experiments/`` install as
  ``pipemare.callbacks`` and ``pipemare.experiments``.
- :class:`DocstringMarkup` turns the docstrings' Sphinx roles into cross-references and
  checks them: a strict build fails on a role that names no object.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority, get_plugin_logger
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "pipemare"
RESULTS = "experiments/results"
#: what of the results the pages show or link; the JSON data stays in the repository only
RESULT_SUFFIXES = (".md", ".png")

_trees: list[Path] = []


@event_priority(100)  # before mkdocstrings' own on_config, which may start its handler
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Point mkdocstrings' python handler at the package laid out as installed."""
    handlers = config.plugins["mkdocstrings"].config.handlers
    handlers.setdefault("python", {})["paths"] = [str(installed_tree())]
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the results' tables and plots as site files, outside the navigation."""
    for path in sorted((ROOT / RESULTS).rglob("*")):
        if path.suffix in RESULT_SUFFIXES:
            uri = path.relative_to(ROOT).as_posix()
            page = File.generated(
                config, uri, abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV
            )
            files.append(page)
    return files


def on_page_markdown(markdown: str, page: Page, **kwargs: Any) -> str:
    """Turn a page's links out of ``docs/`` into the results into links to the site files."""
    depth = page.file.src_uri.count("/")
    outside = re.escape("../" * (depth + 1) + RESULTS + "/")
    return re.sub(rf"(\]\(|\]: ){outside}", rf"\g<1>{'../' * depth}{RESULTS}/", markdown)


def on_shutdown() -> None:
    """Remove the link trees this process made."""
    while _trees:
        shutil.rmtree(_trees.pop(), ignore_errors=True)


def installed_tree() -> Path:
    """A new folder whose ``pipemare/`` holds every subpackage at its installed name.

    The package's own folder is linked entry by entry, and each top-level folder of the
    repository that the import system finds at ``pipemare.<folder>`` (pyproject's
    ``package-dir``) is linked in beside them.
    """
    tree = Path(tempfile.mkdtemp(prefix="pipemare-docs-"))
    _trees.append(tree)
    package = tree / PACKAGE
    package.mkdir()
    for entry in (ROOT / PACKAGE).iterdir():
        if entry.name == "__init__.py":  # copied: griffe looks for submodules beside the
            shutil.copy(entry, package)  # resolved path of a package's __init__.py
        elif entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in sorted(ROOT.iterdir()):
        if folder.name == PACKAGE or not (folder / "__init__.py").is_file():
            continue
        spec = importlib.util.find_spec(f"{PACKAGE}.{folder.name}")
        origin = spec and spec.origin and Path(spec.origin).resolve()
        if origin == (folder / "__init__.py").resolve():
            (package / folder.name).symlink_to(folder)
    return tree


#: a Sphinx role: ``:class:`~a.B```, ``:meth:`.c()```, ``:meth:`Title <a.B.c>```
_ROLE = re.compile(
    r":(?P<role>class|func|meth|mod|attr|data|exc|obj):`(?:(?P<title>[^`<]+?)\s*<(?P<target>[\w.]+)>"
    r"|(?P<short>~?)(?P<name>\.?[\w.]+)(?P<call>\(\))?)`"
)
_EXAMPLE = re.compile(r"^(\s*)Example::?$", re.M)
#: roles naming a class's member, looked up in the class before its module
_MEMBER_ROLES = frozenset({"meth", "attr"})
_log = get_plugin_logger("docstrings")
#: what looking a path up in griffe's tree raises where nothing is there
_NOT_THERE = (KeyError, AttributeError, griffe.AliasResolutionError, griffe.CyclicAliasError)


class DocstringMarkup(griffe.Extension):
    """Rewrites the docstrings of ``packages``, once griffe has loaded one whole, as griffe's
    Google-style parser and Markdown render them: each Sphinx role as a cross-reference
    (:func:`markdown_docstring`), an ``Example:`` heading as griffe's ``Examples:`` section
    (griffe renders a doctest under any other heading as prose).

    A role naming an object links to it where a page renders it and reads as code where none
    does; a role naming nothing is a warning, which fails a strict build.
    """

    def __init__(self, packages: Sequence[str] = (PACKAGE,)) -> None:
        super().__init__()
        self.packages = frozenset(packages)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name not in self.packages:
            return
        for obj in _objects(pkg):
            if obj.docstring is not None:
                text = markdown_docstring(obj, lambda path: self._exists(path, loader))
                obj.docstring.value = text

    def _exists(self, path: str, loader: griffe.GriffeLoader) -> bool:
        """Whether ``path`` names an object: in these packages as griffe read them, elsewhere
        as Python imports it."""
        try:
            loader.modules_collection[path]
        except _NOT_THERE:
            return path.partition(".")[0] not in self.packages and _imports(path)
        return True


def markdown_docstring(owner: griffe.Object, exists: Callable[[str], bool]) -> str:
    """``owner``'s docstring with each Sphinx role as an autorefs cross-reference: an optional
    one to the object it names (``:class:`~a.B``` links ``B`` to ``a.B``), or, where ``exists``
    finds none, a warning and a plain one, which autorefs reports too.

    A role's name is looked up much as Sphinx does: in the scopes around the docstring, then as
    a full path (:func:`_candidates`).
    """
    docstring = owner.docstring
    assert docstring is not None
    text = docstring.value

    def reference(match: re.Match[str]) -> str:
        name = (match["target"] or match["name"]).lstrip(".")
        if match["target"]:
            title = " ".join(match["title"].split())
        else:
            title = (name.rpartition(".")[2] if match["short"] else name) + (match["call"] or "")
        candidates = _candidates(owner, name, member=match["role"] in _MEMBER_ROLES)
        path = next((p for p in candidates if exists(p)), None)
        if path is None:
            line = (docstring.lineno or 0) + text.count("\n", 0, match.start())
            _log.warning("%s:%d: %s names no object", _source(owner), line, match[0])
            return f"[`{title}`][{name}]"
        return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'

    return _EXAMPLE.sub(r"\1Examples:", _ROLE.sub(reference, text))


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and everything defined in it (not what it imports)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(cast(griffe.Object, member))


def _candidates(owner: griffe.Object, name: str, member: bool) -> list[str]:
    """The paths ``name`` may stand for in ``owner``'s docstring, the likeliest first: the scopes
    around it, innermost first, with a class's scope first only for a member's role (as in
    Sphinx, ``:func:`f``` in a method is the module's ``f``, ``:meth:`f``` the class's), then
    ``name`` as a full path."""
    scopes = []
    scope: griffe.Object | None = owner if owner.is_class or owner.is_module else owner.parent
    while scope is not None:
        scopes.append(scope)
        scope = scope.parent
    if not member:
        scopes.sort(key=lambda s: not s.is_module)
    return [*(f"{s.path}.{name}" for s in scopes), name]


def _imports(path: str) -> bool:
    """Whether Python imports ``path``: a module, or an attribute of one."""
    module = path
    rest: list[str] = []  # the names after the longest importable module
    while module:
        try:
            obj = importlib.import_module(module)
        except ImportError:
            module, _, last = module.rpartition(".")
            rest.insert(0, last)
            continue
        for name in rest:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _source(obj: griffe.Object) -> str:
    """Where ``obj`` is written: its file in the repository, seen through the link tree."""
    path = Path(str(obj.filepath)).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
