"""A byte-level GPT written as people write one (token and position embeddings, its blocks in
an ``nn.ModuleList`` looped over in ``forward``, a final LayerNorm and a head tied to the token
embedding), bare and as a LightningModule that logs its loss and perplexity."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.text import Perplexity


class Block(nn.Module):
    """Pre-norm: causal multi-head self-attention, then a 4x MLP, each added to its input."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln_1(x)).split(d, dim=2)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``layers`` blocks over token + position embeddings; ``lm_head`` shares ``wte``'s weight."""

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 6,
        context: int = 32,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class CharGPT(pl.LightningModule):
    """:class:`GPT` over bytes as ``self.net``: next-byte cross-entropy logged as
    ``{stage}_loss``, torchmetrics' perplexity updated in the step and logged as
    ``{stage}_ppl``; ``optimizer`` builds the optimiser from the parameters (Adam by default)."""

    def __init__(
        self,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 6,
        context: int = 32,
        optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
    ) -> None:
        super().__init__()
        self.net = GPT(256, d_model, heads, layers, context)
        self.make_optimizer = optimizer
        self.train_ppl, self.val_ppl = Perplexity(), Perplexity()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def _step(self, stage: str, batch: Any) -> torch.Tensor:
        ids, targets = batch
        logits = self.net(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        perplexity = getattr(self, f"{stage}_ppl")
        perplexity(logits, targets)
        self.log(f"{stage}_loss", loss, prog_bar=True)
        self.log(f"{stage}_ppl", perplexity, on_step=False, on_epoch=True)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step("train", batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step("val", batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer(self.parameters())
