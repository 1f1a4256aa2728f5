"""Choosing the layout: stages P × replicas D, microbatches N and the partition, from a profile.

The planner works in three steps, after PipeDream's optimizer and BaPipe's exploration:

1. :func:`profile` measures every layer of an ``nn.Sequential`` on this device: the seconds
   it adds to a stage's forward, backward and update actions as the engine runs them (the
   engine's own per-action work, the corrections and the optimiser wrapper included), the
   bytes it sends to the next stage, the bytes autograd saves for its backward pass, and its
   parameter, gradient and optimiser-state bytes.
2. :func:`evaluate` models one layout: a stage's time is the sum of its layers' (with the
   fixed per-action cost counted once), the schedule's action streams are replayed through
   their dependencies with :func:`pipemare.engine.telemetry.replay_timeline` (the same replay that
   turns a measured run into pipeline time), and memory per stage counts parameters,
   gradients, optimiser state, saved activations times the microbatches the schedule keeps
   in flight on that stage, and stashed weight versions.
3. :func:`plan` enumerates P dividing the device count (D = devices / P) and N dividing the
   per-replica batch, cuts the layers by dynamic programming over contiguous ranges that
   minimises the slowest stage within the memory limit, models each candidate and returns
   the fastest with its runner-ups.

``pipemare plan --config CONFIG.yaml`` (:mod:`pipemare.experiments.plan_command`) runs all three on
a LightningCLI config.
"""

from pipemare.planner.cost import Layout, evaluate, replayed_step_time, steady_step_time
from pipemare.planner.measurements import LayerProfile, Overhead, Profile
from pipemare.planner.profile import engine_overhead, profile
from pipemare.planner.report import Plan, parse_bytes
from pipemare.planner.search import auto_balance, plan

__all__ = [
    "LayerProfile",
    "Layout",
    "Overhead",
    "Plan",
    "Profile",
    "auto_balance",
    "engine_overhead",
    "evaluate",
    "parse_bytes",
    "plan",
    "profile",
    "replayed_step_time",
    "steady_step_time",
]
