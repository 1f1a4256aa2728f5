"""The one executor: runs the action streams of this process's stages against a transport.

Each stage only reads messages and its own state, so the result does not depend on how the
stages' actions interleave (a Kahn process network): running all stages round-robin in one
process and one stage per process give the same weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pipemare.engine.clip import GradClip
from pipemare.engine.errors import NonFiniteGradientError
from pipemare.engine.microbatch import zero_loss
from pipemare.engine.payload import as_payload
from pipemare.engine.replicas import GradientAverager
from pipemare.engine.stage import Stage
from pipemare.engine.telemetry import Probe
from pipemare.engine.ties import TiedWeights
from pipemare.engine.transport import ACT, GRAD, Transport
from pipemare.optim.optimizer import PipeMareOptimizer
from pipemare.schedule.actions import Action, Op, drain_tail

__all__ = ["Executor"]


class _Worker:
    """One stage's position in its action stream."""

    def __init__(self, stage: Stage, actions: Iterator[Action]) -> None:
        self.stage = stage
        self._actions = actions
        self.next: Action | None = next(actions, None)
        self.pending: set[int] = set()  # forwarded, not yet backwarded

    def advance(self) -> None:
        self.next = next(self._actions, None)

    def restart(self, actions: Iterator[Action]) -> None:
        self._actions = actions
        self.advance()


class Executor:
    """Drives the local stages' schedules.

    Args:
        stages: this process's stages (all P in one process, or one).
        num_stages: P.
        microbatches: N.
        streams: ``(stage, start_minibatch) -> actions``, see :func:`pipemare.schedule.stream`.
        transport: moves payloads between stages.
        optimizer: applies updates.
        input_fn: microbatch -> stage 0's input.
        loss_fn: (last stage output, microbatch) -> scalar loss.
        clip: gradient clipping applied right before each update.
        check_finite: check each stage's gradients right before its update; non-finite ones
            are not applied (see :attr:`on_nonfinite`).
    """

    def __init__(
        self,
        stages: list[Stage],
        num_stages: int,
        microbatches: int,
        streams: Callable[[int, int], Iterator[Action]],
        transport: Transport,
        optimizer: PipeMareOptimizer,
        input_fn: Callable[[Any], Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        clip: GradClip | None = None,
        check_finite: bool = True,
        ties: TiedWeights | None = None,
    ) -> None:
        self.num_stages, self.microbatches = num_stages, microbatches
        self.check_finite = check_finite
        self.transport, self.optimizer = transport, optimizer
        self.input_fn, self.loss_fn = input_fn, loss_fn
        self.clip = clip
        self.ties = ties if ties else None
        self._streams = streams
        self.workers = [_Worker(s, streams(s.index, 0)) for s in stages]
        self.fed = 0  # microbatches available
        self.drained_at = 0  # ``fed`` when the pipeline was last emptied
        self._consumers = {0, num_stages - 1} & {s.index for s in stages}
        self._data: dict[int, list[Any]] = {}  # microbatch -> [data, weight, uses left]
        self._losses: dict[int, list[Any]] = {}  # minibatch -> [sum, count]
        self._scale: dict[int, float] = {}  # microbatch -> share of its minibatch (last stage)
        #: telemetry, when a monitor attached a probe
        self.probe: Probe | None = None
        #: called with ``(minibatch, loss)`` where the last stage runs, the moment every
        #: microbatch of the minibatch has passed the loss (before their backward passes)
        self.on_minibatch: Callable[[int, torch.Tensor], None] | None = None
        #: called with ``(stage, minibatch, names)`` when a stage's gradients are not finite
        #: at its update, which is then skipped; None: raise NonFiniteGradientError at once
        self.on_nonfinite: Callable[[int, int, list[str]], None] | None = None
        #: called with ``(stage, minibatch, params)`` at each update, when ``.grad`` holds
        #: exactly that stage's gradient of that minibatch; it replaces the clipping (its owner
        #: clips through :attr:`clip`). None: clip with :attr:`clip` only
        self.on_update: Callable[[int, int, list[torch.nn.Parameter]], None] | None = None
        #: called with ``(microbatch, loss, share)`` where the last stage runs, right after
        #: each microbatch's forward: the loss its backward pass will propagate (the
        #: microbatch's loss times ``share``, its share of the minibatch)
        self.on_loss: Callable[[int, torch.Tensor, float], None] | None = None
        #: called with ``(stage, minibatch)`` before each update could run, ahead of every other
        #: check; False holds the update back (it is asked again). None: no such gate
        self.update_gate: Callable[[int, int], bool] | None = None
        #: per local stage, the index of the latest action of each kind it ran
        self.done: dict[int, dict[Op, int]] = {s.index: {} for s in stages}
        #: called with ``(stage, action)`` after each action (see :mod:`pipemare.engine.snapshot`)
        self.watchers: list[Callable[[int, Action], None]] = []
        #: averages gradients over the stage's replicas (D copies of the pipeline), or None
        self.reducer: GradientAverager | None = None
        self._backwards: dict[tuple[int, int], int] = {}  # (stage, minibatch) -> backwards run

    # -- data in, losses out ---------------------------------------------------------------

    def feed(self, microbatches: list[Any], weights: list[float]) -> None:
        for mb, w in zip(microbatches, weights, strict=True):
            if self._consumers:
                self._data[self.fed] = [mb, w, len(self._consumers)]
            self.fed += 1

    def _take(self, m: int) -> tuple[Any, float]:
        entry = self._data[m]
        entry[2] -= 1
        if entry[2] == 0:
            del self._data[m]
        return entry[0], entry[1]

    def minibatch_loss(self, k: int) -> torch.Tensor | None:
        """Minibatch ``k``'s loss once all its microbatches passed the last stage, else None."""
        entry = self._losses.get(k)
        if entry is None or entry[1] < self.microbatches:
            return None
        return entry[0]

    def pop_loss(self, k: int) -> torch.Tensor | None:
        loss = self.minibatch_loss(k)
        if loss is not None:
            del self._losses[k]
        return loss

    # -- running ---------------------------------------------------------------------------

    def _runnable(self, w: _Worker) -> bool:
        a, i = w.next, w.stage.index
        if a is None:
            return False
        if a.op is Op.FORWARD:
            if a.index >= self.fed:
                return False
            if self.ties is not None and not self.ties.weights_ready(i):
                return False
            return i == 0 or self.transport.ready(i - 1, i, ACT)
        if a.op is Op.BACKWARD:
            return i == self.num_stages - 1 or self.transport.ready(i + 1, i, GRAD)
        if self.update_gate is not None and not self.update_gate(i, a.index):
            return False
        if self.reducer is not None:  # the replicas' mean, before anything reads the gradients
            self.reducer.finish(i, a.index)
        if self.ties is not None and not self.ties.gradients_ready(i, a.index):
            return False  # a tied weight's owner adds the other holders' contributions first
        if self.clip is not None:  # the update's gradients are complete: publish their norm
            self.clip.post(i, a.index, self.optimizer.stage_parameters(i))
            return self.clip.ready(i, a.index)
        return True

    def at_update(self, minibatch: int) -> bool:
        """Whether every local stage has run all its backward passes of ``minibatch`` and no
        later action: each is about to apply that update, or has applied it. In a flushing
        schedule this is the moment each stage's gradient of the minibatch is whole."""
        for w in self.workers:
            a = w.next
            waiting = a is not None and a.op is Op.UPDATE and a.index == minibatch
            if not waiting and self.done[w.stage.index].get(Op.UPDATE, -1) < minibatch:
                return False
        return True

    def _timing(self) -> bool:
        return self.probe is not None and self.probe.timeline

    def _recv(self, src: int, dst: int, channel: str, m: int) -> Any:
        if not self._timing():
            return self.transport.recv(src, dst, channel, m)
        assert self.probe is not None
        start = self.probe.now()
        payload = self.transport.recv(src, dst, channel, m)
        self.probe.record(dst, "recv", m, start)
        return payload

    def _send(self, src: int, dst: int, channel: str, m: int, payload: Any) -> None:
        if not self._timing():
            self.transport.send(src, dst, channel, m, payload)
            return
        assert self.probe is not None
        start = self.probe.now()
        self.transport.send(src, dst, channel, m, payload)
        self.probe.record(src, "send", m, start)

    def _run(self, w: _Worker, a: Action) -> None:
        i = w.stage.index
        if not self._timing():
            self._act(w, a)
        else:
            assert self.probe is not None
            start = self.probe.now()
            self._act(w, a)
            self.probe.record(i, a.op.value, a.index, start)
        self.done[i][a.op] = a.index
        if self.watchers:  # a checkpoint being taken (rare): copy, a watcher may remove itself
            for watch in list(self.watchers):
                watch(i, a)

    def _act(self, w: _Worker, a: Action) -> None:
        stage, i, last = w.stage, w.stage.index, w.stage.index == self.num_stages - 1
        probe = self.probe
        if a.op is Op.FORWARD:
            m = a.index
            if self.ties is not None:
                self.ties.install(i, m)
                self.ties.forwarded(i, m)
            if i == 0:
                data, weight = self._take(m)
                inputs = self.input_fn(data)
            else:
                inputs = self._recv(i - 1, i, ACT, m)
            if last:
                data, weight = self._take(m) if i > 0 else (data, weight)
                head = (lambda y: self.loss_fn(y, data)) if weight else zero_loss
                out = stage.forward(m, inputs, head=head)
                k = m // self.microbatches
                entry = self._losses.setdefault(k, [0.0, 0])
                entry[0] = entry[0] + out.detach() * weight
                entry[1] += 1
                self._scale[m] = weight
                if self.on_loss is not None and weight and out.requires_grad:
                    self.on_loss(m, out * weight, weight)
                if entry[1] == self.microbatches and self.on_minibatch is not None:
                    self.on_minibatch(k, entry[0])
            else:
                out = stage.forward(m, inputs)
                self._send(i, i + 1, ACT, m, as_payload(out, i))
            if probe is not None:
                probe.forward(stage, m, out)
            w.pending.add(m)
        elif a.op is Op.BACKWARD:
            m = a.index
            if probe is not None:
                probe.backward(stage, m, stage.forward_version(m))
            if last:
                grads = stage.backward(m, None, scale=self._scale.pop(m))
            else:
                grads = stage.backward(m, self._recv(i + 1, i, GRAD, m))
                self.transport.release(i + 1, i, GRAD, m)
            w.pending.discard(m)
            if i > 0:
                self.transport.release(i - 1, i, ACT, m)  # the input's last use was above
                self._send(i, i - 1, GRAD, m, grads)
            if self.reducer is not None:
                self._count_backward(i, m)
        else:
            if self.ties is not None:
                self.ties.contribute(i, a.index)
            params = self.optimizer.stage_parameters(i)
            if probe is not None:
                probe.update(i, a.index, params)
            if self.on_update is not None:
                self.on_update(i, a.index, params)
            elif self.clip is not None:
                self.clip.apply(i, a.index, params)
            stage.before_update()
            bad, norms = self._nonfinite(stage) if self.check_finite else ([], None)
            if bad:
                self.optimizer.skip(i, a.index)
                if self.on_nonfinite is None:
                    raise NonFiniteGradientError(a.index + 1, i, bad)
                self.on_nonfinite(i, a.index, bad)
            else:
                self.optimizer.step(i, a.index, grad_norms=norms)
            if self.ties is not None:
                self.ties.updated(i)
            stage.after_update()
            self.transport.progress(i, a.index + 1)

    def _count_backward(self, i: int, m: int) -> None:
        """After a minibatch's last backward pass on stage ``i``, start averaging its gradients."""
        assert self.reducer is not None
        key = (i, m // self.microbatches)
        done = self._backwards.get(key, 0) + 1
        if done < self.microbatches:
            self._backwards[key] = done
            return
        self._backwards.pop(key, None)
        params = self.optimizer.stage_parameters(i)
        if self.ties is not None:  # a copy's contribution is averaged before it goes to the owner
            params = params + self.ties.copies_on(i)
        self.reducer.start(i, key[1], params)

    @staticmethod
    def _nonfinite(stage: Stage) -> tuple[list[str], dict[torch.nn.Parameter, torch.Tensor]]:
        """Names of ``stage``'s parameters whose gradient holds NaN or Inf (one sync), and,
        where there is none, each gradient's 2-norm (the stability guard reads them)."""
        named = [(n, p) for n, p in stage.module.named_parameters() if p.grad is not None]
        if not named:
            return [], {}
        norms = torch._foreach_norm([p.grad for _, p in named if p.grad is not None])
        if torch.isfinite(torch.linalg.vector_norm(torch.stack(norms))):
            return [], {p: norm for (_, p), norm in zip(named, norms, strict=True)}
        bad = [n for n, p in named if p.grad is not None and not bool(p.grad.isfinite().all())]
        return bad, {}

    def run(self) -> None:
        """Run every local stage as far as the fed data allows; all must end waiting for data."""
        progressed = True
        while progressed:
            progressed = False
            for w in self.workers:
                while self._runnable(w):
                    assert w.next is not None
                    self._run(w, w.next)
                    w.advance()
                    progressed = True
        for w in self.workers:
            a = w.next
            if a is not None and not (a.op is Op.FORWARD and a.index >= self.fed):
                raise RuntimeError(
                    f"pipeline deadlock: stage {w.stage.index} waits to run {a} but no stage "
                    "can make progress; this is a bug in the schedule, please report it"
                )

    def restart(self, minibatches: int) -> None:
        """Start the streams afresh at ``minibatches`` (the pipeline must be empty)."""
        assert all(not w.pending for w in self.workers), "restart needs a drained pipeline"
        self.fed = self.drained_at = minibatches * self.microbatches
        for w in self.workers:
            w.restart(self._streams(w.stage.index, minibatches))

    def drain(self) -> None:
        """Finish every microbatch in flight (backward passes and updates); nothing new starts."""
        start = self.fed // self.microbatches
        for w in self.workers:
            tail = drain_tail(sorted(w.pending), self.microbatches)
            w.restart(itertools.chain(tail, self._streams(w.stage.index, start)))
        self.run()
        if self.ties is not None:
            self.ties.sync()
        self.transport.flush()
        self.drained_at = self.fed
