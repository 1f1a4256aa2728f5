"""Hugging Face architectures as their users build them (tests/support/zoo.py: one family per
modelling file, only sizes and dropout changed, the key/value cache on as the configs ship it),
through the strategy with nothing else said:

- gpipe at P = 2 computes what one device computes: the same held-out loss after 10 steps
  (N = 1 where the model has BatchNorm, which normalises over what it is given);
- the default schedule (``pipemare``, N = P) trains each on a learnable task: after 80 steps its
  held-out loss is within 10% of one device's, both well below where they started. Its cut is
  the even one (support.zoo.QUALITY_CUT): the default cut follows each layer's measured time,
  which moves with the machine's load, and after a short run the default's quality moves with
  the cut (ViT of four blocks, 40 steps: 0.617 at [3, 3], 0.912 at [2, 4], the cut a busy CI
  machine once chose; one device 0.653);
- an encoder–decoder (T5) on two gloo processes, a stage each, ends with one device's
  held-out loss, as does a Gemma read from its sharded files a stage at a time.

Each model's tracing and cutting time is printed in the test report (``-rA``; CI's own step);
the default's run, on a copy of the same model, reuses the gpipe run's cut."""

from __future__ import annotations

import copy
import json
import time

import pytest
import pytorch_lightning as pl
import torch

from pipemare import PipeMareStrategy
from pipemare.model.traces import TRACES
from support.models import quiet_trainer
from support.real_runs import (
    launch_two_processes,
    two_process_workflow,
    two_processes_equal_one_device,
    val_loss,
    workflow_reports,
)
from support.zoo import (
    BIG_GEMMA,
    FAMILIES,
    QUALITY_CUT,
    GPT2Module,
    MetaZoo,
    ZooModule,
    data,
    has_batchnorm,
)

pytestmark = pytest.mark.zoo

#: steps of the gpipe comparison and of the default schedule's training (the tasks' loss is
#: near its floor by 80: two runs compare there, not on their way down; at 40, BERT of two
#: blocks was still falling, one device 0.349 -> 0.311 at 80, the default +17% -> +4%)
EQUAL_STEPS, TRAIN_STEPS = 10, 80


def _val(module: pl.LightningModule) -> float:
    return val_loss(module, data(module.kind, n=64, seed=1))


def _fit(module: pl.LightningModule, strategy, steps: int) -> PipeMareStrategy | None:
    trainer = quiet_trainer(strategy, max_steps=steps)
    trainer.fit(module, data(module.kind))
    return strategy if isinstance(strategy, PipeMareStrategy) else None


def _cut_seconds(strategy: PipeMareStrategy) -> float:
    adapter = strategy._runner.adapter
    assert adapter is not None and adapter.cut_seconds is not None
    return adapter.cut_seconds


#: the zoo's model whose stages pass on more than one tensor (the encoder's output beside the
#: decoder's states). The decoder-only models on two processes are the Gemma below, the GPT-2
#: of test_gpt2_from_its_config_defaults_through_the_strategy_by_name and test_padding.py, and
#: the GPT-2 and Llama of test_strategy_real_models.py; a mixture of experts (Mixtral) at P = 2
#: is test_gpipe_equals_one_device_and_the_default_trains_it[mixtral]: its routing stays
#: inside a stage, so two processes would repeat what a Llama's run checks.
TWO_PROCESS_MODELS = ["zoo-t5"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """One two-process launch that trains the models in turn (one start of the processes and
    their imports, not one per model), first a Gemma read a stage at a time from the sharded
    files saved here; each test checks its own model's results."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("zoo-two-processes")
    torch.manual_seed(0)
    BIG_GEMMA().save_pretrained(out / "big-gemma", max_shard_size="60MB")  # 3+ shards
    launch_two_processes(TWO_PROCESS_MODELS, out, "--stages-from", str(out / "big-gemma"))
    return out


@pytest.mark.distributed
@pytest.mark.xdist_group("zoo_two_processes")  # the tests sharing the launch: one worker
@pytest.mark.parametrize("model", TWO_PROCESS_MODELS)
def test_two_gloo_processes_train_zoo_models_as_one_device(model, two_process_runs):
    two_processes_equal_one_device(model, two_process_runs, weights=False)


@pytest.mark.distributed
@pytest.mark.xdist_group("zoo_two_processes")
def test_two_processes_read_a_saved_model_a_stage_at_a_time(two_process_runs):
    """A 45M-parameter Gemma (head tied to the embedding) saved with save_pretrained in
    shards, built in configure_model on the meta device by two gloo processes, cut right after
    the embedding (split_points), each stage read from the shards: gpipe ends with one
    device's held-out loss (rel 1e-4), and rank 0, holding the embedding alone, grows by less
    than the whole file's size."""
    saved = two_process_runs / "big-gemma"
    size_mb = sum(f.stat().st_size for f in saved.glob("model-*.safetensors")) / 2**20
    assert len(list(saved.glob("model-*.safetensors"))) >= 3 and size_mb > 150
    import transformers

    one = MetaZoo("big-gemma")
    one.model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    quiet_trainer("auto", max_steps=4).fit(one, data("causal", n=32))
    want = val_loss(one, data("causal", n=32))
    ranks = [
        json.loads((two_process_runs / "big-gemma-stages" / f"report-{r}.json").read_text())
        for r in (0, 1)
    ]
    for report in ranks:
        assert report["val_loss"] == pytest.approx(want, rel=1e-4)
    assert ranks[0]["held_mb"] < 1 and ranks[1]["held_mb"] > 0.99 * size_mb
    assert ranks[0]["growth_mb"] < size_mb, (ranks[0], size_mb)


@pytest.mark.distributed
def test_gpt2_from_its_config_defaults_through_the_strategy_by_name(tmp_path):
    """``GPT2Config()`` with only its sizes shrunk, ``Trainer(strategy=<name>, devices=2)``
    and nothing else: ``pipemare_gpipe`` ends as one device (dropout off, as masks differ);
    ``pipemare`` (dropout on, as the config ships) trains it as the default layout, N = P = 2,
    within the zoo's 10% of one device's held-out loss. Issue 40's bar is 2%: this seed
    reads +6.5% after 120 steps at AdamW 1e-2 (printed), eight seeds +7.9% (docs/results.md:
    dropout makes one seed's figure vary by about 4%), so that bar is missed and reported."""
    pytest.importorskip("transformers")
    steps = 120  # the length issue 40 measured (at 240, -1.2%: the gap closes with length)
    gpipe = ["--strategy", "pipemare_gpipe", "--no-dropout", "--steps", str(EQUAL_STEPS)]
    # one launch: gpipe, then a second Trainer in the same processes through "pipemare"
    then = ["--then-default-steps", str(steps)]
    reports = two_process_workflow(tmp_path, "--task", "gpt2", *gpipe, *then)
    plain = GPT2Module(dropout=False)
    quiet_trainer("auto", max_steps=EQUAL_STEPS).fit(plain, data("causal", n=8 * EQUAL_STEPS))
    want = val_loss(plain, data("causal", n=64, seed=1))
    for report in reports:
        assert report["val_loss"] == pytest.approx(want, rel=1e-4)
        assert report["schedule"] == "gpipe" and report["global_step"] == EQUAL_STEPS

    reports = workflow_reports(tmp_path / "default")
    one = GPT2Module()
    quiet_trainer("auto", max_steps=steps).fit(one, data("causal", n=8 * steps))
    want = val_loss(one, data("causal", n=64, seed=1))
    got = reports[0]["val_loss"]
    print(f"\ngpt2 defaults, 2 processes: pipemare {got:.4f}, one device {want:.4f} "
          f"({got / want - 1:+.2%})")  # fmt: skip
    for report in reports:
        assert (report["schedule"], report["microbatches"], report["stages"]) == ("pipemare", 2, 2)
        assert report["val_loss"] == pytest.approx(got, rel=1e-6)  # one result, every rank
    assert got <= 1.1 * want


def test_a_zoo_model_built_on_meta_equals_one_device_from_its_weights_read_per_stage(tmp_path):
    """Gemma (rotary attention, its head tied to the embedding) built in configure_model on
    the meta device, traced there and cut by parameter counts: gpipe at P = 4, each stage's
    tensors read from one device's save_pretrained file (its tied head left out), ends with one
    device's held-out loss (rel 1e-4); left
    to the model's own init_weights(), the default at P = 2 trains as one device does."""
    pytest.importorskip("transformers")
    from safetensors import safe_open

    base = ZooModule("gemma")
    base.model.save_pretrained(tmp_path / "gemma")  # the tied head is left out of the file
    file = tmp_path / "gemma" / "model.safetensors"
    assert "lm_head.weight" not in set(safe_open(file, framework="pt").keys())
    plain = copy.deepcopy(base)
    _fit(plain, "auto", EQUAL_STEPS)
    lean = MetaZoo("gemma")
    strategy = PipeMareStrategy(stages=4, microbatches=2, schedule="gpipe", weights=str(file))
    _fit(lean, strategy, EQUAL_STEPS)
    decisions = {d.subject: d for d in strategy.settings.decisions}
    assert "read from the weights file" in decisions["build"].reason
    assert "parameter counts" in decisions["layers per stage"].reason
    assert strategy.pipeline is not None and strategy.pipeline.num_stages == 4
    assert _val(lean) == pytest.approx(_val(plain), rel=1e-4)

    one, initialised = copy.deepcopy(base), MetaZoo("gemma")
    _fit(one, "auto", TRAIN_STEPS)
    default = PipeMareStrategy(stages=2)
    torch.manual_seed(0)  # init_weights() draws at the first batch: the same draws in any order
    _fit(initialised, default, TRAIN_STEPS)
    assert "init_weights()" in {d.subject: d for d in default.settings.decisions}["build"].reason
    want, got = _val(one), _val(initialised)
    assert want < 0.8 * _val(base) and got <= 1.1 * want, (got, want)


# last in the file: CI's two workers (--dist loadgroup) take tests in the file's order after
# the shared launches, so that the many short family tests, not a long one, end the step
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gpipe_equals_one_device_and_the_default_trains_it(family, record_property):
    pytest.importorskip("transformers")
    base = ZooModule(family)
    start = _val(base)
    n = 1 if has_batchnorm(base.model) else 2

    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    _fit(plain, "auto", EQUAL_STEPS)
    TRACES.clear()  # this family's first cut traces it (its time is printed)
    gpipe = PipeMareStrategy(stages=2, microbatches=n, schedule="gpipe")
    began = time.perf_counter()
    _fit(piped, gpipe, EQUAL_STEPS)
    gpipe_seconds = time.perf_counter() - began
    assert _val(piped) == pytest.approx(_val(plain), rel=1e-4)
    # the user's config keeps its cache setting; only the pipelined calls switch it off
    config = getattr(piped.model, "config", None)
    assert getattr(config, "use_cache", None) == getattr(base.model.config, "use_cache", None)

    one, default = copy.deepcopy(base), copy.deepcopy(base)
    _fit(one, "auto", TRAIN_STEPS)
    strategy = PipeMareStrategy(stages=2, balance=QUALITY_CUT)
    _fit(default, strategy, TRAIN_STEPS)
    assert strategy.schedule == "pipemare" and strategy.microbatches == 2
    assert (TRACES.misses, TRACES.hits) == (1, 1)  # a copy of the same model: cut once
    want, got = _val(one), _val(default)
    assert want < 0.8 * start, f"one device did not learn the task ({start:.3f} -> {want:.3f})"
    assert got <= 1.1 * want, f"{family}: pipemare {got:.4f} against one device {want:.4f}"

    cut = _cut_seconds(gpipe)
    record_property("cut_seconds", round(cut, 2))
    print(
        f"\nzoo {family}: cut {cut:.1f} s (gpipe run {gpipe_seconds:.1f} s), again "
        f"{_cut_seconds(strategy):.2f} s (reused); held-out loss "
        f"{start:.3f} -> one device {want:.4f}, pipemare P=2 N=2 {got:.4f} "
        f"({got / want - 1:+.1%})"
    )
