"""The core install (``pip install pipemare``, without the experiments' extra): the library and
``pipemare fit`` work without scikit-learn and matplotlib and never import the experiments; the
experiments' commands say how to install what they miss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

#: Prepended to each child's script: scikit-learn and matplotlib look uninstalled, to the
#: importer and to ``importlib.metadata`` alike (torchmetrics asks the metadata before it
#: imports matplotlib), as on a machine with the core install only.
_WITHOUT_EXTRA = """
import sys

_HIDDEN = {"sklearn", "matplotlib"}
_HIDDEN_DISTRIBUTIONS = {"scikit-learn", "matplotlib"}


class _Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        found = getattr(self.finder, "find_distributions", lambda *a, **k: ())(*args, **kwargs)
        for dist in found:
            if dist.metadata["Name"].lower().replace("_", "-") not in _HIDDEN_DISTRIBUTIONS:
                yield dist

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [_Hide(finder) for finder in sys.meta_path]


def loaded():
    prefixes = ("sklearn", "matplotlib", "pipemare.experiments")
    return sorted(name for name in sys.modules if name.startswith(prefixes))
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRA + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WANDB_MODE": "offline"},
    )


def _last_json(out: subprocess.CompletedProcess[str]) -> object:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_library_its_command_and_pipemare_fit_run_without_the_experiments() -> None:
    """One interpreter (each costs seconds of imports): nothing of the experiments or their
    extra is loaded after the imports, nor after ``pipemare fit`` has answered."""
    out = _run(
        """
        import json
        import pipemare, pipemare.__main__
        print(json.dumps(loaded()))
        from pipemare.__main__ import main
        try:
            main(["fit", "--help"])
        except SystemExit as end:
            assert end.code in (0, None), end.code
        print(json.dumps(loaded()))
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[0]) == []  # after the imports
    assert "--no-wandb" in out.stdout  # pipemare's own option: its CLI answered
    assert _last_json(out) == []  # after fit


def test_an_experiments_command_without_its_extra_says_how_to_install_it() -> None:
    out = _run(
        """
        from pipemare.__main__ import main
        main(["compare", "--help"])
        """
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "pip install 'pipemare[experiments]'" in out.stderr
    assert "Traceback" not in out.stderr
