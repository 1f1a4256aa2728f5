"""Choosing a layout (stages, replicas, microbatches, cuts) from a profile of the model."""

from pipemare.planner.planner import (
    LayerProfile,
    Layout,
    Overhead,
    Plan,
    Profile,
    auto_balance,
    evaluate,
    main,
    parse_bytes,
    plan,
    profile,
    steady_step_time,
)

__all__ = [
    "LayerProfile",
    "Layout",
    "Overhead",
    "Plan",
    "Profile",
    "auto_balance",
    "evaluate",
    "main",
    "parse_bytes",
    "plan",
    "profile",
    "steady_step_time",
]
