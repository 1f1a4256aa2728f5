"""``pipemare plan --config CONFIG.yaml``: profile and plan the model of a LightningCLI config and
print the plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from pipemare.engine.microbatch import batch_size as rows_of
from pipemare.planner import Plan, parse_bytes, plan, profile
from pipemare.planner.measurements import OptimizerFactory
from pipemare.planner.search import DEFAULT_MICROBATCHES
from pipemare.schedule.actions import spec


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(float(text)) if kind is int and "e" in text.lower() else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers >= 1 separated by commas, e.g. 1,2,4,8, got {text!r}"
        )
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipemare plan",
        description="Profile the config's model on this device and choose stages x replicas, "
        "microbatches and the partition with the smallest modelled step time.",
    )
    parser.add_argument("--config", required=True, help="a LightningCLI config (configs/*.yaml)")
    parser.add_argument(
        "--devices", type=_positive(int), help="devices to plan for (default: the config's stages)"
    )
    parser.add_argument(
        "--memory-limit", type=parse_bytes, help="per device, e.g. 8GiB (default: none)"
    )
    parser.add_argument(
        "--bandwidth",
        type=_positive(float),
        default=3e9,
        help="link bandwidth in bytes/s (default 3e9, gloo over loopback)",
    )
    parser.add_argument("--schedule", help="default: the config's")
    parser.add_argument(
        "--microbatches",
        type=_counts,
        default=list(DEFAULT_MICROBATCHES),
        help="microbatch counts to try, e.g. 1,2,4,8",
    )
    parser.add_argument(
        "--batch-size", type=_positive(int), help="default: the config's training batch"
    )
    parser.add_argument(
        "--repeats", type=_positive(int), default=5, help="timed steps per size and round"
    )
    parser.add_argument(
        "--rounds", type=_positive(int), default=3, help="profile rounds, taken in turn"
    )
    parser.add_argument("--top", type=int, default=5, help="runner-ups to show")
    return parser


def _fail(message: str) -> SystemExit:
    print(f"pipemare plan: error: {message}", file=sys.stderr)
    return SystemExit(2)


def main(argv: list[str] | None = None) -> Plan:
    """``pipemare plan --config CONFIG.yaml [--devices K] [--memory-limit 8GiB] ...``.

    Builds the config's model and datamodule, takes one training batch, finds the pipelined
    ``nn.Sequential`` and its input as the strategy does, profiles it at every microbatch size
    the candidate layouts need and prints :meth:`Plan.describe`. Exits with status 2 and a
    message on bad arguments.
    """
    args = _parser().parse_args(argv)
    if args.schedule is not None:
        try:
            spec(args.schedule)
        except ValueError as err:
            raise _fail(str(err)) from None
    if not os.path.isfile(args.config):
        raise _fail(f"no config file at {args.config!r}; pass e.g. --config configs/mnist.yaml")
    setup = _from_config(args.config)
    schedule = args.schedule or setup["schedule"]
    devices = args.devices or setup["devices"]
    x, batch = setup["input"], setup["batch"]
    batch_size_ = args.batch_size or rows_of(x)
    sizes = _sizes_needed(devices, batch_size_, args.microbatches, len(setup["seq"]))
    rows = rows_of(x)
    if not sizes or max(sizes) > rows:
        raise _fail(
            f"no microbatch size to profile: batch {batch_size_} over {devices} devices and "
            f"microbatches {args.microbatches} (the config's batch holds {rows} samples)"
        )
    start = time.perf_counter()
    try:
        prof = profile(
            setup["seq"],
            x,
            target=batch,
            loss_fn=setup["loss"],
            optimizer=setup["optimizer"],
            schedule=schedule,
            config=setup["config"] if schedule == setup["schedule"] else None,
            microbatch_sizes=sizes,
            repeats=args.repeats,
            rounds=args.rounds,
        )
        result = plan(
            prof,
            devices=devices,
            batch_size=batch_size_,
            memory_limit_bytes=args.memory_limit,
            bandwidth_bytes_per_s=args.bandwidth,
            microbatches=args.microbatches,
            top=args.top,
        )
    except ValueError as err:
        raise _fail(str(err)) from None
    print(
        f"profiled {len(setup['seq'])} layers at microbatch sizes {sizes} in "
        f"{time.perf_counter() - start:.1f} s"
    )
    print(result.describe())
    return result


def _sizes_needed(devices: int, batch: int, microbatches: Sequence[int], layers: int) -> list[int]:
    sizes: set[int] = set()
    for p in range(1, min(devices, layers) + 1):
        d = devices // p
        if devices % p or batch % d:
            continue
        sizes.update(batch // d // n for n in microbatches if (batch // d) % n == 0)
    return sorted(sizes)


def _from_config(path: str) -> dict[str, Any]:
    """The config's pipelined model as a Sequential (a module that is not one cut into
    segments, as the strategy cuts it), its input for one training batch, loss, optimiser,
    strategy."""
    from pipemare.cli.lightning_cli import PipeMareCLI
    from pipemare.lightning.steps import ModuleAdapter, loss_of
    from pipemare.model.cuts import find_pipelined

    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when both are given
    try:
        cli = PipeMareCLI(args=["--config", path], run=False)
    finally:
        sys.argv = argv
    model, data = cli.model, cli.datamodule
    strategy = cli.trainer.strategy
    stages = getattr(strategy, "stages", None)
    settings = {
        "schedule": getattr(strategy, "schedule", "pipemare"),
        "config": getattr(strategy, "config", None),
        "devices": stages or max(cli.trainer.num_devices, 1),
    }
    if data is None:
        raise _fail("the config names no data (data: class_path: ...); the planner needs a batch")
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    try:
        name, _ = find_pipelined(model, getattr(strategy, "module_name", None))
        adapter = ModuleAdapter(model, name, getattr(strategy, "split_points", None))
        seq = adapter.prepare("training_step", batch, 0)
    except ValueError as err:
        raise _fail(str(err)) from None
    x = adapter.capture_input("training_step", batch, 0)

    def loss(output: Any, microbatch: Any) -> torch.Tensor:
        with warnings.catch_warnings():  # self.log() outside a Trainer only warns
            warnings.simplefilter("ignore")
            return loss_of(adapter.run_with_output("training_step", output, microbatch, 0))

    return {
        **settings,
        "seq": seq,
        "input": x,
        "batch": batch,
        "loss": loss,
        "optimizer": _optimizer_factory(model),
    }


def _optimizer_factory(model: Any) -> OptimizerFactory:
    """The model's own optimiser class and settings, to build over any parameters."""
    configured = model.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)) and configured:
        configured = configured[0]
    if not isinstance(configured, torch.optim.Optimizer):
        return torch.optim.Adam
    kind, defaults = type(configured), dict(configured.defaults)

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return kind(params, **defaults)

    return build
