"""How each microbatch's loss counts in its minibatch's: a loss that averages over counted
tokens (``ignore_index=-100``, padding left out) needs each microbatch's share of those tokens,
not of the rows, for the pipeline's gradient to be one device's."""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from pipemare import PipeMareStrategy
from pipemare.engine.microbatch import IGNORE_INDEX, token_shares
from support.models import quiet_trainer


class Tagger(pl.LightningModule):
    """A per-token classifier written for one device, its loss the mean over the counted
    tokens of padded rows (not a Hugging Face model: nothing tells pipemare how it averages)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Embedding(20, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def padded_rows(n=48, length=10):
    """Rows of 1 to ``length`` counted tokens, the rest of each row padding (-100)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 20, (n, length), generator=gen)
    y = torch.randint(0, 5, (n, length), generator=gen)
    kept = torch.randint(1, length + 1, (n, 1), generator=gen)
    y[torch.arange(length).expand(n, length) >= kept] = IGNORE_INDEX
    return DataLoader(TensorDataset(x, y), batch_size=8)


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


def fit(module, **options):
    strategy = PipeMareStrategy(stages=2, microbatches=2, schedule="gpipe", **options)
    trainer = quiet_trainer(strategy, max_steps=6)
    trainer.fit(module, padded_rows())
    return trainer


@pytest.mark.parametrize("weights_by", ["tokens", token_shares()])
def test_a_token_averaged_loss_weighted_by_tokens_equals_one_device(weights_by, caplog):
    pl.seed_everything(0)
    base = Tagger()
    plain, by_tokens, by_rows = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    one = quiet_trainer("auto", max_steps=6)
    one.fit(plain, padded_rows())
    t = fit(by_tokens, microbatch_weights=weights_by)
    for a, b in zip(weights(by_tokens), weights(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        t.callback_metrics["train_loss"], one.callback_metrics["train_loss"], rtol=0, atol=1e-6
    )
    assert "microbatch weights:" in caplog.text
    # by rows (the default for a model pipemare cannot read) the gradient is another one
    fit(by_rows)
    pairs = zip(weights(by_rows), weights(plain), strict=True)
    gap = max((a - b).abs().max().item() for a, b in pairs)
    assert gap > 1e-4


def test_a_bad_microbatch_weights_value_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"microbatch_weights must be 'auto' .* got 'labels'"):
        PipeMareStrategy(microbatch_weights="labels")
