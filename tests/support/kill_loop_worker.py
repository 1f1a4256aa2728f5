"""Kill a child by SIGKILL, N times, and describe it as a peer would once its connection
closes: once at once (which can catch the exiting process still "running"), and once
settled (what the watchdog reports). Prints one "settled: ..." line per kill."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from pipemare.engine.watchdog import Peer, describe_process


def _child(sock: socket.socket) -> None:
    ballast = bytearray(256 * 2**20)  # memory to tear down: a longer exit, as a stage's
    ballast[::4096] = b"x" * len(ballast[::4096])
    for _ in range(4):  # threads, as torch's and the heartbeat's
        threading.Thread(target=sock.recv, args=(1,), daemon=True).start()
    sock.recv(1)  # until killed
    os._exit(0)


def main() -> None:
    n, early_running = int(sys.argv[1]), 0
    host = socket.gethostname()
    for _ in range(n):
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            mine.close()
            _child(theirs)
        theirs.close()
        os.kill(pid, signal.SIGKILL)
        assert mine.recv(1) == b"", "the connection should close when the child dies"
        peer = Peer(1, 1, host, pid)
        if describe_process(peer).startswith("is running"):
            early_running += 1
        print("settled:", describe_process(peer, settle=5.0), flush=True)
        os.waitpid(pid, 0)
        mine.close()
    print(f"read as running at the moment the connection closed: {early_running} of {n}")


if __name__ == "__main__":
    main()
