"""Models as people write them, through Trainer(strategy="pipemare") with no argument naming a
module or a cut: a nanoGPT with its head tied to its embedding, Hugging Face GPT-2 and Llama
(tiny, random, nothing downloaded, loss from labels=), a resnet18 as torchvision writes it.
gpipe reproduces one device (weights, validation loss); a checkpoint loads into the plain
module; the asynchronous default trains them."""

from __future__ import annotations

import copy
import math

import pytest
import pytorch_lightning as pl
import torch

from pipemare import PipeMareConfig, PipeMareStrategy
from pipemare.callbacks import StalenessMonitor
from support.models import quiet_trainer
from support.real_modules import (
    SETUPS,
    GPTModule,
    HFModule,
    ManualGPTModule,
    ResNetModule,
    images,
    tokens,
)
from support.real_runs import (
    comparable,
    launch_two_processes,
    two_processes_equal_one_device,
    val_loss,
)

# one worker runs the module: its tests share module-scoped fixtures
pytestmark = pytest.mark.xdist_group("strategy_real_models")

STEPS = 20


def _same(a: pl.LightningModule, b: pl.LightningModule, tol: float = 1e-5) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        x, y = comparable(name, x), comparable(name, y)
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("stages", [2, 4])
def test_a_tied_gpt_trains_through_gpipe_as_on_one_device(stages, tmp_path):
    base = GPTModule()
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    quiet_trainer("auto", max_steps=STEPS).fit(plain, tokens())
    strategy = PipeMareStrategy(stages=stages, microbatches=4, schedule="gpipe")
    t = quiet_trainer(strategy, max_steps=STEPS)
    t.fit(piped, tokens())
    _same(piped, plain)
    assert piped.gpt.lm_head.weight is piped.gpt.transformer.wte.weight  # still one tensor
    (tie,) = strategy.pipeline.ties.ties
    assert [torch.equal(twin, tie.param) for _, twin in tie.copies.values()] == [True]
    t.save_checkpoint(tmp_path / "gpt.ckpt")
    loaded = GPTModule.load_from_checkpoint(tmp_path / "gpt.ckpt")  # the plain module
    assert val_loss(loaded, tokens()) == pytest.approx(val_loss(plain, tokens()), rel=1e-5)


def test_blocks_that_p_does_not_divide_are_cut_in_halves_that_train_as_one_device():
    """Three blocks on two stages: whole blocks would give one stage a block more than the
    other, so the default cut halves each block before its second LayerNorm, as
    ``split_points`` would, and says so; gpipe over the halves is still one device. A list of
    layer counts counts whole blocks, so with one the blocks stay whole."""
    base = GPTModule(n_layer=3)
    plain, piped, listed = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    quiet_trainer("auto", max_steps=STEPS).fit(plain, tokens())
    strategy = PipeMareStrategy(stages=2, microbatches=4, schedule="gpipe")
    quiet_trainer(strategy, max_steps=STEPS).fit(piped, tokens())
    _same(piped, plain)
    segments = strategy._runner.adapter.sequential
    assert len(segments) == 1 + 2 * 3 + 1  # the stem, two halves a block, the head
    inside = [c.module for c in segments.cuts if c.module.endswith(".ln_2")]
    assert inside == [f"transformer.h.{i}.ln_2" for i in range(3)]
    said = {d.subject: d for d in strategy.settings.decisions}["segments"]
    assert said.choice.startswith("8, traced")
    assert "each block is cut in two as well, before its 'ln_2': 3 blocks do not divide" in (
        said.reason
    )
    whole = PipeMareStrategy(stages=2, microbatches=4, schedule="gpipe", balance=[3, 2])
    quiet_trainer(whole, max_steps=2).fit(listed, tokens())
    assert len(whole._runner.adapter.sequential) == 5
    assert "cut in two" not in {d.subject: d for d in whole.settings.decisions}["segments"].reason


def test_the_asynchronous_default_trains_the_tied_gpt():
    model = GPTModule(dropout=0.1)
    before = val_loss(model, tokens())
    strategy = PipeMareStrategy(stages=4, microbatches=4)
    monitor = StalenessMonitor(log_every_n_steps=5)
    quiet_trainer(strategy, max_steps=3 * STEPS, callbacks=[monitor]).fit(model, tokens())
    tied = monitor.stage_stats[3]  # the head's copy, seen by the staleness telemetry
    assert tied["tau_tied"] == strategy.delays[0].forward == 0.75
    assert tied["tau_tied_measured"] == pytest.approx(0.75)
    assert "tau_tied" not in monitor.stage_stats[0]
    chance = math.log(37)  # random tokens: below this it learnt the training sequences
    assert before > chance and val_loss(model, tokens()) < chance - 0.05


@pytest.mark.parametrize("stages", [2, 4])
def test_a_resnet18_trains_through_gpipe_as_on_one_device(stages, tmp_path):
    """N = 1: BatchNorm normalises over what it is given, so microbatches would change it."""
    base = ResNetModule()
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    quiet_trainer("auto", max_steps=8).fit(plain, images())
    strategy = PipeMareStrategy(stages=stages, schedule="gpipe")
    t = quiet_trainer(strategy, max_steps=8)
    t.fit(piped, images())
    # N = 1 because the traced model has BatchNorm (its segments hold plain modules in its
    # place), not because N = 1 happened to replay fastest on this machine at this moment
    (said,) = [d for d in strategy.settings.decisions if d.subject == "microbatches"]
    assert strategy.microbatches == 1 and "has BatchNorm" in said.reason, said
    _same(piped, plain, tol=1e-4)  # BatchNorm's running statistics included
    t.save_checkpoint(tmp_path / "resnet.ckpt")
    loaded = ResNetModule.load_from_checkpoint(tmp_path / "resnet.ckpt")
    assert val_loss(loaded, images()) == pytest.approx(val_loss(plain, images()), rel=1e-4)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_hugging_face_causal_lm_trains_through_gpipe_as_on_one_device(kind, stages):
    pytest.importorskip("transformers")
    base = HFModule(kind)
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    quiet_trainer("auto", max_steps=10).fit(plain, tokens())
    strategy = PipeMareStrategy(stages=stages, microbatches=2, schedule="gpipe")
    quiet_trainer(strategy, max_steps=10).fit(piped, tokens())
    _same(piped, plain, tol=1e-4)
    assert strategy.pipeline.ties.ties  # both tie their input embedding to the head


#: in two processes: every model of SETUPS but the zoo's (test_zoo). Llama is not among them:
#: it trains through the strategy in one process above, at P = 2 and 4, and a two-process run of
#: it crosses the link with nothing GPT-2's does not (a tie, activations, their gradients), for
#: about 40 CPU-s of tracing per rank, which was the fixture's largest share.
TWO_PROCESS_MODELS = sorted(m for m in SETUPS if not m.startswith("zoo-"))


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """One two-process launch that trains every model of
    :func:`test_two_gloo_processes_train_it_as_one_device` in turn (one start of the
    processes, not one per model); each test checks its own model's results."""
    out = tmp_path_factory.mktemp("two-process-models")
    launch_two_processes(TWO_PROCESS_MODELS, out)
    return out


@pytest.mark.parametrize("model", TWO_PROCESS_MODELS)
def test_two_gloo_processes_train_it_as_one_device(model, two_process_runs):
    """Each stage in its own process: a tie's copies live apart, its gradient crosses
    processes, and every process ends with the whole model, equal to one device's."""
    two_processes_equal_one_device(model, two_process_runs, weights=True)


def test_muon_with_adamw_trains_the_tied_gpt_through_gpipe_as_on_one_device():
    """One optimiser over two kinds of group: Muon for the blocks' matrices, AdamW for the
    tied embedding/head, norms and biases; each stage steps the groups it owns."""
    base = GPTModule(lr=0.02, optimizer="muon")
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    quiet_trainer("auto", max_steps=STEPS).fit(plain, tokens())
    strategy = PipeMareStrategy(stages=4, microbatches=4, schedule="gpipe")
    quiet_trainer(strategy, max_steps=STEPS).fit(piped, tokens())
    _same(piped, plain)


def test_two_optimisers_under_manual_optimisation_train_through_gpipe_as_on_one_device():
    """torch.optim.Muon and AdamW, stepped in training_step as Lightning's manual optimisation
    has it, with their schedulers stepped per batch in on_train_batch_end: the pipeline steps
    both, stage by stage, and ends where one device does; global_step counts both. One
    microbatch: torch's Muon orthogonalises in bfloat16, which turns the last bits that summing
    over microbatches moves into 4e-3 after 20 steps."""
    base = ManualGPTModule()
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    reference = quiet_trainer("auto", max_steps=2 * STEPS)
    reference.fit(plain, tokens())
    strategy = PipeMareStrategy(stages=4, microbatches=1, schedule="gpipe")
    t = quiet_trainer(strategy, max_steps=2 * STEPS)
    t.fit(piped, tokens())
    assert t.global_step == reference.global_step == 2 * STEPS
    assert [o.param_groups[0]["lr"] for o in t.optimizers] == [0.02, 3e-3]  # warmed up
    _same(piped, plain)


def test_the_planner_cuts_a_module_with_two_optimisers():
    """balance="auto" profiles copies of the layers with the run's two optimisers, rebuilt over
    the copies (pipemare.optim.chain.copies_of; tests/optim/test_chain.py checks the state)."""
    strategy = PipeMareStrategy(stages=2, balance="auto")
    t = quiet_trainer(strategy, max_steps=4)
    t.fit(ManualGPTModule(), tokens())
    assert t.global_step == 4 and len(strategy.balance) == 2 and min(strategy.balance) > 0


def test_two_optimisers_under_the_asynchronous_default_train_and_resume(tmp_path):
    """The default pipemare schedule with Muon + AdamW as two optimisers: the corrections see
    both (weight prediction on, delay-aware momentum standing aside for Muon as it does for
    MuonAdamW), the run trains, and a checkpoint (one state per optimiser) resumes as the
    uninterrupted run."""

    def fit(module, epochs, ckpt_path=None, callbacks=()):
        config = PipeMareConfig(reschedule_steps=3)
        strategy = PipeMareStrategy(stages=4, microbatches=4, balance="params", config=config)
        t = quiet_trainer(
            strategy, max_epochs=epochs, enable_checkpointing=bool(callbacks), callbacks=callbacks
        )
        t.fit(module, tokens(), tokens(16), ckpt_path=ckpt_path)
        return t

    base = ManualGPTModule()
    full, first, resumed = (copy.deepcopy(base) for _ in range(3))
    before = val_loss(base, tokens())
    t = fit(full, 3)
    described = t.strategy.pipeline.optimizer.describe()
    assert "weight_prediction" in described and "delay_momentum" not in described
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(first, 2, callbacks=[ckpt])
    states = torch.load(ckpt.last_model_path, weights_only=False)["optimizer_states"]
    assert [len(s["param_groups"]) for s in states] == [1, 1]
    assert "momentum_buffer" in next(iter(states[0]["state"].values()))  # Muon's
    assert "exp_avg" in next(iter(states[1]["state"].values()))  # AdamW's
    t = fit(resumed, 3, ckpt_path=ckpt.last_model_path)
    assert t.global_step == 2 * 3 * 8
    _same(resumed, full, tol=1e-6)
    assert val_loss(full, tokens()) < before - 0.1  # it trained


@pytest.mark.parametrize(("optimizer", "lr"), [("muon", 0.02), ("rotated", 3e-3)])
def test_a_run_resumes_from_its_checkpoint_as_the_uninterrupted_run(tmp_path, optimizer, lr):
    """The asynchronous default with Muon + AdamW, and with AdamW in a rotated basis: the
    checkpoint carries the optimiser's state (Muon's momentum, AdamW's moments, the rotated
    basis and its factors) and the corrections' buffers. Each epoch validates, which drains the
    pipeline in both runs (a resume starts from an empty pipeline)."""

    def fit(module, epochs, ckpt_path=None, callbacks=()):
        config = PipeMareConfig(reschedule_steps=3)  # the same horizon in the shorter run
        strategy = PipeMareStrategy(stages=4, microbatches=4, balance="params", config=config)
        t = quiet_trainer(
            strategy, max_epochs=epochs, enable_checkpointing=bool(callbacks), callbacks=callbacks
        )
        t.fit(module, tokens(), tokens(16), ckpt_path=ckpt_path)
        return t

    base = GPTModule(lr=lr, optimizer=optimizer)
    full, first, resumed = (copy.deepcopy(base) for _ in range(3))
    before = val_loss(base, tokens())
    fit(full, 3)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(first, 2, callbacks=[ckpt])
    t = fit(resumed, 3, ckpt_path=ckpt.last_model_path)
    assert t.global_step == 3 * 8
    _same(resumed, full, tol=1e-6)
    assert val_loss(full, tokens()) < before - 0.1  # it trained
