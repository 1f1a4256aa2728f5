"""A model built on the meta device: each process builds, holds and runs only its own stage.

The model is the benchmark's GPT (:mod:`pipemare.experiments.bench.lean`): rotary attention
(a non-persistent ``inv_freq`` buffer computed in ``__init__``), its head tied to the token
embedding, written as an ``nn.Sequential`` and built in ``configure_model``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from pipemare import PipeMareStrategy
from pipemare.experiments.bench.lean import LeanGPT, byte_loaders, gpt_layers
from pipemare.model.materialize import (
    load_stage_weights,
    materialize,
    meta_parameters,
    to_meta,
)
from support.launch import ranks, run_all

WORKER = str(Path(__file__).resolve().parents[1] / "support" / "lean_worker.py")


def _trainer(strategy, steps: int = 4) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


# -- the parts, in one process ---------------------------------------------------------------


def test_meta_parameters_keep_buffers_real_and_ties():
    with meta_parameters():
        seq = gpt_layers(32, 2, vocab=16, heads=4)
    assert all(p.is_meta for p in seq.parameters())
    inv_freq = seq[1].rotary.inv_freq
    assert not inv_freq.is_meta
    assert torch.equal(inv_freq, gpt_layers(32, 2, vocab=16, heads=4)[1].rotary.inv_freq)
    assert seq[-1].lm_head.weight is seq[0].weight


def test_materialize_makes_only_the_given_layers_real_and_keeps_ties():
    with meta_parameters():
        seq = gpt_layers(32, 2, vocab=16, heads=4)
    made = materialize(seq, [seq[-1]], torch.device("cpu"))
    assert not seq[-1].lm_head.weight.is_meta and not seq[-1].ln_f.weight.is_meta
    assert seq[0].weight is seq[-1].lm_head.weight  # the tie holds in the whole model
    assert all(p.is_meta for p in seq[1].parameters())
    assert torch.equal(seq[-1].ln_f.weight, torch.ones(32))  # LayerNorm's reset_parameters
    assert len(made) == 3  # ln_f weight and bias, the tied head
    to_meta(seq[-1], seq)
    assert seq[-1].lm_head.weight.is_meta and seq[0].weight is seq[-1].lm_head.weight


class _Learned(nn.Module):
    """A learned position embedding as a bare parameter, no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.wpe = nn.Parameter(torch.zeros(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.wpe


def test_a_bare_parameter_without_an_init_is_refused_by_name():
    with meta_parameters():
        seq = nn.Sequential(nn.Linear(4, 4), _Learned())
    with pytest.raises(TypeError, match=r"_Learned \(wpe\).*init_weights\(\).*weights="):
        materialize(seq, list(seq), torch.device("cpu"))


def test_stage_weights_are_read_tensor_by_tensor(tmp_path):
    from safetensors.torch import save_file

    whole = {"net.a": torch.arange(4.0), "net.b": torch.ones(2, 2)}
    torch.save(whole, tmp_path / "w.pt")
    save_file({"a": whole["net.a"], "b": whole["net.b"]}, tmp_path / "w.safetensors")
    for name, strip in (("w.pt", ()), ("w.safetensors", ("net.",))):
        mine = {"net.a": torch.zeros(4), "net.c": torch.zeros(1)}
        missing = load_stage_weights(tmp_path / name, mine, strip=strip)
        assert missing == ["net.c"] and torch.equal(mine["net.a"], whole["net.a"])
    head = torch.zeros(4)  # a tied head the file leaves out is found under its tie's name
    aliases = {"net.head": ["net.a", "net.head"]}
    assert load_stage_weights(tmp_path / "w.pt", [("net.head", head)], aliases=aliases) == []
    assert torch.equal(head, whole["net.a"])
    with pytest.raises(ValueError, match=r"net.b has shape \(2, 2\).*another model"):
        load_stage_weights(tmp_path / "w.pt", {"net.b": torch.zeros(3)})


# -- through the strategy, stages simulated in one process -----------------------------------


def test_gpipe_on_a_meta_built_gpt_equals_one_device_from_its_weights(tmp_path):
    """P = 4, gpipe, the GPT built in configure_model and its weights read stage by stage from
    one device's file: the same losses as plain Lightning on one device (rel 1e-4)."""
    train, _ = byte_loaders(context=16, batch=4, rows=16)
    pl.seed_everything(0)
    one = LeanGPT(64, 4, heads=4, build_in_init=True)
    torch.save(one.state_dict(), tmp_path / "one.pt")
    reference = _Losses()
    trainer = _trainer("auto")
    trainer.callbacks.append(reference)
    trainer.fit(one, train)

    pl.seed_everything(1)  # another initialisation: the file decides the weights
    lean = LeanGPT(64, 4, heads=4)
    strategy = PipeMareStrategy(
        stages=4, schedule="gpipe", microbatches=2, weights=str(tmp_path / "one.pt")
    )
    piped = _Losses()
    trainer = _trainer(strategy)
    trainer.callbacks.append(piped)
    trainer.fit(lean, train)
    assert piped.losses == pytest.approx(reference.losses, rel=1e-4)
    decisions = {d.subject: d for d in strategy.settings.decisions}
    assert "read from the weights file" in decisions["build"].reason
    assert decisions["advice"].choice == "not measured"
    assert "parameter counts" in decisions["layers per stage"].reason


def test_a_meta_built_gpt_initialises_its_stages_and_its_tied_copies_agree():
    """Built on meta, initialised by reset_parameters(), pipemare at P = 4: the head's copy of
    the tied embedding equals its owner's once the first step ran, and the run trains."""
    train, val = byte_loaders(context=16, batch=4, rows=32)
    pl.seed_everything(0)
    lean = LeanGPT(64, 4, heads=4)
    strategy = PipeMareStrategy(stages=4)
    losses = _Losses()
    trainer = _trainer(strategy, steps=8)
    trainer.callbacks.append(losses)
    trainer.fit(lean, train, val)
    pipe = strategy.pipeline
    assert pipe is not None  # a lean run keeps its stages after fit (nothing gathered)
    (tie,) = pipe.ties.ties
    (copy,) = (param for _, param in tie.copies.values())
    assert torch.equal(copy, tie.param)
    assert "reset_parameters" in {d.subject: d for d in strategy.settings.decisions}["build"].reason
    assert losses.losses[-1] < losses.losses[0]
    trainer.test(lean, val, verbose=False)  # a rebuild for evaluation keeps the tie
    assert torch.isfinite(torch.tensor(float(trainer.callback_metrics["test_loss"])))


class _Looped(nn.Module):
    """The GPT's layers as a model that is not an nn.Sequential: blocks in a ModuleList, looped
    over in forward (as Hugging Face models are written): cut by tracing it."""

    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = layers[0], nn.ModuleList(layers[1:-1]), layers[-1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _LoopedGPT(LeanGPT):
    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = _Looped(gpt_layers(*self.shape))  # type: ignore[assignment]


def test_a_traced_model_built_on_meta_equals_one_device_and_restores_from_its_checkpoint(
    tmp_path,
):
    """A model that is not an nn.Sequential, built in configure_model: traced on the meta
    device, cut by parameter counts, each stage read from one device's file; gpipe at P = 4
    gives one device's losses (rel 1e-4). Its checkpoint's weights, loaded before any stage is
    real (validate with ckpt_path), reach the stages once they are: the same held-out loss."""
    train, val = byte_loaders(context=16, batch=4, rows=16)
    pl.seed_everything(0)
    one = LeanGPT(64, 4, heads=4, build_in_init=True)
    torch.save(
        {f"gpt.{k}": v for k, v in _Looped(one.gpt).state_dict().items()}, tmp_path / "one.pt"
    )
    reference = _Losses()
    trainer = _trainer("auto")
    trainer.callbacks.append(reference)
    trainer.fit(one, train)

    looped = _LoopedGPT(64, 4, heads=4)
    strategy = PipeMareStrategy(
        stages=4, schedule="gpipe", microbatches=2, weights=str(tmp_path / "one.pt")
    )
    piped = _Losses()
    trainer = _trainer(strategy)
    trainer.callbacks.append(piped)
    trainer.fit(looped, train)
    assert piped.losses == pytest.approx(reference.losses, rel=1e-4)
    decisions = {d.subject: d for d in strategy.settings.decisions}
    assert "parameter counts" in decisions["layers per stage"].reason
    assert "segments" in decisions
    trainer.save_checkpoint(tmp_path / "looped.ckpt")
    (want,) = trainer.validate(looped, val, verbose=False)

    again = _LoopedGPT(64, 4, heads=4)
    trainer = _trainer(PipeMareStrategy(stages=4, schedule="gpipe", microbatches=2))
    (got,) = trainer.validate(again, val, ckpt_path=tmp_path / "looped.ckpt", verbose=False)
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)


# -- two processes -------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_process_holds_only_its_own_stage(tmp_path):
    """Stage 1 holds every block and the head (about 200 MB at width 1024), stage 0 the
    embedding alone (1 MB): through the sanity check, fit, validate and test, rank 0's peak
    resident growth stays below half of stage 1's bytes, and each holds its stage only; the plan
    comes from the first training batch, and ``state_dict()`` of a stage alone warns."""
    width, blocks = 1024, 4
    whole = LeanGPT(width, blocks, build_in_init=True)
    torch.save(whole.state_dict(), tmp_path / "one.pt")
    stage1_mb = sum(p.numel() * 4 for p in whole.gpt[1:].parameters()) / 2**20
    del whole
    assert stage1_mb > 100
    cmd = [
        sys.executable, WORKER, "--out", str(tmp_path), "--weights", str(tmp_path / "one.pt"),
        "--width", str(width), "--blocks", str(blocks),
    ]  # fmt: skip
    run_all(ranks(cmd, 2), timeout=600)  # each rank started here, as torchrun starts them
    rank0, rank1 = (json.loads((tmp_path / f"lean-rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["growth_mb"] < stage1_mb / 2, (rank0, stage1_mb)
    assert rank0["held_mb"] < 2 and rank1["held_mb"] > stage1_mb * 0.99
    assert any("holds only its own stage" in d for d in rank0["decisions"])
    assert rank0["test_loss"] == rank1["test_loss"]
    assert "planned from: the first training batch" in "\n".join(rank0["decisions"])
    assert "checkpoints: per-stage shards" in "\n".join(rank0["decisions"])
    # state_dict() of a stage alone warns, naming the fix; rank 1 holds every tensor (the
    # embedding's tied copy included), so its state dict is whole
    (said,) = rank0["state_dict_warnings"]
    assert "on the meta device" in said and "trainer.strategy.gather()" in said
    assert rank1["state_dict_warnings"] == []


# -- memory per stage, predicted before the first step --------------------------------------


def test_optimizer_state_is_measured_per_trained_byte():
    from pipemare.planner.stage_memory import state_bytes_per_byte

    assert state_bytes_per_byte(lambda ps: torch.optim.AdamW(ps, lr=1e-3)) == 2.0
    assert state_bytes_per_byte(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) == 1.0
    assert state_bytes_per_byte(lambda ps: torch.optim.SGD(ps, lr=0.1)) == 0.0


def _predicted_and_held(schedule: str, stages: int):
    train, _ = byte_loaders(context=16, batch=8, rows=64)
    pl.seed_everything(0)
    strategy = PipeMareStrategy(
        stages=stages, schedule=schedule, microbatches=4, measure_activations=True
    )
    _trainer(strategy, steps=6).fit(LeanGPT(64, 4, heads=4), train)
    assert strategy.pipeline is not None and strategy.memory is not None
    return strategy.memory, strategy.pipeline


@pytest.mark.parametrize("stages", [2, 4])
def test_each_stage_s_memory_is_predicted_within_a_fifth_of_what_it_holds(stages):
    """The prediction's optimiser state, correction buffers and activations in flight against
    what the run holds at its peak: the optimiser's state, the corrections' buffers and each
    stage's own count of the bytes its in-flight microbatches keep (pipemare); gpipe keeps N
    microbatches of the same size in flight on every stage."""
    memory, pipe = _predicted_and_held("pipemare", stages)
    state = pipe.optimizer.optimizer.state
    for predicted, stage in zip(memory, pipe.stages, strict=True):
        i = stage.index
        trained = [p for p in pipe.stage_modules[i].parameters() if p.requires_grad]
        held_state = sum(
            t.numel() * t.element_size()
            for p in trained
            if p in state
            for t in state[p].values()
            if t.numel() > 1
        )
        buffers = sum(pipe.optimizer.buffer_bytes(i).values())
        assert predicted.optimizer_state == pytest.approx(held_state, rel=0.01), i
        assert predicted.corrections == pytest.approx(buffers, rel=0.01, abs=1024), i
        assert predicted.in_flight == stages - i
        assert predicted.activations == pytest.approx(stage.peak_saved_bytes, rel=0.2), (
            stages,
            predicted,
            stage.peak_saved_bytes,
        )
    flushing, _ = _predicted_and_held("gpipe", stages)
    for sync, asynchronous in zip(flushing, memory, strict=True):
        assert sync.in_flight == 4 and sync.corrections == 0
        per_microbatch = asynchronous.activations / asynchronous.in_flight
        assert sync.activations == pytest.approx(4 * per_microbatch)


def test_a_stage_that_cannot_fit_is_refused_before_the_first_step():
    train, _ = byte_loaders(context=16, batch=4, rows=16)
    model = LeanGPT(64, 4, heads=4)
    strategy = PipeMareStrategy(stages=2, memory_limit="200kB")
    with pytest.raises(MemoryError, match=r"stage 0: .* MB = weights .*more than the .*recompute"):
        _trainer(strategy).fit(model, train)
    assert model.trainer.global_step == 0
