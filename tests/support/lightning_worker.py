"""A Lightning training script, launched by the tests in a subprocess (Lightning's own launcher
re-runs it per rank, or torchrun starts it); on one device a test runs ``main(argv)`` in its own
process. Each rank writes what it saw to --out."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

import pipemare
from support.data import DigitsDataModule
from support.models import DigitsCNN, quiet_trainer


class ScheduledCNN(DigitsCNN):
    """DigitsCNN with a StepLR schedule, so LR monitoring and T1 composition are exercised."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=46, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--schedule", default="pipemare")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument(
        "--strategy", default="pipemare", help="'auto' for the single-device reference"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pl.seed_everything(0)
    model = ScheduledCNN(lr=2e-3)
    strategy = (
        "auto"
        if args.strategy == "auto"
        else pipemare.PipeMareStrategy(
            stages=args.stages,
            microbatches=args.microbatches,
            schedule=args.schedule,
            balance=[5, 4],
        )
    )
    checkpoint = ModelCheckpoint(
        dirpath=args.out / "ckpt", monitor="val_loss", save_top_k=2, save_last=True
    )
    stopper = EarlyStopping(monitor="val_acc", mode="max", patience=3, stopping_threshold=0.93)
    trainer = quiet_trainer(
        strategy,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.epochs,
        gradient_clip_val=1.0,
        callbacks=[checkpoint, stopper, LearningRateMonitor(logging_interval="step")],
        logger=CSVLogger(args.out, name="csv"),
        enable_checkpointing=True,
        log_every_n_steps=5,
    )
    trainer.fit(model, DigitsDataModule(batch_size=32))
    plan = getattr(trainer.strategy, "_runner", None)
    plan = plan.plan if plan is not None else None  # the decisions the fit printed
    decisions = {d.subject: str(d) for d in plan.decisions} if plan is not None else {}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    predictions = trainer.predict(model, DigitsDataModule(batch_size=32))
    rank = trainer.global_rank
    torch.save(
        {k: v.cpu() for k, v in model.state_dict().items()}, args.out / f"weights-rank{rank}.pt"
    )
    report = {
        "rank": rank,
        "world_size": trainer.world_size,
        "environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
        "metrics": metrics,
        "logged": logged,
        "best_model_path": checkpoint.best_model_path,
        "best_model_score": float(checkpoint.best_model_score),
        "stopped_epoch": stopper.stopped_epoch,
        "global_step": trainer.global_step,
        "balance": list(getattr(trainer.strategy, "balance", [])),
        "predictions": torch.cat(predictions).tolist() if predictions else None,
        "lr": model.optimizers().param_groups[0]["lr"] if trainer.optimizers else None,
        "decisions": decisions,
    }
    (args.out / f"report-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main()
