"""Tied weights across stages: one parameter (a GPT's token embedding and its output head) that
layers on two or more stages hold.

The first stage that holds it *owns* it: its optimiser state, its update, its checkpoint entry.
Every later holder runs on a copy of it, so that with one process per stage the copies can live
apart and in one process they see exactly the weights they would see apart. Per step:

- a holder's gradient is its own contribution; at its update for minibatch ``k`` it sends that
  contribution to the owner (channel ``tie-grad``), which adds it to its own before clipping
  and stepping. Every holder's update of ``k`` comes after its last backward pass of ``k``,
  and the owner's after the others' (the owner is upstream), so this never waits on anything
  the schedule does not already wait for: the tie's gradient is the sum over the stages, as
  Megatron-LM's embedding all-reduce and DeepSpeed's ``TiedLayerSpec`` make it.
- when the owner forwards microbatch ``m`` it sends its weight version to every holder
  (channel ``tie-weight``), with the weights themselves when they changed since the last
  message; the holder installs them right before its own forward of ``m``. A holder thus runs
  ``m`` on exactly the weights the owner ran it on (weight prediction aside, which moves only
  the owner's forward): the copy's delay is the owner's forward delay, no stage stalls, and
  after each update the copies equal the owner's weights bit for bit once it reaches them.
- draining brings every copy up to the owner's final weights.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pipemare.engine.nostash import same_versions
from pipemare.engine.transport import Transport

__all__ = ["TIE_GRAD", "TIE_WEIGHT", "Tie", "TiedWeights", "tied_parameters", "untie"]

TIE_WEIGHT, TIE_GRAD = "tie-weight", "tie-grad"


@dataclass
class Tie:
    """One parameter held by several stages."""

    #: the owner's key for it in its stage module's state dict, e.g. ``"0.wte.weight"``
    name: str
    owner: int
    param: nn.Parameter
    #: every other holder: stage -> (key in that stage module's state dict, its copy)
    copies: dict[int, tuple[str, nn.Parameter]] = field(default_factory=dict)
    #: the copied layers of the holders, each with the user's layer it stands for
    layers: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)

    @property
    def stages(self) -> list[int]:
        """Every stage that holds the parameter, the owner first."""
        return [self.owner, *sorted(self.copies)]


#: where stages hold a parameter: stage -> every (layer, name in that layer) holding it
Holders = dict[int, list[tuple[str, str]]]


def tied_parameters(stage_modules: Sequence[nn.Module]) -> list[tuple[nn.Parameter, Holders]]:
    """The parameters that several of ``stage_modules`` hold (tied weights), in the order the
    stages first hold them, each with where each stage holding it holds it.

    Example:
        >>> emb = nn.Embedding(5, 3)
        >>> head = nn.Linear(3, 5, bias=False)
        >>> head.weight = emb.weight
        >>> stages = [nn.Sequential(emb, nn.ReLU()), nn.Sequential(nn.ReLU(), head)]
        >>> [(p is emb.weight, where) for p, where in tied_parameters(stages)]
        [(True, {0: [('0', 'weight')], 1: [('1', 'weight')]})]
    """
    holders: dict[int, Holders] = {}
    params: dict[int, nn.Parameter] = {}
    for s, stage in enumerate(stage_modules):
        for key, p in stage.named_parameters(remove_duplicate=False):
            layer_name, _, name = key.partition(".")
            holders.setdefault(id(p), {}).setdefault(s, []).append((layer_name, name))
            params[id(p)] = p
    return [(params[pid], where) for pid, where in holders.items() if len(where) > 1]


def untie(stage_modules: Sequence[nn.Sequential]) -> list[Tie]:
    """Find parameters held by several stages (:func:`tied_parameters`) and give every holder
    but the first a copy.

    A holding layer of a later stage is replaced, in that stage's ``nn.Sequential`` only, by a
    copy of the layer that shares every tensor with it except the tied ones: the user's model
    keeps its own layers and its tie.
    """
    tied = tied_parameters(stage_modules)
    ties = []
    for p, where in tied:
        owner = min(where)
        layer_name, name = where[owner][0]
        ties.append(Tie(f"{layer_name}.{name}", owner, p))
    shared = {id(p) for p, _ in tied}
    for s, stage in enumerate(stage_modules):
        mine = [
            (where, t)
            for (_, where), t in zip(tied, ties, strict=True)
            if s in where and s != t.owner
        ]
        if not mine:
            continue
        # one copy per tied parameter on this stage, every other tensor shared
        memo: dict[int, object] = {id(t): t for t in _module_tensors(stage) if id(t) not in shared}
        layers = {layer for where, _ in mine for layer, _ in where[s]}
        copied = {}
        for layer_name in layers:
            original = stage._modules[layer_name]
            assert original is not None
            stage._modules[layer_name] = twin_layer = copy.deepcopy(original, memo)
            copied[layer_name] = (twin_layer, original)
        for where, tie in mine:
            tie.layers += [copied[layer] for layer, _ in where[s]]
            layer_name, name = where[s][0]
            twin = stage.get_submodule(layer_name).get_parameter(name)
            tie.copies[s] = (f"{layer_name}.{name}", twin)
    return ties


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    named = [*module.named_parameters(remove_duplicate=False)]
    return [t for _, t in [*named, *module.named_buffers(remove_duplicate=False)]]


class TiedWeights:
    """Keeps the copies of tied parameters in step with their owners during a run.

    Args:
        ties: from :func:`untie`, identical in every process.
        local: the stages this process runs.
        transport: the pipeline's transport (its ``connect`` is called for the tie channels).
        microbatches: N, the microbatches of each minibatch.
    """

    def __init__(
        self, ties: list[Tie], local: Sequence[int], transport: Transport, microbatches: int = 1
    ) -> None:
        self.ties, self.local, self.transport = ties, set(local), transport
        self.microbatches = microbatches
        # A frozen tie (requires_grad False when the run is built: a LoRA model's embedding
        # and head) never changes, so its copies stay equal to it with nothing sent: no
        # gradient (a zero one would give it a gradient the optimiser steps, weight decay
        # moving it) and no weights.
        self.trained = [tie.param.requires_grad for tie in ties]
        for tie in self._moving():
            for s in sorted(tie.copies):
                transport.connect(tie.owner, s, TIE_WEIGHT)
                transport.connect(s, tie.owner, TIE_GRAD)
        #: per tie: the owner's weight version last sent / installed by this process's copies
        self.sent = [0] * len(ties)
        self.installed = {(t, s): 0 for t, tie in enumerate(ties) for s in tie.copies}
        self._version = [0] * len(ties)  # the owner's updates applied, where it runs here
        self._added: set[tuple[int, int]] = set()  # (owner stage, update) contributions added
        self._sent: set[tuple[int, int]] = set()  # (holder stage, update) contributions sent
        self._updates = {s: 0 for tie in ties for s in tie.copies}  # a holder's updates so far
        #: per (tie, holder): the delay, in updates, of the weights each of its latest N
        #: forwards ran on (the minibatch's index minus the owner's version then)
        self.seen: dict[tuple[int, int], collections.deque[int]] = {
            key: collections.deque(maxlen=microbatches) for key in self.installed
        }

    def __bool__(self) -> bool:
        return bool(self.ties)

    def _moving(self) -> list[Tie]:
        return [tie for tie, trained in zip(self.ties, self.trained, strict=True) if trained]

    def restart(self, minibatches: int) -> None:
        """Continue after ``minibatches`` updates (a drained pipeline, weights maybe loaded):
        versions count from there, and each owner sends its weights with its next forward."""
        self._version = [minibatches] * len(self.ties)
        self.sent = [-1] * len(self.ties)  # whatever the copies hold, send the owner's again
        self.installed = dict.fromkeys(self.installed, -1)  # and the holders receive them
        self._updates = dict.fromkeys(self._updates, minibatches)
        self._sent.clear()

    def follow_modes(self) -> None:
        """Copied layers take their originals' train/eval mode (dropout, BatchNorm)."""
        for tie in self.ties:
            for twin, original in tie.layers:
                if twin.training != original.training:
                    twin.train(original.training)

    def copies_on(self, stage: int) -> list[nn.Parameter]:
        """The copies ``stage`` holds: not its optimiser's, their gradients go to the owner."""
        return [tie.copies[stage][1] for tie in self.ties if stage in tie.copies]

    def copy_keys(self, stage: int) -> dict[str, str]:
        """The copies' keys in ``stage``'s module state, each mapped to its owner's key."""
        return {tie.copies[stage][0]: tie.name for tie in self.ties if stage in tie.copies}

    def delay(self, tie: Tie, stage: int) -> float:
        """The mean delay, in updates, of the weights ``stage``'s copy of ``tie`` ran its
        latest N forwards on: the owner's forward delay (0 before any forward)."""
        seen = self.seen[(self.ties.index(tie), stage)]
        return sum(seen) / len(seen) if seen else 0.0

    def stale(self, tie: Tie, stage: int) -> bool:
        """Whether ``stage``'s copy of ``tie`` misses updates the owner applied since."""
        t = self.ties.index(tie)
        return self.trained[t] and self.installed[(t, stage)] != self._version[t]

    # -- the owner's side ---------------------------------------------------------------------

    def gradients_ready(self, stage: int, update: int) -> bool:
        """Owner ``stage`` before ``update``: add every copy's contribution (once); False while
        one has not arrived."""
        owned = [tie for tie in self._moving() if tie.owner == stage]
        if not owned or (stage, update) in self._added:
            return True
        if not all(self.transport.ready(s, stage, TIE_GRAD) for t in owned for s in t.copies):
            return False
        for tie in owned:
            for s in sorted(tie.copies):
                (grad,) = self.transport.recv(s, stage, TIE_GRAD, update)
                g = grad.to(tie.param.device, tie.param.dtype)
                tie.param.grad = g.clone() if tie.param.grad is None else tie.param.grad.add_(g)
                self.transport.release(s, stage, TIE_GRAD, update)
        self._added = {(st, u) for st, u in self._added if u >= update - 1} | {(stage, update)}
        return True

    def updated(self, stage: int) -> None:
        """Owner ``stage`` applied an update: its tied weights have a new version."""
        for t, tie in enumerate(self.ties):
            if tie.owner == stage and self.trained[t]:
                self._version[t] += 1

    def forwarded(self, stage: int, microbatch: int) -> None:
        """Owner ``stage`` ran ``microbatch`` forward: tell the holders which weights it used."""
        for t, tie in enumerate(self.ties):
            if tie.owner == stage and self.trained[t]:
                self._send_version(t, tie, microbatch)

    def _send_version(self, t: int, tie: Tie, tag: int) -> None:
        changed = self._version[t] != self.sent[t]
        version = torch.tensor([self._version[t]], dtype=torch.int64, device=tie.param.device)
        weights = tie.param.detach().clone() if changed else None
        for s in sorted(tie.copies):
            self.transport.send(tie.owner, s, TIE_WEIGHT, tag, (version, weights))
        self.sent[t] = self._version[t]

    # -- a holder's side ----------------------------------------------------------------------

    def weights_ready(self, stage: int) -> bool:
        """Whether holder ``stage`` has the owners' weights for its next forward waiting."""
        return all(
            self.transport.ready(tie.owner, stage, TIE_WEIGHT)
            for tie in self._moving()
            if stage in tie.copies
        )

    def install(self, stage: int, microbatch: int) -> None:
        """Holder ``stage`` before its forward of ``microbatch``: the owner's weights of then."""
        for t, tie in enumerate(self.ties):
            if stage in tie.copies and self.trained[t]:
                self._install(t, tie, stage, microbatch)

    @torch.no_grad()
    def _install(self, t: int, tie: Tie, stage: int, tag: int) -> None:
        version, weights = self.transport.recv(tie.owner, stage, TIE_WEIGHT, tag)
        if weights is not None:
            held = tie.copies[stage][1]
            with same_versions([held]):  # in-flight forwards saved it (engine.nostash)
                held.copy_(weights)
        self.installed[(t, stage)] = v = int(version.item())
        if tag >= 0:
            self.seen[(t, stage)].append(tag // self.microbatches - v)
        self.transport.release(tie.owner, stage, TIE_WEIGHT, tag)

    def contribute(self, stage: int, update: int) -> None:
        """Holder ``stage`` at its ``update``: send its copies' gradients to their owners (once;
        :meth:`gather` may have sent them already)."""
        if (stage, update) in self._sent:
            return
        self._sent = {(s, u) for s, u in self._sent if u >= update - 1} | {(stage, update)}
        for tie in self._moving():
            if stage in tie.copies:
                twin = tie.copies[stage][1]
                grad = twin.grad if twin.grad is not None else torch.zeros_like(twin)
                self.transport.send(stage, tie.owner, TIE_GRAD, update, (grad.detach().clone(),))
                twin.grad = None
        if stage in self._updates:
            self._updates[stage] += 1

    def gather(self, update: int) -> None:
        """In one process, before any stage applies ``update``: every holder's contribution
        added to its owner now, so each owner's gradient is the whole tie's (Lightning's
        gradient hooks then see the whole model's gradient). The holders' updates send nothing
        more."""
        moving = self._moving()
        for s in sorted({s for tie in moving for s in tie.copies}):
            self.contribute(s, update)
        for owner in sorted({tie.owner for tie in moving}):
            if not self.gradients_ready(owner, update):
                raise RuntimeError(f"stage {owner} did not receive its ties' gradients")

    # -- after a drain ------------------------------------------------------------------------

    def sync(self) -> None:
        """Bring every copy to its owner's latest weights (nothing may be in flight)."""
        for t, tie in enumerate(self.ties):
            if not self.trained[t]:
                continue
            if tie.owner in self.local and self.sent[t] != self._version[t]:
                self._send_version(t, tie, -1)
            for s in sorted(tie.copies):
                # drained, the owner applied as many updates as this holder did
                if s in self.local and self.installed[(t, s)] != self._updates[s]:
                    self._install(t, tie, s, -1)
