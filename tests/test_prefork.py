"""The test launcher's stand-in for ``sys.executable`` (tests/support/prefork.py): a process the
suite launched that starts another Python script with it gets a forked process that behaves as
a fresh one would: its exit status or signal, its own file descriptors, signals handed on, and
killed with the stand-in. What it does not hand over runs on the real interpreter.

One launched script (PARENT) checks each of these from the inside, as Lightning's launcher and
torchrun start their processes, and reports what it saw."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from support.launch import environment, run

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("PIPEMARE_TESTS_FRESH")), reason="the prefork launcher is off"
)

CHILD = r"""
import json, os, signal, sys, time

def _open(fd):  # listing /proc/self/fd opens one more, closed by the time this asks
    return os.path.exists(f"/proc/self/fd/{fd}")

# a forked process starts with the launcher's imports done; a fresh interpreter without them
forked = "torch" in sys.modules
what = sys.argv[1]
if what == "status":
    print("forked" if forked else "fresh", flush=True)
    sys.exit(7)
if what == "fd":  # writes to a descriptor it was handed, at the number it was handed at
    os.write(int(sys.argv[2]), b"through the handed-over descriptor")
    sys.exit(0)
if what == "open":  # which of its descriptors are open (a fresh process: 0, 1, 2 only)
    print(sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2 and _open(fd)))
if what == "term":  # (a signal handler writes with os.write: print is not reentrant)
    def stop(signum, frame):
        os.write(1, f"stopped by {signum}\n".encode())
        os._exit(3)
    signal.signal(signal.SIGTERM, stop)
    os.write(1, b"ready\n")
    time.sleep(600)
if what == "kill-self":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "wait":  # says its pid, then waits to be killed
    print(os.getpid(), flush=True)
    time.sleep(600)


def tell(queue):  # in a process spawn started: it imported this file again, not as __main__
    queue.put(["forked" if forked else "fresh", __name__])


if what == "spawn" and __name__ == "__main__":  # the stand-in as support.launch.forked_spawns
    import multiprocessing  # makes it: spawn's processes are forked, and get what it sends

    multiprocessing.set_executable(sys.executable)
    context = multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    spawned = context.Process(target=tell, args=(queue,))
    spawned.start()
    spawned.join(120)
    print(json.dumps([spawned.exitcode, queue.get() if not queue.empty() else None]))
"""

PARENT = """
import json, os, signal, subprocess, sys, time
child, out = sys.argv[1], {}

done = subprocess.run([sys.executable, child, "status"], capture_output=True, text=True)
out["status"] = [done.returncode, done.stdout.strip()]

read, write = os.pipe()
done = subprocess.run([sys.executable, child, "fd", str(write)], pass_fds=[write])
os.close(write)
out["fd"] = [done.returncode, os.read(read, 100).decode()]

done = subprocess.run([sys.executable, "-u", child, "open"], capture_output=True, text=True)
out["open"] = done.stdout.strip()

proc = subprocess.Popen(
    [sys.executable, child, "term"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
)
assert proc.stdout.readline().strip() == "ready"  # its handler is set
proc.send_signal(signal.SIGTERM)  # to the stand-in, which hands it on
out["term"] = [proc.wait(timeout=120), proc.stdout.read().strip(), proc.stderr.read()]

out["kill-self"] = subprocess.run([sys.executable, child, "kill-self"]).returncode

proc = subprocess.Popen([sys.executable, child, "wait"], stdout=subprocess.PIPE, text=True)
pid = int(proc.stdout.readline())
proc.kill()  # the stand-in, by SIGKILL: it can hand nothing on
proc.wait(timeout=120)
for _ in range(1200):  # the launcher kills the process it stood for (at most 2 minutes)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            gone = stat.read().split(") ")[1].startswith("Z")  # killed, not yet reaped
    except FileNotFoundError:
        gone = True
    if gone:
        break
    time.sleep(0.1)
out["stand-in killed"] = [pid != proc.pid, gone]

done = subprocess.run([sys.executable, child, "spawn"], capture_output=True, text=True)
out["spawn"] = [done.returncode, done.stdout.strip(), done.stderr[-2000:]]

done = subprocess.run(
    [sys.executable, "-c", "import sys; print('torch' in sys.modules)"],
    capture_output=True, text=True,
)
out["-c"] = done.stdout.strip()
print("REPORT " + json.dumps(out))
"""


def test_a_launched_process_starts_forked_processes_that_behave_as_fresh_ones(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(CHILD))
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(PARENT))
    done = run([sys.executable, str(parent), str(child)], environment(), timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("REPORT ")]
    report = json.loads(line.removeprefix("REPORT "))

    assert report["status"] == [7, "forked"]  # forked, and its exit status comes back
    assert report["fd"] == [0, "through the handed-over descriptor"]
    assert report["open"] == "[]"  # nothing of the launcher's or the stand-in's left open
    assert report["term"][:2] == [3, "stopped by 15"], report["term"][2]  # SIGTERM handed on
    assert report["kill-self"] == -9  # killed by a signal: the stand-in dies of the same one
    assert report["stand-in killed"] == [True, True]  # the stand-in killed: the process too
    assert report["-c"] == "False"  # `-c` runs on the real interpreter, fresh
    # multiprocessing's spawn, through the stand-in: forked, and what it sent came back
    assert report["spawn"][:2] == [0, '[0, ["forked", "__mp_main__"]]'], report["spawn"][2]
