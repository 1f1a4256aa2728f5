"""The README's quickstart runs as a user runs it: saved as ``train.py`` and started with
``python train.py``, Lightning starts the second process and each trains one stage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.launch import environment

ROOT = Path(__file__).resolve().parents[1]


def quickstart() -> str:
    """The README's Python block marked ``# recipe: quickstart``."""
    blocks = (ROOT / "README.md").read_text().split("```python\n")[1:]
    (block,) = [b.split("```", 1)[0] for b in blocks if b.startswith("# recipe: quickstart")]
    return block


@pytest.mark.distributed
def test_the_quickstart_trains_on_two_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(quickstart())
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-4000:]
    # one layout line, from rank 0: two stages, one per process
    layouts = [line for line in console.splitlines() if line.startswith("pipemare: 2 stages")]
    assert len(layouts) == 1, console[-4000:]
    assert "Traceback" not in console
    assert (tmp_path / "lightning_logs").is_dir()  # the Trainer's own logs, as on one device
