"""Launching real processes from a test: a clean environment, every command started and waited
for (only its own processes are ever killed), a free port, and the JSON reports ranks write.

A command that runs a Python script or module with this interpreter is forked by the prefork
launcher (``support/prefork.py``), which has imported torch, Lightning and pipemare once: each
is still a process of its own, with its own environment, but without the 8 s of imports a
fresh interpreter spends; so is every Python script or module such a process starts in turn
(Lightning's launcher its other ranks, torchrun its workers). ``PIPEMARE_TESTS_FRESH=1``
starts fresh interpreters instead. ``ranks`` launches every rank of a run itself, as torchrun
and SLURM do (Lightning's second way to start processes: ``LOCAL_RANK`` set, so its own
launcher starts nothing)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import multiprocessing.spawn
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


@functools.cache
def _port_slice() -> range:
    """This test process's own ports: below the range the kernel hands out to ``bind(0)`` and to
    outgoing connections, so no gloo socket, TCPStore client or other test can take a port
    between the moment it is picked here and the moment a launched rank listens on it (the race
    a ``bind(0)``-then-close pick loses under load: ``EADDRINUSE``). Each xdist worker gets a
    disjoint slice, so two workers never pick the same port either."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    low = max(1024, ephemeral - 12288)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    width = (ephemeral - low) // 8
    start = low + (index % 8) * width
    return range(start, start + width)


#: This process's picks in turn, from a random place in its slice, so that two test sessions on
#: one machine (two clones' suites) are unlikely to meet either.
_picks = itertools.count(random.randrange(1 << 16))


def free_port() -> int:
    """A port no one listens on, from this process's slice (``_port_slice``), taken in turn."""
    ports = _port_slice()
    for _ in range(len(ports)):
        port = ports[next(_picks) % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports}")


#: The folder that holds this package: on a launched worker's path, so that it imports it.
TESTS = Path(__file__).resolve().parents[1]


def environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "LOCAL_RANK", "MASTER_", "TORCHELASTIC"))
    }
    path = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONWARNINGS="ignore", PYTHONPATH=path)
    # a port for Lightning's own launcher, which would otherwise pick one with bind(0)-then-close
    # (the race ``free_port`` avoids); torchrun and ``ranks`` set their own
    if "MASTER_PORT" not in extra:
        env["MASTER_PORT"] = str(free_port())
    env.update(extra)
    return env


Command = tuple[list[str], dict[str, str]]


class _Prefork:
    """This test process's prefork launcher, started at its first launch."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)  # whichever launcher runs when this process ends

    def ask(self, request: dict) -> dict:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "support.prefork"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=environment(),
                    cwd=TESTS,
                    text=True,
                )
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            answer = self._proc.stdout.readline()
            if not answer:
                raise RuntimeError(f"the prefork launcher ended ({self._proc.wait()})")
            return json.loads(answer)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=60)


_PREFORK = _Prefork()
#: the launches' output files, removed when this test process ends
_LOGS = tempfile.TemporaryDirectory(prefix="pipemare-launches-")


def _forkable(cmd: list[str]) -> bool:
    if os.environ.get("PIPEMARE_TESTS_FRESH") or len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    return (cmd[1] == "-m" and len(cmd) > 2) or cmd[1].endswith(".py")


class Launched:
    """One started command, its output (stdout and stderr together) kept in a file."""

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        cwd: str | Path | None = None,
        new_session: bool = False,
    ):
        """``new_session``: in a session (and process group) of its own, as ``Popen``'s
        ``start_new_session``: ``os.killpg(launched.pid, ...)`` then reaches what it started
        too."""
        self.args = cmd
        handle, self._log = tempfile.mkstemp(prefix="launch-", suffix=".log", dir=_LOGS.name)
        os.close(handle)
        self.returncode: int | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        cwd = str(cwd or os.getcwd())
        if _forkable(cmd):
            request = {"op": "spawn", "argv": cmd, "env": env, "cwd": cwd, "log": self._log,
                       "session": new_session}  # fmt: skip
            self.pid: int = _PREFORK.ask(request)["pid"]
        else:
            with open(self._log, "wb") as log:
                self._popen = subprocess.Popen(
                    cmd, env=env, cwd=cwd, stdout=log, stderr=log, start_new_session=new_session
                )
            self.pid = self._popen.pid

    def wait(self, timeout: float) -> int:
        """The exit status; ``subprocess.TimeoutExpired`` if it still runs after ``timeout``."""
        if self.returncode is None:
            if self._popen is not None:
                self.returncode = self._popen.wait(timeout=timeout)
            else:
                code = _PREFORK.ask({"op": "wait", "pid": self.pid, "timeout": timeout})["code"]
                if code is None:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                self.returncode = code
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, 9)
            self.wait(60)

    def output(self) -> str:
        return Path(self._log).read_text(errors="replace")


@contextlib.contextmanager
def forked_spawns() -> Iterator[None]:
    """Within it, the processes multiprocessing's ``spawn`` starts from this process are forked
    by the prefork launcher (its stand-in is their executable), not fresh interpreters: each is
    still a new process that starts from none of this process's state, only from what spawn
    sends it, without the 8 s of imports."""
    if os.environ.get("PIPEMARE_TESTS_FRESH"):
        yield
        return
    before = multiprocessing.spawn.get_executable()
    multiprocessing.set_executable(_PREFORK.ask({"op": "stand-in"})["path"])
    try:
        yield
    finally:
        multiprocessing.set_executable(before)


def run(
    cmd: list[str], env: dict[str, str], timeout: float, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, ...)`` with stdout and stderr together in ``stdout``; killed (only
    it) and ``subprocess.TimeoutExpired`` raised after ``timeout``."""
    launched = Launched(cmd, env, cwd)
    try:
        code = launched.wait(timeout)
    finally:
        launched.kill()
    return subprocess.CompletedProcess(cmd, code, launched.output(), "")


def ranks(cmd: list[str], world: int, env: dict[str, str] | None = None) -> list[Command]:
    """Every rank of a one-node run of ``cmd``, each with the environment Lightning's launcher
    would have given it (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), and
    ``RANK`` as torchrun gives it."""
    env = env if env is not None else environment()
    port = str(free_port())
    shared = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK="0", WORLD_SIZE=str(world))
    return [(cmd, {**env, **shared, "LOCAL_RANK": str(r), "RANK": str(r)}) for r in range(world)]


def run_all(commands: list[Command], timeout: float = 900) -> None:
    """Start every command and wait for all; show the output of failures. Kills only its own."""
    procs = [Launched(cmd, env) for cmd, env in commands]
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, code in zip(procs, codes, strict=True):
        assert code == 0, f"launch failed ({code}):\n{p.output()[-6000:]}"


def run_here(main: Callable[[list[str]], None], *args: str) -> None:
    """Run a worker script's ``main(args)`` in this process: a one-device reference needs no
    process of its own (a launch costs seconds of imports). The worker sets one intra-op thread,
    as its launched processes have; this process's count is put back after."""
    threads = torch.get_num_threads()
    try:
        main(list(args))
    finally:
        torch.set_num_threads(threads)


def reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"report-rank{r}.json").read_text()) for r in range(world)]
