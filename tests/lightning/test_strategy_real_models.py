"""Models as people write them, through Trainer(strategy="pipemare") with no argument naming a
module or a cut: a nanoGPT with its head tied to its embedding, Hugging Face GPT-2 and Llama
(tiny, random, nothing downloaded, loss from labels=), a resnet18 as torchvision writes it.
gpipe reproduces one device (weights, validation loss); a checkpoint loads into the plain
module; the asynchronous default trains them."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from _gpt_module import GPTModule, tokens
from _launch import environment, run_all
from _models import quiet_trainer
from _real_models import resnet18
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from pipemare import PipeMareStrategy
from pipemare.callbacks import StalenessMonitor

STEPS = 20
TESTS = Path(__file__).resolve().parents[1]


def _same(a: pl.LightningModule, b: pl.LightningModule, tol: float = 1e-5) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=name)


def _val(module: pl.LightningModule, data: DataLoader) -> float:
    (out,) = quiet_trainer("auto").validate(module, data, verbose=False)
    return out["val_loss"]


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
    assert _val(loaded, tokens()) == pytest.approx(_val(plain, tokens()), rel=1e-5)


def test_the_asynchronous_default_trains_the_tied_gpt():
    model = GPTModule(dropout=0.1)
    before = _val(model, tokens())
    strategy = PipeMareStrategy(stages=4, microbatches=4)
    monitor = StalenessMonitor(log_every_n_steps=5)
    quiet_trainer(strategy, max_steps=3 * STEPS, callbacks=[monitor]).fit(model, tokens())
    tied = strategy.stage_stats[3]  # the head's copy, seen by the staleness telemetry
    assert tied["tau_tied"] == strategy.delays[0].forward == 0.75
    assert tied["tau_tied_measured"] == pytest.approx(0.75)
    assert "tau_tied" not in strategy.stage_stats[0]
    chance = math.log(37)  # random tokens: below this it learnt the training sequences
    assert before > chance and _val(model, tokens()) < chance - 0.05


class ResNetModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = resnet18(num_classes=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _images() -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 3, 16, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_a_resnet18_trains_through_gpipe_as_on_one_device(tmp_path):
    """N = 1: BatchNorm normalises over what it is given, so microbatches would change it."""
    base = ResNetModule()
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    quiet_trainer("auto", max_steps=8).fit(plain, _images())
    t = quiet_trainer(PipeMareStrategy(stages=2, schedule="gpipe"), max_steps=8)
    t.fit(piped, _images())
    _same(piped, plain, tol=1e-4)  # BatchNorm's running statistics included
    t.save_checkpoint(tmp_path / "resnet.ckpt")
    loaded = ResNetModule.load_from_checkpoint(tmp_path / "resnet.ckpt")
    assert _val(loaded, _images()) == pytest.approx(_val(plain, _images()), rel=1e-4)


class HFModule(pl.LightningModule):
    """A Hugging Face causal LM as its users train it: the loss from ``labels=``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        if kind == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=37, n_positions=16, n_embd=16, n_layer=4, n_head=2,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            )  # fmt: skip
            self.model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(
                vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                tie_word_embeddings=True, use_cache=False,
            )  # fmt: skip
            self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        idx, _ = batch
        return self.model(input_ids=idx, labels=idx).loss

    def validation_step(self, batch, batch_idx):
        idx, _ = batch
        self.log("val_loss", self.model(input_ids=idx, labels=idx).loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_hugging_face_causal_lm_trains_through_gpipe_as_on_one_device(kind):
    base = HFModule(kind)
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    quiet_trainer("auto", max_steps=10).fit(plain, tokens())
    strategy = PipeMareStrategy(stages=2, microbatches=2, schedule="gpipe")
    quiet_trainer(strategy, max_steps=10).fit(piped, tokens())
    _same(piped, plain, tol=1e-4)
    assert strategy.pipeline.ties.ties  # both tie their input embedding to the head


def test_two_gloo_processes_train_the_tied_gpt_as_one_device(tmp_path):
    """Each stage in its own process: the tie's copies live apart, its gradient crosses
    processes, and every process ends with the whole model, equal to one device's."""
    worker = str(TESTS / "_gpt_worker.py")
    run_all([([sys.executable, worker, "--out", str(tmp_path)], environment())])
    plain = GPTModule()
    quiet_trainer("auto", max_steps=STEPS).fit(plain, tokens())
    for rank in (0, 1):
        weights = torch.load(tmp_path / f"weights-{rank}.pt")
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=name)
        report = json.loads((tmp_path / f"report-{rank}.json").read_text())
        assert report["val_loss"] == pytest.approx(_val(plain, tokens()), rel=1e-5)
    loaded = GPTModule.load_from_checkpoint(tmp_path / "gpt.ckpt")
    assert _val(loaded, tokens()) == pytest.approx(_val(plain, tokens()), rel=1e-5)
