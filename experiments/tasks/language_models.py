"""A small Transformer language model whose blocks form a fine-grained ``nn.Sequential``."""

from __future__ import annotations

import torch
from pytorch_lightning.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.nn import functional as F
from torchmetrics.text import Perplexity

from pipemare.experiments.tasks.classifiers import TaskModule

__all__ = ["CharTransformerLM", "TransformerBlock"]


class TokenEmbedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab_size: int, d_model: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(context, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class TransformerBlock(nn.Module):
    """A pre-norm decoder block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        x = x + self.drop(self.attn(h, h, h, attn_mask=causal, need_weights=False)[0])
        return x + self.drop(self.mlp(self.norm2(x)))


class LMHead(nn.Module):
    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class CharTransformerLM(TaskModule):
    """A byte-level Transformer LM: ``self.net`` = embedding, ``layers`` blocks, head.

    Logs ``train_loss``/``val_loss`` (nats per byte) and perplexity from torchmetrics.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 6,
        context: int = 32,
        dropout: float = 0.0,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.net = nn.Sequential(
            TokenEmbedding(vocab_size, d_model, context),
            *[TransformerBlock(d_model, heads, dropout) for _ in range(layers)],
            LMHead(d_model, vocab_size),
        )
        self.train_ppl = Perplexity()
        self.val_ppl = Perplexity()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        ids, targets = batch
        logits = self.net(ids)
        loss = self._loss(logits, targets)
        self.train_ppl(logits, targets)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", self.train_ppl, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        ids, targets = batch
        logits = self.net(ids)
        self.val_ppl(logits, targets)
        self.log("val_loss", self._loss(logits, targets), prog_bar=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        ids, targets = batch
        self.log("test_loss", self._loss(self.net(ids), targets))
