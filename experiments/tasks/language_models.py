"""A small Transformer language model whose blocks form a fine-grained ``nn.Sequential``."""

from __future__ import annotations

import torch
from pytorch_lightning.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.nn import functional as F
from torchmetrics.text import Perplexity

from pipemare.experiments.tasks.classifiers import TaskModule

__all__ = [
    "CharTransformerLM",
    "TransformerBlock",
    "causal_mask",
    "char_transformer",
    "next_token_loss",
]


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """``True`` where a position may not attend: every later position."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position's prediction of its next token."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


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
        causal = causal_mask(x.shape[1], x.device)
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


def char_transformer(
    vocab_size: int, d_model: int, heads: int, layers: int, context: int, dropout: float = 0.0
) -> nn.Sequential:
    """Embedding, ``layers`` decoder blocks and the head, one unit of a pipeline each."""
    return nn.Sequential(
        TokenEmbedding(vocab_size, d_model, context),
        *[TransformerBlock(d_model, heads, dropout) for _ in range(layers)],
        LMHead(d_model, vocab_size),
    )


class CharTransformerLM(TaskModule):
    """A byte-level Transformer LM: ``self.net`` = embedding, ``layers`` blocks, head.

    Logs ``train_loss``/``val_loss`` (nats per byte) and perplexity from torchmetrics.
    """

    metric = "ppl"

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
        self.net = self.network(vocab_size, d_model, heads, layers, context, dropout)
        self.train_ppl = Perplexity()
        self.val_ppl = Perplexity()

    @staticmethod
    def network(
        vocab_size: int, d_model: int, heads: int, layers: int, context: int, dropout: float
    ) -> nn.Module:
        """The model ``self.net`` holds (a subclass may write it otherwise)."""
        return char_transformer(vocab_size, d_model, heads, layers, context, dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, stage: str) -> torch.Tensor:
        return next_token_loss(logits, targets)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step("test", batch)
