"""Where a forward action of the two-process run goes beyond its layers (issue 62).

``where.py`` found each forward of the dispatch-bound GPT's two-process run 1.1-1.5 ms longer
than setup charges it. This runs ``where.py`` as it is (same arguments) with two clocks added
in every process, on the run's own forwards from microbatch 20 on (step 10 at N = 2; the
calibration pipelines at setup are left out): around the stage's forward
(:meth:`pipemare.engine.stage.Stage.forward`: its layers, weight prediction, the versions kept,
the random state) and around its segments' calls alone. Rank 0 writes the medians to
``--parts`` (default ``forward_parts.txt`` in the working directory). Against ``where.py``'s
``F`` (the executor's whole action, which also takes the microbatch, runs the input function
and sends the output), the difference says what sits outside the stage's forward. Run alone::

    python experiments/results/links/forward_parts.py 64 4 32 pipemare --out /tmp/where.jsonl
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pipemare.engine.stage as stage_module
from pipemare.engine.executor import Executor
from pipemare.engine.transport import ACT
from pipemare.lightning.steps import UserSteps
from pipemare.model.segments import Segment

WHERE = Path(__file__).resolve().with_name("where.py")
_times: dict[str, list[float]] = {
    "stage forward": [],
    "its segments' calls": [],
    "its head": [],
    "the input function": [],
    "the output sent": [],
}
_inside = [0.0, 0.0]
_stage_forward = stage_module.Stage.forward
_segment_forward = Segment.forward
_input = UserSteps.input
_send = Executor._send


def _timed_input(self: UserSteps, microbatch: Any) -> Any:
    """The first stage's input function (the user's step up to its model), in the run."""
    start = time.perf_counter()
    try:
        return _input(self, microbatch)
    finally:
        if len(_times["stage forward"]) > 0:  # from microbatch 20 on, as the forwards
            _times["the input function"].append(time.perf_counter() - start)


def _timed_send(self: Executor, src: int, dst: int, channel: str, m: int, payload: Any) -> None:
    """A forward's output handed to the transport, in the run."""
    start = time.perf_counter()
    try:
        _send(self, src, dst, channel, m, payload)
    finally:
        if channel == ACT and m >= 20:
            _times["the output sent"].append(time.perf_counter() - start)


def _timed_segment(self: Segment, values: Any) -> Any:
    start = time.perf_counter()
    try:
        return _segment_forward(self, values)
    finally:
        _inside[0] += time.perf_counter() - start


def _timed_stage(self: Any, microbatch: int, *args: Any, **kwargs: Any) -> Any:
    run = len(self.module) > 0 and isinstance(self.module[0], Segment)
    if not (run and microbatch >= 20 and kwargs.get("grad", True)):
        return _stage_forward(self, microbatch, *args, **kwargs)
    _inside[0] = _inside[1] = 0.0
    head = kwargs.get("head", args[1] if len(args) > 1 else None)
    if head is not None:  # the last stage's: the loss on the layers' output

        def timed_head(outputs: Any) -> Any:
            start = time.perf_counter()
            try:
                return head(outputs)
            finally:
                _inside[1] += time.perf_counter() - start

        if "head" in kwargs:
            kwargs["head"] = timed_head
        else:
            args = (args[0], timed_head, *args[2:])
    start = time.perf_counter()
    out = _stage_forward(self, microbatch, *args, **kwargs)
    _times["stage forward"].append(time.perf_counter() - start)
    _times["its segments' calls"].append(_inside[0])
    _times["its head"].append(_inside[1])
    return out


def _write(path: Path) -> None:
    rank = os.environ.get("LOCAL_RANK", "0")
    if not _times["stage forward"]:
        return
    lines = [
        f"rank {rank}, {name}: median {1000 * statistics.median(values):.3f} ms over {len(values)}"
        for name, values in _times.items()
        if values
    ]
    if rank != "0":  # each rank its own file: rank 1's beside rank 0's
        path = path.with_name(f"{path.stem}-rank{rank}{path.suffix}")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    if "--parts" in sys.argv:  # through the environment, so the launched rank sees it too
        at = sys.argv.index("--parts")
        os.environ["FORWARD_PARTS"] = sys.argv[at + 1]
        del sys.argv[at : at + 2]
    stage_module.Stage.forward = _timed_stage  # type: ignore[method-assign]
    Segment.forward = _timed_segment  # type: ignore[method-assign]
    UserSteps.input = _timed_input  # type: ignore[method-assign]
    Executor._send = _timed_send  # type: ignore[method-assign]
    atexit.register(_write, Path(os.environ.get("FORWARD_PARTS", "forward_parts.txt")))
    # sys.argv[0] stays this script (runpy would make it where.py's): Lightning launches the
    # other rank with it, clocks and all
    spec = importlib.util.spec_from_file_location("where", WHERE)
    assert spec is not None and spec.loader is not None
    where = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(where)
    where.main()
