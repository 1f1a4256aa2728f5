"""An encoder-decoder Transformer as one ``nn.Sequential``, for IWSLT14 German-English.

Stages pass a tuple ``(memory, target states, source padding mask, target padding mask)``:
the embedding layer makes it from ``(source ids, target ids)``, encoder layers update the
memory, decoder layers update the target states (reading the memory they carry along) and the
head turns the target states into logits. Every layer is one unit of a fine-grained pipeline.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from pytorch_lightning.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.nn import functional as F
from torchmetrics.text import Perplexity

from pipemare.experiments.tasks.classifiers import TaskModule
from pipemare.experiments.tasks.language_models import causal_mask

__all__ = ["PAD", "TranslationTransformer", "byte_tokens", "pad_batch"]

PAD, BOS, EOS = 256, 257, 258  # byte-level tokens 0..255, then these
VOCAB = 259

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class _Embed(nn.Module):
    def __init__(self, d_model: int, max_length: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.positions = nn.Embedding(max_length, d_model)
        self.scale = math.sqrt(d_model)
        self.drop = nn.Dropout(dropout)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        pos = self.positions(torch.arange(ids.shape[1], device=ids.device))
        return self.drop(self.tokens(ids) * self.scale + pos)

    def forward(self, ids: tuple[torch.Tensor, torch.Tensor]) -> State:
        src, tgt = ids
        return self._embed(src), self._embed(tgt), src == PAD, tgt == PAD


class _Layer(nn.Module):
    """One of torch's pre-norm Transformer layers (``kind``), passing the stages' tuple on."""

    kind: type[nn.Module]

    def __init__(self, d_model: int, heads: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.layer = self.kind(d_model, heads, ffn, dropout, batch_first=True, norm_first=True)


class _Encoder(_Layer):
    kind = nn.TransformerEncoderLayer

    def forward(self, state: State) -> State:
        memory, tgt, src_pad, tgt_pad = state
        return self.layer(memory, src_key_padding_mask=src_pad), tgt, src_pad, tgt_pad


class _Decoder(_Layer):
    kind = nn.TransformerDecoderLayer

    def forward(self, state: State) -> State:
        memory, tgt, src_pad, tgt_pad = state
        out = self.layer(
            tgt,
            memory,
            tgt_mask=causal_mask(tgt.shape[1], tgt.device),
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )
        return memory, out, src_pad, tgt_pad


class _Head(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, VOCAB)

    def forward(self, state: State) -> torch.Tensor:
        return self.out(self.norm(state[1]))


class TranslationTransformer(TaskModule):
    """A pre-norm encoder-decoder Transformer on bytes (Vaswani et al., 2017).

    The defaults follow the IWSLT14 setting of the PipeMare paper's Transformer experiment
    (6+6 layers, width 512, 4 heads, 1024 hidden, dropout 0.3, label smoothing 0.1); tokens
    are UTF-8 bytes instead of a learned BPE vocabulary. Logs loss and perplexity; use
    :meth:`translate` on the trained model for greedy decoding (and BLEU).
    """

    metric = "ppl"
    metric_options: ClassVar[dict[str, dict[str, Any]]] = {"val": {}}

    def __init__(
        self,
        d_model: int = 512,
        heads: int = 4,
        ffn: int = 1024,
        encoder_layers: int = 6,
        decoder_layers: int = 6,
        dropout: float = 0.3,
        label_smoothing: float = 0.1,
        max_length: int = 256,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler)
        self.net = nn.Sequential(
            _Embed(d_model, max_length, dropout),
            *[_Encoder(d_model, heads, ffn, dropout) for _ in range(encoder_layers)],
            *[_Decoder(d_model, heads, ffn, dropout) for _ in range(decoder_layers)],
            _Head(d_model),
        )
        self.label_smoothing = label_smoothing
        self.val_ppl = Perplexity(ignore_index=PAD)

    def _outputs(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        src, tgt = batch  # teacher forcing: each target token predicts the next
        return self.net((src, tgt[:, :-1])), tgt[:, 1:]

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, stage: str) -> torch.Tensor:
        return F.cross_entropy(
            logits.reshape(-1, VOCAB),
            targets.reshape(-1),
            ignore_index=PAD,
            label_smoothing=self.label_smoothing if stage == "train" else 0.0,
        )

    @torch.no_grad()
    def translate(self, src: torch.Tensor, max_length: int = 200) -> list[str]:
        """Greedy decoding with the whole model in this process (after training)."""
        out = torch.full((src.shape[0], 1), BOS, dtype=torch.long, device=src.device)
        for _ in range(max_length):
            next_ids = self.net((src, out))[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, next_ids], dim=1)
            if bool((next_ids == EOS).all()):
                break
        return [_decode(row) for row in out[:, 1:].tolist()]


def _decode(ids: list[int]) -> str:
    data = bytes(i for i in (ids[: ids.index(EOS)] if EOS in ids else ids) if i < 256)
    return data.decode("utf-8", errors="replace")


def byte_tokens(text: str, max_length: int) -> list[int]:
    """Bytes of ``text`` between BOS and EOS, cut to ``max_length`` tokens."""
    body = list(text.encode("utf-8"))[: max_length - 2]
    return [BOS, *body, EOS]


def pad_batch(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows], dtype=torch.long)
