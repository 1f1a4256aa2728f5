"""Models as people write them, cut into segments: running the segments in a row is the model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipemare.engine.ties import tied_parameters
from pipemare.model.blocks import Cut, block_cuts, halved
from pipemare.model.segments import (
    UncuttableModelError,
    default_cuts,
    segment_module,
    source_names,
)
from support.real_models import GPT, GPTConfig, resnet18

# one worker runs the module: its tests share module-scoped fixtures
pytestmark = pytest.mark.xdist_group("segments")


def run(segments, *args, **kwargs):
    return segments(segments.flatten_inputs(*args, **kwargs))


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return out


def ties(segments: nn.Sequential, names: nn.Module) -> list[tuple[str, list[int]]]:
    """The parameters several segments hold, as the pipeline finds them, each under its first
    name in ``names`` with the segments that hold it."""
    name = {id(p): n for n, p in names.named_parameters()}
    return [(name[id(p)], list(where)) for p, where in tied_parameters(list(segments))]


@pytest.fixture(scope="module")
def gpt_cut():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=3))
    idx = torch.randint(0, 37, (4, 8))
    return gpt, segment_module(gpt, (idx,), {"targets": idx})


@pytest.fixture(scope="module")
def resnet_cut():
    torch.manual_seed(0)
    net = resnet18()
    return net, segment_module(net, (torch.randn(4, 3, 32, 32),), dynamic="all")


def test_by_default_only_the_batch_and_the_sequence_length_may_vary():
    """An image's height and width are fixed at the example's unless asked (a windowed vision
    transformer's trace takes minutes with them symbolic); another size gets advice that works."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    seg = segment_module(net, (torch.randn(4, 3, 12, 12),))
    assert run(seg, torch.randn(3, 3, 12, 12)).shape == (3, 2, 8, 8)
    with pytest.raises(ValueError, match="dynamic='all'"):
        run(seg, torch.randn(2, 3, 10, 10))
    every = segment_module(net, (torch.randn(4, 3, 12, 12),), dynamic="all")
    x = torch.randn(2, 3, 10, 10)
    torch.testing.assert_close(run(every, x), net(x))


def test_gpt_is_cut_around_each_block_with_its_tie_reported_once(gpt_cut):
    gpt, seg = gpt_cut
    assert len(seg) == 3 + 2  # embeddings, 3 blocks, ln_f + lm_head
    assert ties(seg, gpt) == [("transformer.wte.weight", [0, 4])]
    own = gpt.state_dict(keep_vars=True)
    for key, name in source_names(seg).items():
        assert seg.state_dict(keep_vars=True)[key] is own[name]  # the user's tensor, no copy
    held = {id(own[name]) for name in source_names(seg).values()}
    assert held >= {id(p) for p in gpt.parameters()}  # every parameter, under one of its names


@pytest.mark.parametrize("training", [True, False])
def test_gpt_segments_reproduce_forward_and_gradients(gpt_cut, training):
    gpt, seg = gpt_cut
    gpt.train(training), seg.train(training)
    idx, targets = torch.randint(0, 37, (2, 6)), torch.randint(0, 37, (2, 6))  # not the example's
    torch.manual_seed(7)
    logits, loss = gpt(idx, targets)
    loss.backward()
    expected = grads(gpt)
    torch.manual_seed(7)
    seg_logits, seg_loss = run(seg, idx, targets=targets)
    seg_loss.backward()
    assert torch.equal(seg_logits, logits) and torch.equal(seg_loss, loss)
    got = grads(gpt)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7)


def test_dropout_stays_random_in_train_mode(gpt_cut):
    _, seg = gpt_cut
    seg.train()
    idx = torch.randint(0, 37, (2, 6))
    first, second = run(seg, idx, idx)[0], run(seg, idx, idx)[0]
    assert not torch.equal(first, second)
    seg.eval()
    assert torch.equal(run(seg, idx, idx)[0], run(seg, idx, idx)[0])


def test_named_split_points_are_honoured():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=4, dropout=0.0))
    idx = torch.randint(0, 37, (3, 8))
    seg = segment_module(gpt, (idx,), split_points=["transformer.h.2"], eval_graph=False)
    assert len(seg) == 2
    names = [{n for n, _ in s.named_parameters()} for s in seg]
    assert "transformer.h.1.ln_1.weight" in names[0] and "transformer.h.2.ln_1.weight" in names[1]
    assert not any(n.startswith("transformer.h.2") for n in names[0])
    assert ties(seg, gpt) == [("transformer.wte.weight", [0, 1])]
    torch.testing.assert_close(run(seg, idx)[0], gpt(idx)[0], rtol=0, atol=0)
    cut = [Cut("transformer.h.3", after=True)]
    after = segment_module(gpt, (idx,), split_points=cut, eval_graph=False)
    head = {n for n, _ in after[1].named_parameters()}
    assert len(after) == 2 and head == {
        "lm_head.weight",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    }


def test_a_block_cut_between_its_attention_and_its_mlp_beside_the_cut_before_it():
    """Six blocks on four stages leave two blocks on some stage; a cut inside a block (before
    its second LayerNorm) as well as before it evens the stages out. The block is called once,
    so the nested cut is not a reuse: the halves reproduce the model's loss and gradients."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, dropout=0.0))
    idx = torch.randint(0, 37, (3, 8))
    cuts = ["transformer.h.0", "transformer.h.0.ln_2", "transformer.h.1", "transformer.h.1.ln_2"]
    seg = segment_module(gpt, (idx,), {"targets": idx}, split_points=cuts, eval_graph=False)
    names = [{n for n, _ in s.named_parameters()} for s in seg]
    assert len(seg) == 5
    assert {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.ln_1.weight"} <= names[1]
    assert {"transformer.h.0.mlp.c_fc.weight", "transformer.h.0.ln_2.weight"} <= names[2]
    assert not any(n.startswith("transformer.h.0") for n in names[3])
    torch.manual_seed(7)
    _, loss = gpt(idx, idx)
    loss.backward()
    expected = grads(gpt)
    seg_loss = run(seg, idx, targets=idx)[1]
    seg_loss.backward()
    assert torch.equal(seg_loss, loss)
    got = grads(gpt)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7)


def test_a_copy_of_the_segments_trains_apart_from_the_original():
    """deepcopy (Lightning and users copy models) gives segments with their own tensors that
    compute what the original does and leave it untouched when they train."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, dropout=0.0))
    idx = torch.randint(0, GPTConfig.vocab_size, (4, GPTConfig.block_size))
    # a cut for training only, test_named_split_points_are_honoured's first: one trace for both
    segments = segment_module(model, (idx,), split_points=["transformer.h.2"], eval_graph=False)
    twin = copy.deepcopy(segments)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = segments.flatten_inputs(idx)
    torch.testing.assert_close(twin(inputs)[0], segments(inputs)[0], rtol=0, atol=0)
    assert all(a is not b for a, b in zip(twin.parameters(), segments.parameters(), strict=True))
    assert ties(twin, twin) == ties(segments, segments)
    tied = dict(twin[0].named_parameters())["lm_head.weight"]  # export names it so
    assert tied is dict(twin[-1].named_parameters())["lm_head.weight"]  # still one tensor
    twin(inputs)[0].sum().backward()
    torch.optim.SGD(twin.parameters(), lr=1.0).step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(twin(inputs)[0], segments(inputs)[0])


def test_resnet_is_cut_at_stem_each_basic_block_and_head(resnet_cut):
    net, seg = resnet_cut
    assert [c.module for c in block_cuts(net)][:3] == ["layer1.0", "layer1.1", "layer2.0"]
    assert len(seg) == 1 + 8 + 1
    assert {n.rpartition(".")[0] for n, _ in seg[-1].named_parameters()} == {"fc"}
    assert any(n.startswith("layer2.0.downsample") for n, _ in seg[3].named_parameters())
    assert ties(seg, net) == []


@pytest.mark.parametrize("training", [True, False])
def test_resnet_segments_reproduce_output_gradients_and_batchnorm_stats(resnet_cut, training):
    net, seg = resnet_cut
    twin = copy.deepcopy(net)
    net.train(training), seg.train(training), twin.train(training)
    x = torch.randn(2, 3, 24, 24)  # other batch and image size than the example's
    expected = twin(x)
    expected.square().mean().backward()
    out = run(seg, x)
    out.square().mean().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    got, want = grads(net), grads(twin)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)
    for (name, buf), (_, ref) in zip(net.named_buffers(), twin.named_buffers(), strict=True):
        torch.testing.assert_close(buf, ref, rtol=1e-6, atol=1e-7, msg=name)
    if training:
        assert int(net.layer4[1].bn2.num_batches_tracked) >= 1


class Skip(nn.Module):
    """A skip over every block (U-Net style), an int argument and an optional mask."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x, scale: int = 2, mask=None):
        first = self.stem(x)
        h = first
        for block in self.blocks:
            h = block(h)
        if mask is not None:
            h = h * mask
        return {"out": self.head(h + first) * scale, "width": x.shape[1]}


def test_skip_connections_constants_and_dict_outputs_cross_cuts():
    torch.manual_seed(0)
    model = Skip()
    x = torch.randn(4, 6)
    seg = segment_module(model, (x,), {"scale": 3})
    assert len(seg) == 5
    inputs = seg[2]._programs[True].inputs
    assert "linear" in inputs and "x" not in inputs  # the skip travels, the input does not
    got = run(seg, x[:3], scale=3)
    assert got["width"] == 6
    torch.testing.assert_close(got["out"], model(x[:3], scale=3)["out"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="baked into the traced graph"):
        seg.flatten_inputs(x, scale=4)


class SizeAfterCut(nn.Module):
    """A size read before the blocks and used after them, where no tensor crossing has it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        n = x.shape[1]
        h = x.mean(1)
        for block in self.blocks:
            h = block(h)
        return h.unsqueeze(1).expand(-1, n, -1) * 1.0


def test_a_symbolic_size_travels_as_a_tensor():
    model = SizeAfterCut()
    seg = segment_module(model, (torch.randn(3, 5, 4),))
    x = torch.randn(2, 7, 4)
    assert all(isinstance(v, torch.Tensor) for v in seg[0](seg.flatten_inputs(x)))
    torch.testing.assert_close(run(seg, x), model(x), rtol=0, atol=0)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        x = self.blocks[0](x)
        if x.sum() > 0:  # the line the error must point at
            x = x * 2
        return self.blocks[1](x)


class Reused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.blocks[0](x)  # block 0 again, after the cut before block 2


def test_uncuttable_models_get_an_error_that_says_what_and_where():
    x = torch.randn(3, 4)
    with pytest.raises(UncuttableModelError, match="data-dependent control flow") as err:
        segment_module(DataDependent(), (x,))
    assert "test_segments.py" in str(err.value) and "x.sum() > 0" in str(err.value)
    with pytest.raises(UncuttableModelError, match=r"'blocks\.0' is called more than once") as err:
        segment_module(Reused(), (x,))
    # the source lines of both calls: a cut that fails traces again with them (the first trace
    # keeps none, to save time)
    assert str(err.value).count('File "') == 2 and "graph node" not in str(err.value)
    with pytest.raises(UncuttableModelError, match=r"'blocks\.7' names no module"):
        segment_module(Reused(), (x,), split_points=["blocks.7"])


def test_shapes_the_trace_does_not_cover_are_refused(gpt_cut):
    _, seg = gpt_cut
    too_long = torch.randint(0, 37, (2, 17))  # beyond block_size: the traced slice would be wrong
    with pytest.raises(ValueError, match="cut for inputs of other shapes"):
        run(seg, too_long, targets=too_long)
    with pytest.raises(ValueError, match="cut for arguments shaped"):
        run(seg, too_long)  # cut with targets= given


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config), "transformer.wte.weight"


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config), "model.embed_tokens.weight"


def test_the_cache_is_switched_off_for_the_calls_only_and_advice_that_works_otherwise(monkeypatch):
    """A causal LM as it ships (``use_cache=True``) is traced and called without its cache, its
    config untouched; asked for the cache explicitly, the refusal's advice works; a model whose
    own forward fails is told so, and fixing what it names works. Neither refusal quotes a line
    of the trace, so neither is traced again (with fixed sizes, or with the graph's lines)."""
    transformers = pytest.importorskip("transformers")
    model, _ = _hf_gpt2()
    assert model.config.use_cache
    ids = torch.randint(0, 50, (4, 8))
    # test_hugging_face_models_reproduce_loss_and_gradients[gpt2]'s call: one trace for both
    call = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    seg = segment_module(model, (), call, eval_graph=False)
    assert seg.call_defaults == {"use_cache": False} and model.config.use_cache
    torch.manual_seed(5)  # its dropout draws the same masks in both
    want = model(**call).loss
    torch.manual_seed(5)
    torch.testing.assert_close(run(seg, **call).loss, want)
    exports = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real(*a, **k))
    with pytest.raises(UncuttableModelError, match="Leave use_cache out of the call"):
        segment_module(model, (), {"input_ids": ids, "use_cache": True})
    assert len(exports) == 1
    segment_module(model, (), {"input_ids": ids, "use_cache": False}, eval_graph=False)  # too

    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0
    )  # T5Config() names no decoder start token: T5 cannot compute a loss on one device either
    t5 = transformers.T5ForConditionalGeneration(config)
    exports.clear()
    with pytest.raises(UncuttableModelError, match="fails on the example batch on its own") as err:
        segment_module(t5, (), {"input_ids": ids, "labels": ids})
    assert len(exports) == 2  # dynamic, then fixed sizes: not again with the graph's lines
    assert "decoder_start_token_id" in str(err.value) and "cache" not in str(err.value)
    t5.config.decoder_start_token_id = 0  # as every T5 checkpoint's config sets it
    seg = segment_module(t5, (), {"input_ids": ids, "labels": ids}, eval_graph=False)
    assert seg.call_defaults == {"use_cache": False}  # no dropout: train mode is deterministic
    torch.testing.assert_close(run(seg, input_ids=ids, labels=ids).loss, t5(ids, labels=ids).loss)


class Keywords(nn.Module):
    """A wrapper of the user's own, every argument by keyword and handed on (as ``peft``'s
    ``PeftModel`` does too)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model(**kwargs)


@pytest.mark.parametrize(
    "call",
    [{}, {"use_cache": False, "output_hidden_states": False, "return_dict": True}],
    ids=["as-for-one-device", "keywords-in-the-call"],
)
def test_a_forward_taking_keywords_gets_the_cache_switch_and_a_dynamic_trace(call, recwarn):
    """Through a ``**kwargs`` forward the cache is switched off as for the bare model, and the
    trace lets the batch and the length vary, whatever keywords the call writes (torch 2.13
    refuses a ``**kwargs`` forward's dynamic trace; it was silently static before)."""
    pytest.importorskip("transformers")
    model, _ = _hf_gpt2()
    wrapped = Keywords(model)
    ids = torch.randint(0, 50, (4, 8))
    seg = segment_module(wrapped, (), {"input_ids": ids, "labels": ids, **call}, eval_graph=False)
    assert seg.call_defaults == ({} if call else {"use_cache": False})
    assert model.config.use_cache and "forward" not in vars(wrapped)  # both left as they were
    assert not [w for w in recwarn if "example batch's sizes only" in str(w.message)]
    for rows, length in ((4, 8), (2, 5), (3, 11)):  # another batch and length: one trace
        other = torch.randint(0, 50, (rows, length))
        torch.manual_seed(rows)  # the dropout draws the same masks in both
        got = run(seg, input_ids=other, labels=other, **call).loss
        torch.manual_seed(rows)
        torch.testing.assert_close(got, wrapped(input_ids=other, labels=other, **call).loss)


def test_a_model_traced_for_the_example_sizes_only_says_so():
    """Where no trace lets the batch vary, the fall-back to the example's sizes warns, naming
    what a user must then do, instead of refusing the second batch size silently later."""

    class FixedRows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.register_buffer("offset", torch.zeros(4, 4))  # one per row of a batch of 4

        def forward(self, x):
            x = x + self.offset  # the example's batch size written into the model
            for block in self.blocks:
                x = block(x)
            return x

    with pytest.warns(UserWarning, match="traced for the example batch's sizes only"):
        seg = segment_module(FixedRows(), (torch.randn(4, 4),))
    with pytest.raises(ValueError, match="inputs of other shapes"):
        run(seg, torch.randn(2, 4))


@pytest.mark.parametrize("halves", [False, True], ids=["blocks", "halves"])
@pytest.mark.parametrize("build", [_hf_gpt2, _hf_llama], ids=["gpt2", "llama"])
def test_hugging_face_models_reproduce_loss_and_gradients(build, halves):
    """At their blocks' cut, and with each block cut in two as well (the default where P does
    not divide the blocks): GPT-2 before its ``ln_2``; Llama, which registers its MLP before
    the norm that feeds it, before its ``mlp``, the norm's output crossing the cut."""
    torch.manual_seed(0)
    model, embedding = build()
    ids = torch.randint(0, 50, (4, 8))
    mask = torch.ones_like(ids)
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    cuts, inner = halved(model, default_cuts(model)) if halves else (None, None)
    seg = segment_module(model, (), kwargs, split_points=cuts, eval_graph=False)  # trains only
    assert len(seg) == 2 + 2 * (1 + halves) and ties(seg, model) == [(embedding, [0, len(seg) - 1])]
    if build is _hf_llama:
        inside = ["model.layers.0.mlp", "model.layers.1.mlp"] if halves else []
        assert sorted(c.module for c in seg.cuts) == sorted(
            ["model.layers.0", "model.layers.1", "model.layers.1", *inside]
        )
    if halves:
        assert inner == ("mlp" if build is _hf_llama else "ln_2")
    model.train()
    ids = torch.randint(0, 50, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: the mask crosses every cut
    torch.manual_seed(3)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    expected = grads(model)
    torch.manual_seed(3)
    got_out = run(seg, input_ids=ids, attention_mask=mask, labels=ids)
    got_out.loss.backward()
    assert type(got_out) is type(out)
    torch.testing.assert_close(got_out.logits, out.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_out.loss, out.loss, rtol=1e-6, atol=1e-6)
    got = grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


class Tracker(nn.Module):
    """A block that tracks its input's mean in a buffer, in place or by reassigning it."""

    def __init__(self, in_place: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))
        self.in_place = in_place

    def forward(self, x):
        if self.training and self.in_place:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        elif self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return self.lin(x) + self.mean


def test_buffers_updated_in_place_stay_the_users_and_reassigned_ones_are_refused():
    model = nn.Sequential(Tracker(), Tracker(), Tracker())
    seg = segment_module(model, (torch.randn(3, 4),))
    assert len(seg) == 3
    twin = copy.deepcopy(model)
    buffer = model[1].mean
    for x in (torch.randn(2, 4), torch.randn(5, 4)):
        torch.testing.assert_close(run(seg, x), twin(x), rtol=0, atol=0)
    assert model[1].mean is buffer and not torch.equal(buffer, torch.zeros(4))
    for i in range(3):
        torch.testing.assert_close(model[i].mean, twin[i].mean, rtol=0, atol=0)
    seg.eval(), twin.eval()
    x = torch.randn(2, 4)
    torch.testing.assert_close(run(seg, x), twin(x), rtol=0, atol=0)
    with pytest.raises(UncuttableModelError, match=r"assigns a new tensor to buffer 1\.mean"):
        segment_module(nn.Sequential(Tracker(), Tracker(in_place=False)), (torch.randn(3, 4),))
