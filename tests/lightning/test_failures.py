"""A stage killed (SIGKILL) or stopped (SIGSTOP) mid-epoch: every process exits non-zero within
60 s, and the error names the stage, its rank and PID. Real processes, signals sent by PID."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch import environment

from pipemare.engine.watchdog import Peer, describe_process

pytestmark = pytest.mark.distributed
TESTS = Path(__file__).resolve().parents[1]  # the workers live beside conftest.py


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run_and_signal(tmp_path: Path, sig: int) -> tuple[int, str, float, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "_stall_worker.py"), "--out", str(tmp_path)],
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        pids = [int((tmp_path / f"pid-rank{r}").read_text()) for r in range(3)]
        victim = int((tmp_path / "ready").read_text())
        assert victim == pids[1]
        start = time.monotonic()
        os.kill(victim, sig)
        out, _ = proc.communicate(timeout=120)
        elapsed = time.monotonic() - start
        while any(_alive(p) for p in pids) and time.monotonic() - start < 90:
            time.sleep(0.5)
        elapsed_all = time.monotonic() - start
        left = [p for p in pids if _alive(p)]
        return proc.returncode, out, max(elapsed, elapsed_all), left
    finally:
        for pid in [proc.pid, *pids]:  # only processes this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_a_stage_killed_or_stopped_ends_every_process_naming_it(tmp_path, sig):
    code, out, elapsed, left = _run_and_signal(tmp_path, sig)
    assert code != 0, out[-3000:]
    assert not left and elapsed < 60, (elapsed, left, out[-3000:])
    pid = int((tmp_path / "pid-rank1").read_text())
    assert "stage 1 (rank 1, host " in out and f"pid {pid})" in out, out[-4000:]
    want = "is gone" if sig == signal.SIGKILL else "is stopped"
    assert want in out, out[-4000:]
    # how far the failed stage got: it was signalled after step 5 (its own report)
    completed = [int(n) for n in re.findall(r"when it had completed (\d+) steps", out)]
    assert completed and min(completed) >= 3, out[-4000:]


def test_describe_process_tells_gone_from_running():
    me = Peer(0, 0, os.uname().nodename, os.getpid())
    assert describe_process(me) == "is running but did not answer"
    assert describe_process(Peer(0, 0, me.host, 2**22 + 12345)) == "is gone (killed or crashed)"
    assert describe_process(Peer(0, 0, "another-host", 1)) == "is on another host"
