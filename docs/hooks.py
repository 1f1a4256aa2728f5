"""Build-time glue of the documentation site (MkDocs hooks and griffe extensions).

- The tables and plots under ``experiments/results`` become site files at their repository
  paths, so the pages show and link them without a copy in ``docs/``. The pages write them as
  ``../experiments/results/...``, which GitHub resolves too; the links are shortened by one
  ``../`` for the site.
- mkdocstrings reads the package from a tree of links laid out as it installs: griffe finds
  submodules by walking folders, and ``callbacks/`` and ``experiments/`` install as
  ``pipemare.callbacks`` and ``pipemare.experiments``.
- :class:`RuntimeClasses` documents a class that a module builds with a call
  (``PipeMareStrategy = strategy_class(...)``) as the class it is at run time;
  :class:`DocstringMarkup` shows the docstrings' Sphinx roles as code.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
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


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([\w.]+)(\(\))?`")
_EXAMPLE = re.compile(r"^(\s*)Example::?$", re.M)


def markdown_docstring(text: str) -> str:
    """A docstring as griffe's Google-style parser and Markdown render it well: Sphinx roles
    (``:class:`~a.B```) as code spans, and an ``Example:`` heading as griffe's ``Examples:``
    section (griffe renders a doctest under any other heading as prose)."""

    def code(match: re.Match[str]) -> str:
        short, path, call = match.groups()
        return f"`{path.rpartition('.')[2] if short else path}{call or ''}`"

    return _EXAMPLE.sub(r"\1Examples:", _ROLE.sub(code, text))


class DocstringMarkup(griffe.Extension):
    """Applies :func:`markdown_docstring` to every docstring griffe reads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)


class RuntimeClasses(griffe.Extension):
    """Documents an exported ``Name = make_class(...)`` as the class the call returns.

    Static analysis sees only an attribute; the class is imported, and its docstring and bases
    become a griffe class in the attribute's place (members come from the bases, listed with
    mkdocstrings' ``inherited_members``).
    """

    def on_module_members(self, *, mod: griffe.Module, agent: Any, **kwargs: Any) -> None:
        exported = {str(name) for name in mod.exports or ()}
        for name, member in list(mod.members.items()):
            if name not in exported or member.is_alias or not member.is_attribute:
                continue
            if not isinstance(member.value, griffe.ExprCall):
                continue
            value = getattr(importlib.import_module(mod.path), name, None)
            if not inspect.isclass(value) or value.__name__ != name:
                continue
            doc = inspect.getdoc(value)
            docstring = doc and griffe.Docstring(
                markdown_docstring(doc),
                lineno=member.lineno,
                parser=agent.docstring_parser,
                parser_options=agent.docstring_options,
            )
            bases = [f"{base.__module__}.{base.__qualname__}" for base in value.__bases__]
            runtime = griffe.Class(
                name,
                lineno=member.lineno,
                endlineno=member.endlineno,
                bases=bases,
                docstring=docstring or None,
            )
            mod.set_member(name, runtime)
