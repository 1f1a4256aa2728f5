"""A launcher that has imported torch, Lightning and pipemare once, and forks each launched
worker from that state: a fresh interpreter spends about 8 s of CPU on those imports, and the
suite starts well over a hundred workers on two cores.

Each launch is still a real process of its own: the fork's child takes the command's environment,
working directory, ``sys.path`` and warnings filters, runs the script (or ``-m`` module) as
``__main__``, then shuts down as an interpreter does (non-daemon threads joined, ``atexit``
handlers run) and exits with the script's status. Only what the imports above did is shared, and
they run in this launcher with the launched workers' base environment (``launch.environment``).

The protocol is one JSON line per request on stdin, one per answer on stdout:
``{"op": "spawn", "argv": [...], "env": {...}, "cwd": ..., "log": PATH}`` -> ``{"pid": N}`` and
``{"op": "wait", "pid": N, "timeout": S}`` -> ``{"code": C}`` (``null`` while it still runs).
The launcher exits when its stdin closes."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
import warnings

#: the filters Python starts with: CPython's defaults after this launcher's own -W options
_DEFAULTS = list(warnings.filters)[len(sys.warnoptions) :]
_BEFORE = len(warnings.filters)

# the imports every launch would otherwise repeat; not wandb, whose import makes a temporary
# folder that the first launch to exit would delete for every later one
import pytorch_lightning  # noqa: E402, F401
import torch  # noqa: E402, F401

import pipemare  # noqa: E402, F401

#: the filters those imports added, in front of the others (as ``filterwarnings`` puts them)
_ADDED = list(warnings.filters)[: len(warnings.filters) - _BEFORE]

#: this launcher's own path entries beyond the PYTHONPATH it was started with: site-packages
_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
_SITE = [p for p in sys.path[1:] if p not in _PYTHONPATH]


def _prepare(argv: list[str], env: dict[str, str], cwd: str) -> None:
    """What a fresh ``python ARGV`` would have set up before running its first line."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    module = argv[1] == "-m"
    first = cwd if module else os.path.dirname(os.path.abspath(argv[1]))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_SITE]
    # as a fresh interpreter has them: its PYTHONWARNINGS over the defaults, then the imports'
    warnings.filters[:] = _DEFAULTS
    options = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
    warnings._processoptions(options)  # type: ignore[attr-defined]
    warnings.filters[:0] = _ADDED
    warnings._filters_mutated()  # type: ignore[attr-defined]
    # Lightning reads the process's rank from the environment when it is imported
    from lightning_fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0  # type: ignore[attr-defined]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)


def _run(argv: list[str]) -> int:
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            runpy.run_path(argv[1], run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # an interpreter's shutdown: non-daemon threads, then atexit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    return code


def _child(request: dict) -> None:
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        _prepare(request["argv"], request["env"], request["cwd"])
        code = _run(request["argv"])
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def main() -> None:
    answers = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "spawn":
            answers.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)
            answer: dict = {"pid": pid}
        else:
            answer = {"code": _wait(request["pid"], request["timeout"])}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
