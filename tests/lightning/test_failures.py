"""A stage killed (SIGKILL), stopped (SIGSTOP) or hung in a native call mid-epoch: every
process exits non-zero within 60 s, and the error names the stage, its rank, host and PID and
what its process is doing; a stage that is only slow is never reported. Real processes,
signals sent by PID."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from pipemare.engine.watchdog import Peer, describe_process
from support.launch import Launched, environment, ranks, run, run_all

pytestmark = pytest.mark.distributed
SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the worker scripts


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start(tmp_path: Path, *flags: str) -> Launched:
    """The run, in a process group of its own: Lightning's launcher starts rank 1 from it."""
    cmd = [sys.executable, str(SUPPORT / "stall_worker.py"), "--out", str(tmp_path), *flags]
    return Launched(cmd, environment(), new_session=True)


def _kill_run(proc: Launched) -> None:
    """End the run this test started, both ranks (its process group), if still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _ready(proc: Launched, tmp_path: Path) -> list[int]:
    """Wait until rank 1 reached step 5; the two ranks' PIDs. A run that fails to get there
    is ended, both ranks: left alone, it would train on for the rest of the suite."""
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        pids = [int((tmp_path / f"pid-rank{r}").read_text()) for r in range(2)]
        assert int((tmp_path / "ready").read_text()) == pids[1]
        return pids
    except BaseException:
        _kill_run(proc)
        raise


def _end(proc: Launched, pids: list[int], start: float) -> tuple[int, str, float, list]:
    """Wait for the run to end: its exit code, output, the seconds from ``start`` until every
    process was gone, and those still alive after 90 s."""
    try:
        proc.wait(timeout=120)
        out = proc.output()
        while any(_alive(p) for p in pids) and time.monotonic() - start < 90:
            time.sleep(0.5)
        code = proc.wait(0)
        return code, out, time.monotonic() - start, [p for p in pids if _alive(p)]
    finally:
        _kill_run(proc)  # both ranks, whatever the test did to them


def _names_stage_1(out: str, pid: int) -> bool:
    return f"stage 1 (rank 1, host {os.uname().nodename}, pid {pid})" in out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_a_stage_killed_or_stopped_ends_every_process_naming_it(tmp_path, sig):
    """stall_timeout at its default (300 s): a stopped stage is found by its heartbeat (5 s
    here; the default is 10 s)."""
    proc = _start(tmp_path, "--heartbeat-timeout", "5")
    pids = _ready(proc, tmp_path)
    start = time.monotonic()
    os.kill(pids[1], sig)
    code, out, elapsed, left = _end(proc, pids, start)
    assert code != 0, out[-3000:]
    assert not left and elapsed < 60, (elapsed, left, out[-3000:])
    assert _names_stage_1(out, pids[1]), out[-4000:]
    want = "is gone (killed" if sig == signal.SIGKILL else "is stopped (SIGSTOP"
    assert want in out, out[-4000:]
    # how far the failed stage got: it was signalled after step 5 (its own report)
    completed = [int(n) for n in re.findall(r"when it had completed (\d+) steps", out)]
    assert completed and min(completed) >= 3, out[-4000:]


def test_a_send_posted_to_a_stage_that_died_names_it(tmp_path):
    """gloo can find the connection to a dead stage reset as a send is posted, before any wait
    (once in CI, under load, the killed-stage test above got that raw error): posting is
    watched as waiting is, and the error names the stage."""
    cmd = [sys.executable, str(SUPPORT / "posting_worker.py"), "--out", str(tmp_path)]
    run_all(ranks(cmd, 2), timeout=240)
    record = json.loads((tmp_path / "posting.json").read_text())
    assert record["reset_seen"], "the connection to the dead stage was never reported reset"
    assert record["raised"] == "StageFailedError", record
    assert _names_stage_1(record["message"], record["pid"]), record["message"]
    assert "its connection (sending the act of microbatch 0)" in record["message"]


def test_a_stage_hung_in_a_native_call_is_named_when_its_heartbeat_stops(tmp_path):
    """A native call that keeps the interpreter lock stops the heartbeat: the peer names the
    stage once it has been silent for heartbeat_timeout (5 s here), not before, and long
    before stall_timeout (300 s)."""
    proc = _start(tmp_path, "--mode", "native", "--heartbeat-timeout", "5")
    pids = _ready(proc, tmp_path)  # rank 1 wrote "ready", then entered the call
    code, out, elapsed, left = _end(proc, pids, time.monotonic())
    assert code != 0, out[-3000:]
    assert not left and elapsed < 60, (elapsed, left, out[-3000:])
    assert _names_stage_1(out, pids[1]), out[-4000:]
    assert "is running but does not beat" in out, out[-4000:]
    silence = [int(s) for s in re.findall(r"no heartbeat from it for (\d+) s", out)]
    assert silence and min(silence) >= 5, out[-4000:]


def test_a_healthy_stage_slower_than_the_heartbeat_timeout_is_never_reported(tmp_path):
    """One forward of stage 1 takes 6 s, with heartbeat_timeout=4 s: the run ends normally."""
    proc = _start(tmp_path, "--mode", "slow", "--slow", "6", "--heartbeat-timeout", "4",
                  "--max-steps", "8")  # fmt: skip
    try:
        code = proc.wait(timeout=240)
        out = proc.output()
    finally:
        _kill_run(proc)
    assert code == 0, out[-4000:]
    assert "pipemare: stage" not in out, out[-4000:]
    assert all((tmp_path / f"finished-rank{r}").exists() for r in range(2)), out[-4000:]


def test_a_stage_that_raised_and_is_slow_to_exit_is_named_failed_not_hung(tmp_path):
    """Stage 1 raises, then takes 10 s to finalise its logger with heartbeat_timeout=4 s:
    stage 0 names it as failed with its own error, not as a process stuck without a beat."""
    proc = _start(tmp_path, "--mode", "raise", "--slow", "10", "--heartbeat-timeout", "4")
    pids = _ready(proc, tmp_path)
    code, out, elapsed, left = _end(proc, pids, time.monotonic())
    assert code != 0, out[-3000:]
    assert not left and elapsed < 60, (elapsed, left, out[-3000:])
    assert _names_stage_1(out, pids[1]), out[-4000:]
    assert "failed with an error of its own (RuntimeError: boom at step 5)" in out, out[-4000:]
    assert "does not beat" not in out, out[-4000:]


def test_a_killed_process_is_named_gone_every_time():
    """The race behind a flake: a killed process closes its connections while it exits,
    before /proc reads it as a zombie. 20 kills in a row (a worker process forks its
    victims): each time the connection closed, the process is described as gone."""
    proc = run([sys.executable, str(SUPPORT / "kill_loop_worker.py"), "20"], environment(), 240)
    assert proc.returncode == 0, proc.stdout[-6000:]
    states = [ln for ln in proc.stdout.splitlines() if ln.startswith("settled: ")]
    assert len(states) == 20, proc.stdout
    assert all(s == "settled: is gone (killed or crashed)" for s in states), proc.stdout


def test_describe_process_tells_gone_from_running():
    me = Peer(0, 0, os.uname().nodename, os.getpid())
    assert describe_process(me) == "is running but did not answer"
    assert describe_process(Peer(0, 0, me.host, 2**22 + 12345)) == "is gone (killed or crashed)"
    assert describe_process(Peer(0, 0, "another-host", 1)) == "is on another host"
