"""A character-level GPT written as people write one: token and position embeddings, its
blocks in an ``nn.ModuleList`` looped over in ``forward``, a final LayerNorm and an output
head whose weight is the token embedding's. pipemare pipelines it unchanged: it is traced and
cut at its blocks, and the tie between the first and the last stage is trained across them."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pipemare.experiments.tasks.language_models import CharTransformerLM

__all__ = ["GPT", "CharGPT", "GPTBlock"]


class GPTBlock(nn.Module):
    """Pre-norm decoder block: causal multi-head self-attention, then an MLP, each residual."""

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self._attention(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """``layers`` blocks over token + position embeddings; the head shares the token embedding."""

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 6,
        context: int = 32,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(d_model, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, two uses

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class CharGPT(CharTransformerLM):
    """The byte-level LM of :class:`CharTransformerLM` (same arguments, data and metrics) with
    ``self.net`` a :class:`GPT`, written as people write one instead of as a Sequential."""

    @staticmethod
    def network(
        vocab_size: int, d_model: int, heads: int, layers: int, context: int, dropout: float
    ) -> nn.Module:
        return GPT(vocab_size, d_model, heads, layers, context, dropout)
