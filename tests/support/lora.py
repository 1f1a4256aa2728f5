"""Fine-tuning as Hugging Face and ``peft`` users do it: a GPT-2 or a Llama built from its
config class (support/zoo.py's sizes, dropout 0) is trained on one task (sequences counting up
by 1) and saved with ``save_pretrained`` into a local directory (:func:`pretrain`); the
fine-tuning run loads it with ``from_pretrained`` and learns a second task (counting up by 2),
with LoRA adapters (``peft``'s ``get_peft_model``) on attention and MLP, or wrapped whole in a
module of the user's own whose ``forward(self, **kwargs)`` hands everything on. The
LightningModule calls ``self.model(input_ids=..., labels=...).loss`` as for one device, with
AdamW over the parameters that train (peft's recipe)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from support.models import quiet_trainer
from support.zoo import FAMILIES, ZooModule, data

#: the fine-tuning task: sequences counting up by 2 (the pretraining task counts up by 1)
STRIDE = 2

#: LoRA's targets per family: attention and MLP projections
TARGETS = {"gpt2": ["c_attn", "c_fc"], "llama": ["q_proj", "v_proj", "up_proj"]}
#: what each test model is: (family, how it is wrapped)
MODELS = {
    "lora-gpt2": ("gpt2", "peft"),
    "lora-llama": ("llama", "peft"),
    "own-gpt2": ("gpt2", "own"),  # the user's own **kwargs wrapper, every weight training
}
RANK, ALPHA = 4, 8


class KeywordsOnly(nn.Module):
    """A wrapper of the user's own: every argument by keyword, handed on."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs: Any) -> Any:
        return self.model(**kwargs)


def base_model(family: str, pretrained: str | Path | None = None) -> nn.Module:
    """The family's causal LM: from its config class (seeded), or ``from_pretrained`` of a
    local directory."""
    if pretrained is not None:
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    torch.manual_seed(0)
    return FAMILIES[family][1]()


def pretrain(family: str, path: str | Path, steps: int = 60) -> Path:
    """Train the family's model on the first task on one device (AdamW, every weight) and
    ``save_pretrained`` it into ``path``: the checkpoint the fine-tuning runs start from."""
    module = ZooModule(family)  # base_model(family), trained on ``model(**batch).loss``
    quiet_trainer("auto", max_steps=steps).fit(module, data("causal", n=8 * steps))
    module.model.save_pretrained(path)
    return Path(path)


def task(n: int = 320, seed: int = 0) -> Any:
    """The fine-tuning task's batches."""
    return data("causal", n=n, seed=seed, stride=STRIDE)


def adapt(model: nn.Module) -> nn.Module:
    """``model`` with LoRA adapters (rank 4, no dropout); the base frozen, as peft leaves it."""
    import peft

    family = "gpt2" if model.config.model_type == "gpt2" else "llama"
    torch.manual_seed(1)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS[family],
                             lora_dropout=0.0)  # fmt: skip
    return peft.get_peft_model(model, config)


def other_adapter(kind: str, model: nn.Module) -> nn.Module:
    """``model`` with one of peft's other methods: prompt tuning, prefix tuning (4 virtual
    tokens each) or IA3 (on attention and MLP)."""
    import peft

    torch.manual_seed(1)
    configs = {
        "prompt": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "prefix": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "ia3": lambda: peft.IA3Config(
            task_type="CAUSAL_LM", target_modules=["c_attn", "c_fc"], feedforward_modules=["c_fc"]
        ),
    }
    return peft.get_peft_model(model, configs[kind]())


class FineTune(pl.LightningModule):
    """One of :data:`MODELS`; ``call``: keywords the user writes into every call of the model
    (``{"use_cache": False}``)."""

    def __init__(
        self,
        name: str = "lora-gpt2",
        lr: float = 1e-2,
        call: dict[str, Any] | None = None,
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        family, wrap = MODELS[name]
        base = base_model(family, pretrained)
        self.model = adapt(base) if wrap == "peft" else KeywordsOnly(base)
        self.kind, self.lr, self.call = "causal", lr, dict(call or {})

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"], **self.call).loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"], **self.call).loss
        self.log("val_loss", loss)

    def configure_optimizers(self):
        trained = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trained, lr=self.lr)

    def save_pretrained(self, path: str | Path) -> None:
        """The adapter alone (peft), or the whole fine-tuned model (the user's wrapper)."""
        model = self.model.model if isinstance(self.model, KeywordsOnly) else self.model
        model.save_pretrained(path)


def load_saved(name: str, pretrained: str | Path, path: str | Path) -> FineTune:
    """A fresh module on one device with what :meth:`FineTune.save_pretrained` wrote into
    ``path``: the adapter loaded onto the ``pretrained`` base (``PeftModel.from_pretrained``),
    or the whole fine-tuned model."""
    family, wrap = MODELS[name]
    module = FineTune(name, pretrained=str(pretrained))
    if wrap == "peft":
        import peft

        base = base_model(family, pretrained)
        module.model = peft.PeftModel.from_pretrained(base, path)
    else:
        module.model = KeywordsOnly(base_model(family, pretrained=path))
    return module
