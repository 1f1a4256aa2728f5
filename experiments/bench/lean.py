"""``python -m pipemare.experiments.bench.lean``: what each process holds, a model bigger than one.

A plain GPT (rotary attention, its head tied to the token embedding) written as an
``nn.Sequential`` and built the Lightning way, in ``LightningModule.configure_model``, trained
with AdamW for a few steps on bytes of Python's standard library:

- ``plain``: plain Lightning, one process, the whole model;
- ``pipemare``: ``Trainer(strategy="pipemare", devices=P)``, nothing else set (Lightning's own
  launcher starts the other processes, as for a user's script);
- ``gpipe``: ``PipeMareStrategy(schedule="gpipe")``, ``devices=P``.

Each process reports its peak resident memory above its start (``ru_maxrss`` after the imports
and the data, before the Trainer) through fit, and what it holds at the end, by component:
weights, gradients, optimiser state, correction buffers (everything else the optimiser wrapper
keeps per parameter). ``--compare`` runs every configuration in turn, one after the other, and
writes the table. ``--checkpoint-every K`` adds a ``ModelCheckpoint`` every K steps keeping the
best two by training loss (older ones removed), to plain Lightning and to ``pipemare`` at
``devices=P`` (per-stage shards, its default for a model built on the meta device): the growth
then counts fit and its checkpoints. Run it alone: the processes of one run share two cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["LeanGPT", "gpt_layers", "main"]


class Rotary(nn.Module):
    """Rotary position embedding: ``inv_freq`` is a non-persistent buffer computed here, with
    no ``reset_parameters()`` to compute it again."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, heads, time, head_dim)
        t = torch.arange(x.shape[2], device=x.device, dtype=self.inv_freq.dtype)
        angles = torch.outer(t, self.inv_freq)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    """Pre-norm: causal self-attention with rotary queries and keys, then a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.rotary = Rotary(width // heads)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln_1(x)).split(d, dim=2)
        )
        y = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class Head(nn.Module):
    """The final LayerNorm and the output layer."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt_layers(width: int, blocks: int, vocab: int = 256, heads: int = 8) -> nn.Sequential:
    """Token embedding, ``blocks`` blocks, head; the head's weight is the embedding's."""
    embedding = nn.Embedding(vocab, width)
    head = Head(width, vocab)
    head.lm_head.weight = embedding.weight
    return nn.Sequential(embedding, *(Block(width, heads) for _ in range(blocks)), head)


class LeanGPT(pl.LightningModule):
    """The GPT as users build a big one in Lightning: in ``configure_model``.

    Args:
        width, blocks, vocab, heads: the model's shape.
        lr: AdamW's rate.
        build_in_init: build the model in ``__init__`` instead (the whole model, every process).
    """

    def __init__(
        self,
        width: int = 1024,
        blocks: int = 8,
        vocab: int = 256,
        heads: int = 8,
        lr: float = 3e-4,
        build_in_init: bool = False,
    ) -> None:
        super().__init__()
        self.shape = (width, blocks, vocab, heads)
        self.lr = lr
        self.gpt: nn.Sequential | None = gpt_layers(*self.shape) if build_in_init else None

    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = gpt_layers(*self.shape)

    def _loss(self, batch: Any) -> torch.Tensor:
        ids, targets = batch
        assert self.gpt is not None
        logits = self.gpt(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def byte_loaders(context: int, batch: int, rows: int) -> tuple[DataLoader, DataLoader]:
    """Training and validation windows of the standard library's bytes."""
    from pipemare.experiments.tasks.data import next_byte_windows, stdlib_corpus

    ids, targets = next_byte_windows(stdlib_corpus(), context, limit=2 * rows)
    train = TensorDataset(ids[:rows], targets[:rows])
    val = TensorDataset(ids[rows:], targets[rows:])
    return DataLoader(train, batch_size=batch), DataLoader(val, batch_size=batch)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def _mb(tensors: Any) -> float:
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta) / 2**20


def held(trainer: pl.Trainer, module: LeanGPT) -> dict[str, float]:
    """MB this process holds after fit, by component (a gradient per trained weight counts:
    it lives through every step, zeroed between them)."""
    params = [p for p in module.parameters() if not p.is_meta]
    out = {"weights_mb": _mb(params), "gradients_mb": _mb(p for p in params if p.requires_grad)}
    optimizer_mb = 0.0
    for opt in trainer.optimizers:
        optimizer_mb += _mb(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    out["optimizer_state_mb"] = optimizer_mb
    pipe = getattr(trainer.strategy, "pipeline", None)
    if pipe is not None:  # what the optimiser wrapper keeps beside the user's optimiser
        kept = {id(t): t for v in vars(pipe.optimizer).values() for t in _tensors_in(v)}
        out["correction_buffers_mb"] = _mb(kept.values())
    return out


def _tensors_in(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors an object keeps (its attributes, dicts and lists, a few levels deep), for the
    correction buffers' bytes; the user's optimiser and the parameters themselves left out."""
    if torch.is_tensor(obj):
        return [] if isinstance(obj, nn.Parameter) else [obj]
    if depth > 4 or isinstance(obj, (nn.Module, torch.optim.Optimizer, str, bytes)):
        return []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v, depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in(v, depth + 1)]
    if hasattr(obj, "__dict__"):
        return [t for v in vars(obj).values() for t in _tensors_in(v, depth + 1)]
    return []


def _run(args: argparse.Namespace) -> None:
    """One configuration, in this process (and, for ``pipemare`` and ``gpipe``, the processes
    Lightning's launcher starts running this same command)."""
    torch.set_num_threads(1)
    train, val = byte_loaders(args.context, args.batch, args.batch * args.steps)
    start = _peak_mb()  # after the imports and the data, before the Trainer
    module = LeanGPT(args.width, args.blocks, build_in_init=args.build_in_init)
    every = getattr(args, "checkpoint_every", 0)
    saves = Path(args.out) / f"checkpoints-{args.mode}-{args.devices}"
    callbacks: list[pl.Callback] = []
    if every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=saves, every_n_train_steps=every, monitor="train_loss", save_top_k=2
            )
        )
    if args.mode == "plain":
        strategy: Any = "auto"
        devices = 1
    else:
        from pipemare import PipeMareStrategy

        strategy = "pipemare" if args.mode == "pipemare" else PipeMareStrategy(schedule="gpipe")
        devices = args.devices
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=2,
        num_sanity_val_steps=0 if args.no_sanity else 2,
        logger=False,
        enable_checkpointing=bool(every),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train, val)
    fit_peak = _peak_mb() - start
    kept = sorted(p.name for p in saves.iterdir()) if every else []
    settings = getattr(trainer.strategy, "settings", None)
    memory = getattr(trainer.strategy, "memory", None)
    predicted = next((m for m in memory or [] if m.stage == trainer.global_rank), None)
    report = {
        "mode": args.mode,
        "devices": devices,
        "checkpoint_every": every,
        "checkpoints_kept": kept,
        "sharded": bool(kept) and (saves / kept[0]).is_dir(),
        "rank": trainer.global_rank,
        "start_mb": start,
        "fit_growth_mb": fit_peak,
        **held(trainer, module),  # after fit, before the evaluation runs rebuild the pipeline
        "predicted_mb": None if predicted is None else predicted.total / 2**20,
        "predicted": None if predicted is None else predicted.describe(),
        "decisions": [str(d) for d in settings.decisions] if settings is not None else [],
    }
    trainer.validate(module, val, verbose=False)
    trainer.test(module, val, verbose=False)
    report["exit_growth_mb"] = _peak_mb() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{args.mode}-{devices}{'-ckpt' if every else ''}-rank{trainer.global_rank}.json"
    (out / name).write_text(json.dumps(report, indent=1))
    if every and trainer.global_rank == 0:
        import shutil

        shutil.rmtree(saves, ignore_errors=True)  # gigabytes; what was kept is in the report


CONFIGS = (("plain", 1), ("pipemare", 2), ("pipemare", 4), ("gpipe", 4))
#: with ``--checkpoint-every``: plain Lightning and pipemare at the issue's P, each checkpointing
CHECKPOINT_CONFIGS = (("plain", 1), ("pipemare", 4))


def compare(args: argparse.Namespace) -> list[dict]:
    """Every configuration, one after the other; the table under ``args.out``."""
    reports = []
    every = args.checkpoint_every
    for mode, devices in CHECKPOINT_CONFIGS if every else CONFIGS:
        cmd = [
            sys.executable, "-m", "pipemare.experiments.bench.lean", "--mode", mode,
            "--devices", str(devices), "--out", args.out, "--steps", str(args.steps),
            "--width", str(args.width), "--blocks", str(args.blocks),
            "--checkpoint-every", str(every),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        begin = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, timeout=3600)
        print(f"{mode} x{devices}: {time.perf_counter() - begin:.0f} s", file=sys.stderr)
        tag = "-ckpt" if every else ""
        for rank in range(devices):
            reports.append(
                json.loads((Path(args.out) / f"{mode}-{devices}{tag}-rank{rank}.json").read_text())
            )
    name = "results-checkpoints.md" if every else "results.md"
    Path(args.out, name).write_text(_table(reports, args))
    return reports


def _table(reports: list[dict], args: argparse.Namespace) -> str:
    """The results as markdown: growth per process against plain Lightning's."""
    plain = next(r for r in reports if r["mode"] == "plain")["fit_growth_mb"]
    saving = (
        f"; a ModelCheckpoint every {args.checkpoint_every} steps, the best 2 by training "
        "loss kept (older ones removed), in every run"
        if args.checkpoint_every
        else ""
    )
    lines = [
        f"GPT of width {args.width}, {args.blocks} blocks, built in configure_model, AdamW, "
        f"{args.steps} steps, batch {args.batch}, context {args.context}; peak resident growth "
        f"above each process's start (after imports and data, before the Trainer){saving}.",
        "",
        "| run | rank | growth through fit (MB) | × plain | growth to exit (MB) | weights | "
        "gradients | optimiser state | correction buffers | predicted before the first step "
        "(MB) | growth / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        name, fit = f"{r['mode']}, devices={r['devices']}", r["fit_growth_mb"]
        lines.append(
            f"| {name} | {r['rank']} | {fit:.0f} | {fit / plain:.2f} | "
            f"{r['exit_growth_mb']:.0f} | {r['weights_mb']:.0f} | {r['gradients_mb']:.0f} | "
            f"{r['optimizer_state_mb']:.0f} | {r.get('correction_buffers_mb', math.nan):.0f} | "
            f"{r.get('predicted_mb') or math.nan:.0f} | "
            f"{fit / (r.get('predicted_mb') or math.nan):.2f} |"
        )
    lines.append("")
    for mode, devices in (CHECKPOINT_CONFIGS if args.checkpoint_every else CONFIGS)[1:]:
        mine = [r for r in reports if r["mode"] == mode and r["devices"] == devices]
        top = max(r["fit_growth_mb"] for r in mine)
        total = sum(r["fit_growth_mb"] for r in mine)
        lines.append(
            f"- {mode}, devices={devices}: largest process {top:.0f} MB = {top / plain:.2f}× plain "
            f"Lightning's {plain:.0f} MB; all {devices} processes together {total:.0f} MB"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("plain", "pipemare", "gpipe"))
    parser.add_argument(
        "--compare", action="store_true", help="every configuration, then the table"
    )
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="training steps (3P or more)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--build-in-init", action="store_true")
    parser.add_argument("--no-sanity", action="store_true")
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="a ModelCheckpoint every K steps (top 2)"
    )
    parser.add_argument("--out", default="experiments/results/lean")
    args = parser.parse_args(argv)
    if args.compare:
        compare(args)
    elif args.mode is None:
        parser.error("pass --mode or --compare")
    else:
        _run(args)


if __name__ == "__main__":
    main()
