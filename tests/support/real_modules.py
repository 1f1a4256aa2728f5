"""LightningModules around models as people write them, with their data: a nanoGPT-style GPT
(support/real_models.GPT: blocks in a ModuleList, the head tied to the token embedding) with
its loss computed in the step, tiny Hugging Face causal LMs (loss from ``labels=``) and a
resnet18 as torchvision writes it; used by the strategy's tests and their worker processes."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from pipemare.optim import MuonAdamW, RotatedAdamW, muon_param_groups, rotated_param_groups
from support.real_models import GPT, GPTConfig, resnet18
from support.zoo import ZooModule
from support.zoo import data as zoo_data


class GPTModule(pl.LightningModule):
    """``optimizer="muon"``: Muon on the blocks' matrices and AdamW on the rest (embedding and
    tied head, norms, biases), one optimiser over two kinds of group; ``"rotated"``:
    RotatedAdamW with the embedding and tied head left to AdamW (``rotated_param_groups``)."""

    def __init__(
        self,
        lr: float = 0.5,
        dropout: float = 0.0,
        seed: int = 0,
        tied: bool = True,
        optimizer: str = "sgd",
        n_layer: int = 4,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gpt = GPT(GPTConfig(dropout=dropout, n_layer=n_layer))
        if not tied:
            self.gpt.lm_head.weight = nn.Parameter(self.gpt.lm_head.weight.detach().clone())
        self.lr, self.optimizer = lr, optimizer

    def _loss(self, batch):
        idx, targets = batch
        logits, _ = self.gpt(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        if self.optimizer == "muon":
            return MuonAdamW(muon_param_groups(self.gpt), lr=self.lr, weight_decay=0.01)
        if self.optimizer == "rotated":
            return RotatedAdamW(rotated_param_groups(self.gpt), lr=self.lr, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ManualGPTModule(GPTModule):
    """The GPT as the NanoGPT speedruns train it, written for Lightning's manual optimisation:
    ``torch.optim.Muon`` on the blocks' matrices and ``AdamW`` on the rest, two optimisers,
    each with a warm-up that ``on_train_batch_end`` steps."""

    def __init__(self, lr: float = 0.02, adam_lr: float = 3e-3, **kwargs) -> None:
        super().__init__(lr=lr, **kwargs)
        self.adam_lr = adam_lr
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        muon, adamw = self.optimizers()
        muon.zero_grad()
        adamw.zero_grad()
        loss = self._loss(batch)
        self.manual_backward(loss)
        muon.step()
        adamw.step()
        self.log("train_loss", loss)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self):
        hidden, rest = (g["params"] for g in muon_param_groups(self.gpt))
        muon = torch.optim.Muon(hidden, lr=self.lr, weight_decay=0.01)
        adamw = torch.optim.AdamW(rest, lr=self.adam_lr, weight_decay=0.01)
        warm = [torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=4) for o in (muon, adamw)]
        return [muon, adamw], warm


def tokens(n: int = 64, batch: int = 8, seed: int = 0) -> DataLoader:
    """``n`` random sequences; the target of each token is the next one."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, GPTConfig.vocab_size, (n, GPTConfig.block_size + 1), generator=gen)
    return DataLoader(TensorDataset(idx[:, :-1], idx[:, 1:]), batch_size=batch)


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


def images() -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 3, 16, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=8)


class HFModule(pl.LightningModule):
    """A Hugging Face causal LM as its users train it: the loss from ``labels=``, the config's
    ``use_cache`` as it ships (True)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        torch.manual_seed(0)
        if kind == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=37, n_positions=16, n_embd=16, n_layer=4, n_head=2,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            )  # fmt: skip
            self.model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(
                vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                tie_word_embeddings=True,
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


#: name -> (the LightningModule, its data, microbatches, training steps) for a comparison
#: with one device; N = 1 for the ResNet, whose BatchNorm normalises over what it is given
SETUPS = {
    "gpt": (GPTModule, tokens, 4, 20),
    "gpt-muon": (lambda: GPTModule(lr=0.02, optimizer="muon"), tokens, 4, 20),
    # two optimisers, each step counted: 20 batches; N = 1 as torch's Muon is bfloat16 inside
    "gpt-manual": (ManualGPTModule, tokens, 1, 40),
    "gpt2": (lambda: HFModule("gpt2"), tokens, 2, 10),
    "resnet": (ResNetModule, images, 1, 8),
    # from the zoo (support/zoo.py, tests/lightning/test_zoo.py): an encoder-decoder, its
    # config as it ships
    "zoo-t5": (lambda: ZooModule("t5"), lambda: zoo_data("seq2seq", n=80), 2, 10),
}
