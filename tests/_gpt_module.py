"""A nanoGPT-style LightningModule as people write one (tests/_real_models.GPT: blocks in a
ModuleList, the head tied to the token embedding), its loss computed in the step, and
random token data; used by the strategy's tests and their worker processes."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from _real_models import GPT, GPTConfig
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class GPTModule(pl.LightningModule):
    def __init__(
        self, lr: float = 0.5, dropout: float = 0.0, seed: int = 0, tied: bool = True
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gpt = GPT(GPTConfig(dropout=dropout))
        if not tied:
            self.gpt.lm_head.weight = nn.Parameter(self.gpt.lm_head.weight.detach().clone())
        self.lr = lr

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
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def tokens(n: int = 64, batch: int = 8, seed: int = 0) -> DataLoader:
    """``n`` random sequences; the target of each token is the next one."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, GPTConfig.vocab_size, (n, GPTConfig.block_size + 1), generator=gen)
    return DataLoader(TensorDataset(idx[:, :-1], idx[:, 1:]), batch_size=batch)
