"""A launcher that has imported torch, Lightning and pipemare once (and scikit-learn's datasets,
which the digits load), and forks each launched worker from that state: a fresh interpreter
spends about 8 s of CPU on those imports, and the suite starts well over a hundred workers on
two cores.

Each launch is still a real process of its own: the fork's child takes the command's environment,
working directory, ``sys.path`` and warnings filters, runs the script (or ``-m`` module) as
``__main__``, then shuts down as an interpreter does (non-daemon threads joined, ``atexit``
handlers run) and exits with the script's status. Only what the imports above did is shared, and
they run in this launcher with the launched workers' base environment (``launch.environment``).

The protocol is one JSON line per request on stdin, one per answer on stdout:
``{"op": "spawn", "argv": [...], "env": {...}, "cwd": ..., "log": PATH, "session": B}`` ->
``{"pid": N}`` (``session``: in a session of its own) and
``{"op": "wait", "pid": N, "timeout": S}`` -> ``{"code": C}`` (``null`` while it still runs).
The launcher exits when its stdin closes.

**Processes the launched start.** In each launch ``sys.executable`` is a small stand-in
(written here, next to a socket of this launcher's) for this interpreter: where a launched
process starts another Python script or ``-m`` module with it (Lightning's launcher its other
ranks, torchrun its workers, a benchmark its torchrun), the stand-in hands the command to this
launcher, which forks it too, with the stand-in's environment, working directory, process
group where it may, and every file descriptor the stand-in was given (its stdin, stdout and
stderr, and any passed on). The stand-in stays in its place as that process: it hands on the
signals it receives, and exits as the process did (with its status, or killed by its signal);
killed itself, the process it stands for is killed too. So it does for a process that
multiprocessing's ``spawn`` starts (its ``-c "from multiprocessing.spawn import spawn_main; ..."``),
where a test has made the stand-in multiprocessing's executable (``{"op": "stand-in"}`` ->
``{"path": P}``): the spawned process still starts from none of its parent's state, only
from what the parent sends it. Anything else (other ``-c`` code, other options, a script inside
the installed packages) it runs with the real interpreter."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import io
import itertools
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings

#: the filters Python starts with: CPython's defaults after this launcher's own -W options
_DEFAULTS = list(warnings.filters)[len(sys.warnoptions) :]
_BEFORE = len(warnings.filters)

# the imports every launch would otherwise repeat; not wandb, whose import makes a temporary
# folder that the first launch to exit would delete for every later one; and scikit-learn's
# datasets (with pandas, 0.7 s), which support/data.py loads the digits most workers train on with
import pytorch_lightning  # noqa: E402, F401
import sklearn.datasets  # noqa: E402, F401
import torch  # noqa: E402, F401

import pipemare  # noqa: E402, F401

#: the filters those imports added, in front of the others (as ``filterwarnings`` puts them)
_ADDED = list(warnings.filters)[: len(warnings.filters) - _BEFORE]

#: this launcher's own path entries beyond the PYTHONPATH it was started with: site-packages
_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
_SITE = [p for p in sys.path[1:] if p not in _PYTHONPATH]

#: the real interpreter, which the stand-in runs for what it does not hand over
_PYTHON = sys.executable
#: where the installed packages are: a script there (torch's compile workers) is not forked
_INSTALLED = tuple(p for p in _SITE if "-packages" in p)

# The stand-in for ``sys.executable`` in every launch (see the module's docstring). It runs
# without site (-S) and ignores PYTHON* variables (-E): it starts in milliseconds.
_STAND_IN = """#!{python} -SE
import json, os, signal, socket, sys

PYTHON, SOCKET, INSTALLED = {python!r}, {socket!r}, {installed!r}
SPAWN = "from multiprocessing.spawn import spawn_main;"  # how multiprocessing's spawn starts
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2, signal.SIGCONT)


def handed_over(args):
    # the forms that are forked: [-u] [-B] [-W ARG] (SCRIPT.py | -m MODULE | -c SPAWN...) ARGS...
    options = []
    while args and (args[0] in ("-u", "-B") or args[0].startswith("-W") and args[0:2] != ["-W"]):
        take = 2 if args[0] == "-W" else 1  # -W ARG, or -WARG
        options, args = options + args[:take], args[take:]
    if len(args) > 1 and args[0] == "-m":
        return options, args
    if len(args) > 1 and args[0] == "-c" and args[1].startswith(SPAWN):
        return options, args
    if args and args[0].endswith(".py") and not os.path.abspath(args[0]).startswith(INSTALLED):
        return options, args
    return None


def main():
    args = sys.argv[1:]
    form = handed_over(args)
    if form is None:
        os.execv(PYTHON, [PYTHON, *args])
    options, command = form
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(SOCKET)
    except OSError:  # the launcher is gone: the real interpreter instead
        os.execv(PYTHON, [PYTHON, *args])
    # handed on from now: one that comes before the process is known waits for it (its
    # process can be running, and seen, before this learns its PID)
    pid, pending = None, []

    def hand_on(number, frame):
        if pid is None:
            pending.append(number)
        else:
            os.kill(pid, number)

    for sig in SIGNALS:
        signal.signal(sig, hand_on)
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if fd != sock.fileno() and _open(fd)]
    request = dict(
        argv=[PYTHON, *command], options=options, env=dict(os.environ), cwd=os.getcwd(),
        fds=fds, pgid=os.getpgid(0), sid=os.getsid(0),
    )
    socket.send_fds(sock, [json.dumps(request).encode()], fds)
    answer = sock.recv(1 << 16)
    if not answer:  # nothing was started
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        for number in pending:  # as it would have ended had it been there
            os.kill(os.getpid(), number)
        os.execv(PYTHON, [PYTHON, *args])
    pid = json.loads(answer)["pid"]
    for number in pending:
        os.kill(pid, number)
    answer = sock.recv(1 << 16)
    code = json.loads(answer)["code"] if answer else 1
    if code < 0:  # as the process ended: killed by this signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (those two take no handler)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def _open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


main()
"""


class _Server:
    """The socket the stand-ins hand their commands to, and the stand-in itself."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="pipemare-prefork-")
        self.address = os.path.join(self.folder, "socket")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.address)
        self.listener.listen(64)
        self.stand_in = os.path.join(self.folder, "python")
        with open(self.stand_in, "w") as f:
            f.write(_STAND_IN.format(python=_PYTHON, socket=self.address, installed=_INSTALLED))
        os.chmod(self.stand_in, 0o755)
        #: each handed-over process's stand-in connection, by the process's PID
        self.stand_ins: dict[int, socket.socket] = {}

    def close(self) -> None:
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def leave(self) -> None:
        """In a fork's child: close this launcher's sockets, which the child must not hold
        (a stand-in learns its launcher is gone when they close)."""
        self.listener.close()
        for conn in self.stand_ins.values():
            conn.close()


_SERVER: _Server | None = None


def _prepare(argv: list[str], env: dict[str, str], cwd: str, warn: list[str]) -> None:
    """What a fresh ``python ARGV`` would have set up before running its first line."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if argv[1] in ("-m", "-c"):
        first = cwd if argv[1] == "-m" else ""  # (as Python puts them)
    else:
        first = os.path.dirname(os.path.abspath(argv[1]))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_SITE]
    # as a fresh interpreter has them: its PYTHONWARNINGS over the defaults, then the imports'
    warnings.filters[:] = _DEFAULTS
    options = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o] + warn  # -W last
    sys.warnoptions[:] = options
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
        elif argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(argv[2], "<string>", "exec"), main.__dict__)
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


def _child(request: dict, stdio: tuple[int, int, int], unbuffered: bool = False) -> None:
    """A launch, in the fork's child: ``stdio`` become its stdin, stdout and stderr."""
    code = 1
    try:
        for target, fd in enumerate(stdio):
            if fd != target:
                os.dup2(fd, target)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout, sys.stderr = (_text(fd, unbuffered) for fd in (1, 2))
        options = request.get("options", [])
        warn = [v for o, v in itertools.pairwise(options) if o == "-W"]
        warn += [o[2:] for o in options if o.startswith("-W") and o != "-W"]
        _prepare(request["argv"], request["env"], request["cwd"], warn)
        if _SERVER is not None:  # what this launch starts with it is handed back here
            sys.executable = _SERVER.stand_in
        code = _run(request["argv"])
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _text(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    """The text stream ``sys.stdout`` or ``sys.stderr`` on ``fd``; ``-u``: written through."""
    if unbuffered:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw, line_buffering=True, write_through=True)
    return open(fd, "w", buffering=1, closefd=False)


def _logged(request: dict) -> None:
    """A launch asked for on stdin: its output into its log file, no input."""
    if request.get("session"):  # Popen's start_new_session
        os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _child(request, (os.open(os.devnull, os.O_RDONLY), log, log))


def _handed_over(request: dict, fds: list[int], server: _Server) -> None:
    """A launch a stand-in handed over: the stand-in's descriptors at their own numbers, in
    the stand-in's process group where the session allows it."""
    try:
        server.leave()
        # out of the way of the numbers they go to, then each to its own
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
        for fd in fds:
            os.close(fd)
        for target, fd in zip(request["fds"], high, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        for fd in {int(fd) for fd in os.listdir("/proc/self/fd")} - {0, 1, 2, *request["fds"]}:
            with contextlib.suppress(OSError):  # as a fresh process: only what it was given
                os.close(fd)
        if request["sid"] == os.getsid(0):
            with contextlib.suppress(OSError):
                os.setpgid(0, request["pgid"])
        if "-B" in request["options"]:
            sys.dont_write_bytecode = True
        given = set(request["fds"])
        modes = (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY)  # one it was not given: /dev/null
        stdio = tuple(t if t in given else os.open(os.devnull, modes[t]) for t in (0, 1, 2))
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    _child(request, stdio, unbuffered="-u" in request["options"])


def _fork() -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    return os.fork()


def main() -> None:
    global _SERVER
    server = _SERVER = _Server()
    select = selectors.DefaultSelector()
    select.register(0, selectors.EVENT_READ, "stdin")
    select.register(server.listener, selectors.EVENT_READ, "listener")
    lines: list[bytes] = [b""]
    finished: dict[int, int] = {}  # exit codes of the launches asked for on stdin
    waiting: tuple[int, float] | None = None  # a "wait" being answered: PID, deadline

    def answer(message: dict) -> None:
        os.write(1, (json.dumps(message) + "\n").encode())

    try:
        while True:
            for key, _ in select.select(timeout=0.02):
                if key.data == "stdin":
                    data = os.read(0, 1 << 16)
                    if not data:
                        return
                    lines[-1:] = (lines[-1] + data).split(b"\n")
                elif key.data == "listener":
                    conn, _ = server.listener.accept()
                    select.register(conn, selectors.EVENT_READ, "stand-in")
                else:  # a stand-in's request, or the stand-in gone
                    conn = key.fileobj  # type: ignore[assignment]
                    pid = next((p for p, c in server.stand_ins.items() if c is conn), None)
                    if pid is None:
                        message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 256)
                        if message:
                            pid = _fork()
                            if pid == 0:
                                _handed_over(json.loads(message), fds, server)
                            for fd in fds:
                                os.close(fd)
                            server.stand_ins[pid] = conn
                            conn.send(json.dumps({"pid": pid}).encode())
                            continue
                    elif conn.recv(1):  # nothing more is sent: only its end is read
                        continue
                    else:  # the stand-in was killed: so is the process it stands for
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        del server.stand_ins[pid]
                    select.unregister(conn)
                    conn.close()
            while True:  # every launch that ended: its stand-in told, or its code kept
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                code = os.waitstatus_to_exitcode(status)
                if pid not in server.stand_ins:
                    finished[pid] = code
                else:
                    conn = server.stand_ins.pop(pid)
                    with contextlib.suppress(OSError):
                        conn.send(json.dumps({"code": code}).encode())
                    select.unregister(conn)
                    conn.close()
            if waiting is not None:
                pid, deadline = waiting
                if pid in finished or time.monotonic() >= deadline:
                    answer({"code": finished.get(pid)})
                    waiting = None
            while waiting is None and len(lines) > 1:
                request = json.loads(lines.pop(0))
                if request["op"] == "stand-in":
                    answer({"path": server.stand_in})
                elif request["op"] == "spawn":
                    pid = _fork()
                    if pid == 0:
                        server.leave()
                        _logged(request)
                    answer({"pid": pid})
                elif request["pid"] in finished:
                    answer({"code": finished[request["pid"]]})
                else:
                    waiting = (request["pid"], time.monotonic() + request["timeout"])
    finally:
        server.close()


if __name__ == "__main__":
    main()
