"""A zoo of Hugging Face architectures as their users build them: each from its own config
class with only the sizes shrunk and dropout (and stochastic depth) set to 0, nothing else
edited (``use_cache`` stays as the config ships it), trained by a LightningModule that calls
``self.model(**batch).loss``. One family per modelling file of ``transformers``.

Each family has a learnable task of its kind: next-token prediction on sequences that count up
(causal LMs), the same sequence shifted by one (encoder–decoders), the tokens themselves
(masked LM), the first token's class (sequence classification), the brightest channel
(images)."""

from __future__ import annotations

from collections.abc import Callable

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, LENGTH, CLASSES = 32, 12, 3
#: the share of tokens and labels replaced by random ones
NOISE = 0.2
#: the sizes every family shrinks to: two blocks, the fewest that still repeat (each block
#: adds about 1.7 s to a cut on this project's CPUs: Qwen3 8.7 s at four, 5.2 s at two; the
#: zoo cuts dozens of models)
WIDTH, FFN, LAYERS, HEADS = 16, 32, 2, 2
#: the cut of every run held to a quality bound (test_zoo.py, test_lora.py): the even one,
#: which no timing decides (the default cut follows each layer's measured time, which moves
#: with the machine's load, and after a short run the quality moves with the cut)
QUALITY_CUT = "even"


def _hf(cls: str, config: str, **sizes: object) -> Callable[[], nn.Module]:
    """``transformers.<cls>(transformers.<config>(**sizes))``, built when called."""

    def build() -> nn.Module:
        import transformers

        return getattr(transformers, cls)(getattr(transformers, config)(**sizes))

    return build


_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=WIDTH,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
_ENCODER = dict(
    vocab_size=VOCAB,
    hidden_size=WIDTH,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
_IMAGE = dict(num_channels=3, num_labels=CLASSES)

#: family -> (the task's kind, the model built from its config class)
FAMILIES: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    # decoder-only
    "gpt2": (
        "causal",
        _hf(
            "GPT2LMHeadModel",
            "GPT2Config",
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=WIDTH,
            n_layer=LAYERS,
            n_head=HEADS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "llama": ("causal", _hf("LlamaForCausalLM", "LlamaConfig", **_DECODER)),
    "mistral": ("causal", _hf("MistralForCausalLM", "MistralConfig", **_DECODER)),
    "qwen2": ("causal", _hf("Qwen2ForCausalLM", "Qwen2Config", **_DECODER)),
    "qwen3": ("causal", _hf("Qwen3ForCausalLM", "Qwen3Config", **_DECODER, head_dim=8)),
    "gemma": ("causal", _hf("GemmaForCausalLM", "GemmaConfig", **_DECODER, head_dim=8)),
    "olmo": ("causal", _hf("OlmoForCausalLM", "OlmoConfig", **_DECODER)),
    "phi": (
        "causal",
        _hf("PhiForCausalLM", "PhiConfig", **_DECODER, resid_pdrop=0.0, embd_pdrop=0.0),
    ),
    "gpt_neox": (
        "causal",
        _hf(
            "GPTNeoXForCausalLM",
            "GPTNeoXConfig",
            **_DECODER,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    "opt": (
        "causal",
        _hf(
            "OPTForCausalLM",
            "OPTConfig",
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            ffn_dim=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=64,
            word_embed_proj_dim=WIDTH,
            dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    "falcon": (
        "causal",
        _hf(
            "FalconForCausalLM",
            "FalconConfig",
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    "bloom": (
        "causal",
        _hf(
            "BloomForCausalLM",
            "BloomConfig",
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            n_layer=LAYERS,
            n_head=HEADS,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    # a mixture of experts: each token routed to 2 of 4 experts
    "mixtral": (
        "causal",
        _hf(
            "MixtralForCausalLM",
            "MixtralConfig",
            **_DECODER,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    # encoder-only
    "bert": (
        "classify",
        _hf("BertForSequenceClassification", "BertConfig", **_ENCODER, num_labels=CLASSES),
    ),
    "distilbert": (
        "classify",
        _hf(
            "DistilBertForSequenceClassification",
            "DistilBertConfig",
            vocab_size=VOCAB,
            dim=WIDTH,
            hidden_dim=FFN,
            n_layers=LAYERS,
            n_heads=HEADS,
            dropout=0.0,
            attention_dropout=0.0,
            seq_classif_dropout=0.0,
            num_labels=CLASSES,
        ),
    ),
    "roberta": (
        "masked",
        _hf("RobertaForMaskedLM", "RobertaConfig", **_ENCODER, max_position_embeddings=40),
    ),
    # encoder-decoder
    "bart": (
        "seq2seq",
        _hf(
            "BartForConditionalGeneration",
            "BartConfig",
            vocab_size=VOCAB,
            d_model=WIDTH,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS,
            encoder_ffn_dim=FFN,
            decoder_ffn_dim=FFN,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            max_position_embeddings=64,
        ),
    ),
    # T5Config() names no decoder start token, without which T5's forward fails on one device
    # too; every T5 checkpoint's config sets it to the padding token, 0, as here
    "t5": (
        "seq2seq",
        _hf(
            "T5ForConditionalGeneration",
            "T5Config",
            vocab_size=VOCAB,
            d_model=WIDTH,
            d_kv=8,
            d_ff=FFN,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=HEADS,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        ),
    ),
    # vision transformers
    "vit": (
        "image",
        _hf(
            "ViTForImageClassification",
            "ViTConfig",
            **_IMAGE,
            image_size=16,
            patch_size=4,
            hidden_size=WIDTH,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=FFN,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
    ),
    "swin": (
        "image",
        _hf(
            "SwinForImageClassification",
            "SwinConfig",
            **_IMAGE,
            image_size=16,
            patch_size=2,
            embed_dim=8,
            depths=[1, 1],
            num_heads=[1, 2],
            window_size=4,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            drop_path_rate=0.0,
        ),
    ),
    # convolutional, with BatchNorm
    "resnet": (
        "image",
        _hf(
            "ResNetForImageClassification",
            "ResNetConfig",
            **_IMAGE,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
        ),
    ),
}


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class Batches(Dataset):
    """``n`` examples of a kind's learnable task, as dicts of tensors (the default collate
    stacks them into the keyword arguments of the model's call). A fifth of the tokens (of
    the labels) are replaced by random ones: the loss has a floor, which a model reaches in
    tens of steps, so two runs compare near it, not on their way down to zero."""

    def __init__(self, kind: str, n: int, seed: int, stride: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)

        def noisy(clean: torch.Tensor, low: int, high: int) -> torch.Tensor:
            flip = torch.rand(clean.shape, generator=gen) < NOISE
            return torch.where(flip, torch.randint(low, high, clean.shape, generator=gen), clean)

        start = torch.randint(1, VOCAB, (n, 1), generator=gen)
        # counting up by ``stride`` (0 stays the padding id)
        counting = (start + stride * torch.arange(LENGTH)) % (VOCAB - 1) + 1
        tokens = noisy(counting, 1, VOCAB)
        if kind == "causal":  # a causal LM shifts the labels itself
            self.items = {"input_ids": tokens, "labels": tokens}
        elif kind == "masked":  # the clean sequence, noised apart: the model denoises
            self.items = {"input_ids": tokens, "labels": noisy(counting, 1, VOCAB)}
        elif kind == "seq2seq":
            self.items = {
                "input_ids": tokens,
                "labels": noisy(counting % (VOCAB - 1) + 1, 1, VOCAB),
            }
        elif kind == "classify":
            self.items = {
                "input_ids": counting,
                "labels": noisy(counting[:, 0] % CLASSES, 0, CLASSES),
            }
        else:
            labels = torch.randint(0, CLASSES, (n,), generator=gen)
            pixels = torch.randn(n, 3, 16, 16, generator=gen) * 0.5
            pixels[torch.arange(n), labels] += 1.0  # the labelled channel is the brightest
            self.items = {"pixel_values": pixels, "labels": noisy(labels, 0, CLASSES)}
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.items.items()}


def data(kind: str, n: int = 320, batch: int = 8, seed: int = 0, stride: int = 1) -> DataLoader:
    """``n`` examples of the task, in batches; ``stride``: the causal sequences count up by it
    (a second task for fine-tuning a model trained on the first)."""
    return DataLoader(Batches(kind, n, seed, stride), batch_size=batch)


class ZooModule(pl.LightningModule):
    """A family's model trained as its users train it: the loss from ``labels=``."""

    def __init__(self, family: str, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.kind, build = FAMILIES[family]
        self.model = build()
        self.lr = lr

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class GPT2Module(ZooModule):
    """GPT-2 from ``GPT2Config()``'s defaults with only its sizes shrunk; its dropout (0.1) stays
    on unless ``dropout=False``. Trained on the causal task."""

    def __init__(self, dropout: bool = True, lr: float = 1e-2, layers: int = 4) -> None:
        pl.LightningModule.__init__(self)
        self.save_hyperparameters()
        import transformers

        torch.manual_seed(0)
        off = {} if dropout else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=layers, n_head=4, **off
        )
        self.kind, self.model, self.lr = "causal", transformers.GPT2LMHeadModel(config), lr


def padded_data(n: int = 96, batch: int = 8, seed: int = 0) -> DataLoader:
    """The causal task at lengths 4 to ``LENGTH``, as Hugging Face pads it: each batch padded to
    its own longest sequence by ``DataCollatorForSeq2Seq`` (padding ``0``, an attention mask,
    labels ``-100`` where padded), with a word-level tokenizer built in memory."""
    import tokenizers
    import transformers
    from tokenizers.models import WordLevel

    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    words = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[PAD]"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]")
    collate = transformers.DataCollatorForSeq2Seq(tokenizer, padding="longest")
    gen = torch.Generator().manual_seed(seed)
    tokens = Batches("causal", n, seed).items["input_ids"]
    lengths = torch.randint(4, LENGTH + 1, (n,), generator=gen)
    rows = [t[:k].tolist() for t, k in zip(tokens, lengths, strict=True)]
    examples = [{"input_ids": r, "labels": r} for r in rows]
    return DataLoader(examples, batch_size=batch, collate_fn=collate)  # type: ignore[arg-type]


#: a Gemma of 45M parameters (180 MB in fp32; its head tied to its embedding): a file much
#: larger than what stage 0's process holds when the cut is right after the embedding. One
#: block, its MLP wide (each of its three matrices 57 MB, a shard of its own at 60 MB): the
#: size is what the test needs, and each block more only adds to the trace on both ranks
BIG_GEMMA = _hf(
    "GemmaForCausalLM",
    "GemmaConfig",
    vocab_size=VOCAB,
    hidden_size=1024,
    intermediate_size=13824,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    max_position_embeddings=64,
)


class MetaZoo(ZooModule):
    """A family's model built the Lightning way for a model bigger than one device: in
    ``configure_model``, which the strategy runs with the parameters on the meta device
    (``family="big-gemma"``: :data:`BIG_GEMMA`)."""

    def __init__(self, family: str, lr: float = 1e-2) -> None:
        pl.LightningModule.__init__(self)
        self.family, self.lr, self.model = family, lr, None
        self.kind = "causal" if family == "big-gemma" else FAMILIES[family][0]

    def configure_model(self) -> None:
        if self.model is None:
            self.model = BIG_GEMMA() if self.family == "big-gemma" else FAMILIES[self.family][1]()
