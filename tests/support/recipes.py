"""The launch recipes of docs/scaling-up.md, read from the page, so that the tests that launch
them run what the page says (its launcher arguments and its Trainer's counts), not a copy.

Each recipe is a fenced block on the page with a comment line naming it
(``# recipe: NAME``); a Python block's ``Trainer(...)`` and ``PipeMareStrategy(...)`` calls give
the counts the test's worker is started with.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "scaling-up.md"
_FENCE = re.compile(r"^```[a-z]*\n(?P<body>.*?)^```", re.M | re.S)


def block(name: str, page: Path = PAGE) -> str:
    """The body of the page's fenced block with the line ``# recipe: name``."""
    found = [
        m["body"]
        for m in _FENCE.finditer(page.read_text())
        if f"# recipe: {name}" in m["body"].splitlines()
    ]
    if len(found) != 1:
        raise LookupError(f"{page.name} has {len(found)} blocks named 'recipe: {name}'")
    return found[0]


def command(name: str, values: dict[str, str] | None = None) -> list[str]:
    """The shell command of a recipe block: its lines after the comments, continuations joined,
    each placeholder in ``values`` (``"$HEAD:$PORT"``) replaced by its value."""
    lines = [line for line in block(name).splitlines() if not line.lstrip().startswith("#")]
    text = " ".join(line.rstrip(" \\") for line in lines)
    for placeholder, value in (values or {}).items():
        if placeholder not in text:
            raise LookupError(f"recipe {name!r} has no {placeholder}")
        text = text.replace(placeholder, value)
    return shlex.split(text)


def options(words: list[str]) -> dict[str, str]:
    """``--name=value`` words of a command line (or ``#SBATCH`` lines) as a mapping."""
    return dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)


def sbatch(name: str) -> tuple[dict[str, str], list[str]]:
    """A batch script's ``#SBATCH`` options and its ``srun`` line's words."""
    text = block(name)
    lines = text.splitlines()
    header = [w for line in lines if line.startswith("#SBATCH") for w in line.split()[1:]]
    (srun,) = [shlex.split(line) for line in lines if line.startswith("srun ")]
    return options(header), srun


def trainer_counts(name: str) -> dict[str, int]:
    """``devices``, ``num_nodes`` and ``stages`` as a Python recipe's calls set them."""
    counts: dict[str, int] = {}
    for node in ast.walk(ast.parse(block(name))):
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg in ("devices", "num_nodes", "stages"):
                    counts[keyword.arg] = ast.literal_eval(keyword.value)
    return counts


def worker_arguments(name: str) -> list[str]:
    """The test workers' ``--devices --num-nodes --stages`` for a Python recipe's counts."""
    counts = trainer_counts(name)
    return [
        "--devices", str(counts["devices"]),
        "--num-nodes", str(counts.get("num_nodes", 1)),
        "--stages", str(counts["stages"]),
    ]  # fmt: skip


def slurm_environments(name: str) -> list[dict[str, str]]:
    """What ``srun`` gives each task of a batch script's allocation (its ``--nodes`` times its
    ``--ntasks-per-node``), every node emulated on this machine."""
    header, _ = sbatch(name)
    nodes, per_node = int(header["nodes"]), int(header["ntasks-per-node"])
    return [
        {
            "SLURM_NTASKS": str(nodes * per_node),
            "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_NNODES": str(nodes),
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(rank // per_node),
            "SLURM_JOB_NAME": header.get("job-name", "pipemare"),
            "SLURM_JOB_ID": "4242",
            "SLURM_NODELIST": "127.0.0.1",
        }
        for rank in range(nodes * per_node)
    ]
