"""Fine-tuning as Hugging Face and ``peft`` users write it (support/lora.py): a GPT-2 or a
Llama loaded with ``from_pretrained`` from a local directory, given LoRA adapters by ``peft``
(or wrapped whole in a module of the user's own whose forward takes ``**kwargs``), its call
written as for one device, through every schedule:

- gpipe at P = 2 ends where one device does (held-out loss, rel 1e-4), and the frozen base
  is unchanged bit for bit;
- the default schedule and uncorrected ``async`` end within the zoo's 10% of one device
  after 40 steps;
- the adapter (or the fine-tuned model) saved with ``save_pretrained`` and loaded onto a fresh
  model on one device gives the same held-out loss;
- the run's memory report: optimiser state and correction buffers sized by the adapters;
- peft's prompt tuning, prefix tuning and IA3 likewise (gpipe, the default);
- with ``use_cache=False`` written in the call, at N = 1, 2 and 4 likewise;
- on two gloo processes (GPT-2 with LoRA and in the user's own wrapper): gpipe as one device,
  the default and ``async`` within 10%, the adapter (or model) saved by rank 0 after the run,
  and from a Lightning checkpoint written mid-run, loadable on one device."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from pipemare import PipeMareStrategy
from pipemare.experiments.studies.summary import memory_report
from pipemare.lightning import shards
from pipemare.lightning.shards import export_pretrained
from support.launch import ranks, run_all
from support.lora import MODELS, FineTune, load_saved, pretrain, task
from support.models import quiet_trainer
from support.real_runs import val_loss
from support.zoo import QUALITY_CUT

pytestmark = pytest.mark.zoo
peft = pytest.importorskip("peft")

EQUAL_STEPS, TRAIN_STEPS = 10, 40
WORKER = str(Path(__file__).resolve().parents[1] / "support" / "lora_worker.py")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """family -> the local directory its pretrained checkpoint was saved into."""
    root = tmp_path_factory.mktemp("pretrained")
    return {family: pretrain(family, root / family) for family in ("gpt2", "llama")}


def _val(module) -> float:
    return val_loss(module, task(n=64, seed=1))


def _fit(module, strategy, steps: int):
    trainer = quiet_trainer(strategy, max_steps=steps)
    trainer.fit(module, task())
    return trainer


def _frozen(module) -> dict:
    return {k: v.clone() for k, v in module.named_parameters() if not v.requires_grad}


def _assert_unchanged(before: dict, module) -> None:
    now = dict(module.named_parameters())
    for name, value in before.items():
        assert now[name].equal(value), name


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_schedule_fine_tunes_it_as_one_device_and_the_adapter_reloads(
    name, pretrained, tmp_path
):
    family, wrap = MODELS[name]
    base = FineTune(name, pretrained=str(pretrained[family]))
    start = _val(base)
    frozen = _frozen(base)
    if wrap == "peft":  # only the adapters train
        assert (
            0
            < sum(p.numel() for p in base.parameters() if p.requires_grad)
            < 0.2 * sum(p.numel() for p in base.parameters())
        )

    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    _fit(plain, "auto", EQUAL_STEPS)
    _fit(piped, PipeMareStrategy(stages=2, schedule="gpipe"), EQUAL_STEPS)
    assert _val(piped) == pytest.approx(_val(plain), rel=1e-4)
    _assert_unchanged(frozen, piped)

    one = copy.deepcopy(base)
    _fit(one, "auto", TRAIN_STEPS)
    want = _val(one)
    assert want < 0.85 * start, f"one device did not learn the task ({start:.3f} -> {want:.3f})"
    got = {}
    for schedule in ("pipemare", "async"):
        module = copy.deepcopy(base)
        strategy = PipeMareStrategy(stages=2, schedule=schedule, balance=QUALITY_CUT)
        trainer = _fit(module, strategy, TRAIN_STEPS)
        got[schedule] = _val(module)
        assert got[schedule] <= 1.1 * want, f"{name} {schedule}: {got[schedule]:.4f}, {want:.4f}"
        _assert_unchanged(frozen, module)
        if schedule == "pipemare":
            default, report = module, memory_report(trainer)["stages"]
    print(f"\n{name}: held-out loss {start:.3f} -> one device {want:.4f}, "
          f"pipemare {got['pipemare']:.4f}, async {got['async']:.4f}")  # fmt: skip

    # what the run holds is sized by what trains: AdamW's two moments (and a step count per
    # tensor) over the adapters; the corrections' buffers at most two per trained weight
    for stage in report:
        trained = stage["trainable_mb"]
        assert stage["optimizer_state_mb"] == pytest.approx(2 * trained, rel=0.01)
        assert stage["correction_buffers_mb"] <= 2 * trained + 1e-9
        if wrap == "peft":
            assert trained < 0.2 * stage["weights_mb"]

    default.save_pretrained(tmp_path / "saved")
    loaded = load_saved(name, pretrained[family], tmp_path / "saved")
    assert _val(loaded) == pytest.approx(got["pipemare"], rel=1e-5)


def test_lora_reads_its_base_a_stage_at_a_time_from_sharded_bf16_files(pretrained, tmp_path):
    """The pretrained Llama saved in bf16, in shards (``model.safetensors.index.json``): a LoRA
    fine-tune whose base is built from the config (other values) and read per stage from those
    files, upcast to fp32 under peft's renamed keys (``base_layer``), the adapters keeping
    peft's initialisation, runs gpipe at P = 2 as one device does from the same values."""
    import torch
    import transformers

    bf16 = transformers.AutoModelForCausalLM.from_pretrained(pretrained["llama"])
    bf16 = bf16.to(torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16", max_shard_size="8KB")
    assert len(json.loads((tmp_path / "bf16/model.safetensors.index.json").read_text())) > 0
    assert len(list((tmp_path / "bf16").glob("model-*.safetensors"))) > 1
    bf16.to(torch.float32).save_pretrained(tmp_path / "rounded")  # the same values in fp32

    plain = FineTune("lora-llama", pretrained=str(tmp_path / "rounded"))
    piped = FineTune("lora-llama")  # its base from the config: the file decides its values
    assert _val(piped) != pytest.approx(_val(plain), rel=1e-3)
    _fit(plain, "auto", EQUAL_STEPS)
    strategy = PipeMareStrategy(
        stages=2, schedule="gpipe", weights=str(tmp_path / "bf16"), save_distributed_checkpoint=True
    )
    trainer = _fit(piped, strategy, EQUAL_STEPS)
    assert _val(piped) == pytest.approx(_val(plain), rel=1e-4)
    # its checkpoint, per-stage shards, gives the adapter alone for PeftModel.from_pretrained
    trainer.save_checkpoint(tmp_path / "fine-tuned.ckpt")
    assert shards.is_sharded(tmp_path / "fine-tuned.ckpt")
    export_pretrained(tmp_path / "fine-tuned.ckpt", FineTune("lora-llama").model, tmp_path / "out")
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "out" / "model.safetensors").exists()
    loaded = load_saved("lora-llama", tmp_path / "rounded", tmp_path / "out")
    assert _val(loaded) == pytest.approx(_val(piped), rel=1e-6)


def test_a_fine_tuned_model_s_shards_export_to_from_pretrained(pretrained, tmp_path):
    """Every weight trained through the cut; the per-stage checkpoint's weights written by
    ``export_pretrained`` load with ``from_pretrained`` and validate as the pipeline's model."""
    piped = FineTune("own-gpt2", pretrained=str(pretrained["gpt2"]))
    strategy = PipeMareStrategy(stages=2, save_distributed_checkpoint=True)
    trainer = _fit(piped, strategy, 4)
    trainer.save_checkpoint(tmp_path / "fine-tuned.ckpt")
    fresh = FineTune("own-gpt2")
    export_pretrained(tmp_path / "fine-tuned.ckpt", fresh.model.model, tmp_path / "out")
    loaded = load_saved("own-gpt2", pretrained["gpt2"], tmp_path / "out")
    assert _val(loaded) == pytest.approx(_val(piped), rel=1e-6)


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_use_cache_false_in_the_call_keeps_the_trace_dynamic(microbatches, pretrained):
    """``use_cache=False`` (and other keywords) written into every call: each microbatch
    (a quarter of the batch at N = 4) runs through the traced model: gpipe as one device, the
    default schedule and ``async`` at the same N within 10% of it after 40 steps."""
    call = {"use_cache": False, "output_hidden_states": False, "return_dict": True}
    base = FineTune("lora-gpt2", call=call, pretrained=str(pretrained["gpt2"]))
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    _fit(plain, "auto", EQUAL_STEPS)
    gpipe = PipeMareStrategy(stages=2, microbatches=microbatches, schedule="gpipe")
    _fit(piped, gpipe, EQUAL_STEPS)
    assert _val(piped) == pytest.approx(_val(plain), rel=1e-4)
    one = copy.deepcopy(base)
    _fit(one, "auto", TRAIN_STEPS)
    want = _val(one)
    for schedule in ("pipemare", "async"):
        module = copy.deepcopy(base)
        strategy = PipeMareStrategy(
            stages=2, microbatches=microbatches, schedule=schedule, balance=QUALITY_CUT
        )
        _fit(module, strategy, TRAIN_STEPS)
        got = _val(module)
        print(f"\nuse_cache=False, N={microbatches}, {schedule}: {got:.4f} (one device {want:.4f})")
        assert got <= 1.1 * want, f"N={microbatches} {schedule}: {got:.4f} against {want:.4f}"


@pytest.mark.parametrize("kind", ["prompt", "prefix", "ia3"])
def test_peft_s_other_methods_train_through_the_cut(kind, pretrained):
    """Prompt tuning (virtual tokens prepended to the embeddings), prefix tuning (virtual keys
    and values handed to every attention layer) and IA3 (learned rescaling) on GPT-2, the
    call as for one device: gpipe ends as one device, the default within 10% of it."""
    from support.lora import base_model, other_adapter

    base = FineTune("lora-gpt2", pretrained=str(pretrained["gpt2"]))
    base.model = other_adapter(kind, base_model("gpt2", pretrained["gpt2"]))
    start = _val(base)
    plain, piped = copy.deepcopy(base), copy.deepcopy(base)
    _fit(plain, "auto", EQUAL_STEPS)
    _fit(piped, PipeMareStrategy(stages=2, schedule="gpipe"), EQUAL_STEPS)
    assert _val(piped) == pytest.approx(_val(plain), rel=1e-4)
    one, default = copy.deepcopy(base), copy.deepcopy(base)
    _fit(one, "auto", TRAIN_STEPS)
    _fit(default, PipeMareStrategy(stages=2, balance=QUALITY_CUT), TRAIN_STEPS)
    want, got = _val(one), _val(default)
    print(f"\npeft {kind}: {start:.3f} -> one device {want:.4f}, pipemare {got:.4f}")
    assert want < start and got <= 1.1 * want


#: the models of the two-process launch: peft's LoRA and the user's own wrapper (every weight
#: trained, the whole model saved). LoRA on a Llama would repeat LoRA on GPT-2's run (the same
#: adapters, checkpoint and save across the two processes); it is fine-tuned through every
#: schedule by test_every_schedule_fine_tunes_it_as_one_device_and_the_adapter_reloads and
#: read per stage by test_lora_reads_its_base_a_stage_at_a_time_from_sharded_bf16_files, and a
#: Llama trains on two processes in test_strategy_real_models.py.
TWO_PROCESS_MODELS = ["lora-gpt2", "own-gpt2"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, pretrained):
    """One launch of support/lora_worker.py on two gloo processes: each of TWO_PROCESS_MODELS
    through gpipe (Lightning's checkpoint written halfway) and the default (its adapter saved
    after the run)."""
    out = tmp_path_factory.mktemp("lora-two")
    dirs = [f"{family}={path}" for family, path in pretrained.items()]
    cmd = [sys.executable, WORKER, "--out", str(out), "--pretrained", *dirs,
           "--models", *TWO_PROCESS_MODELS,
           "--equal-steps", str(EQUAL_STEPS), "--train-steps", str(TRAIN_STEPS)]  # fmt: skip
    run_all(ranks(cmd, 2))
    return out


# the tests reading the one launch run on one worker (CI's zoo step: --dist loadgroup)
TWO_PROCESSES = pytest.mark.xdist_group("lora_two_processes")


@pytest.mark.distributed
@TWO_PROCESSES
@pytest.mark.parametrize("name", TWO_PROCESS_MODELS)
def test_two_gloo_processes_fine_tune_it_and_save_what_one_device_loads(
    name, pretrained, two_process_runs
):
    family, _ = MODELS[name]
    out = two_process_runs / name
    reports = [json.loads((out / f"report-{rank}.json").read_text()) for rank in (0, 1)]
    base = FineTune(name, pretrained=str(pretrained[family]))

    plain = copy.deepcopy(base)
    _fit(plain, "auto", EQUAL_STEPS)
    for report in reports:
        assert report["gpipe"]["val_loss"] == pytest.approx(_val(plain), rel=1e-4)
        assert (report["pipemare"]["schedule"], report["pipemare"]["microbatches"]) == (
            "pipemare",
            2,
        )
    one = copy.deepcopy(base)
    _fit(one, "auto", TRAIN_STEPS)
    want = _val(one)
    for schedule in ("pipemare", "async"):
        got = reports[0][schedule]["val_loss"]
        assert all(r[schedule]["val_loss"] == pytest.approx(got, rel=1e-6) for r in reports)
        assert got <= 1.1 * want, f"{name} {schedule}: two processes {got:.4f}, one {want:.4f}"
    pm, asy = (reports[0][s]["val_loss"] for s in ("pipemare", "async"))
    print(f"\n{name}, two processes: one device {want:.4f}, pipemare {pm:.4f}, async {asy:.4f}")
    got = reports[0]["pipemare"]["val_loss"]

    # saved by rank 0 after the run, loaded on one device
    loaded = load_saved(name, pretrained[family], out / "saved")
    assert _val(loaded) == pytest.approx(got, rel=1e-5)
    # the checkpoint Lightning's ModelCheckpoint wrote halfway through the gpipe run: what one
    # device has after as many steps; saved the Hugging Face way, it loads on one device
    half = EQUAL_STEPS // 2
    ckpt = FineTune.load_from_checkpoint(out / "checkpoints" / f"step={half}.ckpt")
    early = copy.deepcopy(base)
    _fit(early, "auto", half)
    assert _val(ckpt) == pytest.approx(_val(early), rel=1e-4)
    ckpt.save_pretrained(out / "from-checkpoint")
    again = load_saved(name, pretrained[family], out / "from-checkpoint")
    assert _val(again) == pytest.approx(_val(ckpt), rel=1e-5)


def test_hugging_face_gradient_checkpointing_is_honoured_per_stage(pretrained):
    """``model.gradient_checkpointing_enable()``, as fine-tuning recipes call it: its
    per-layer checkpoints do not survive the trace, so the run recomputes per stage instead
    (``recompute=True``), says so among its decisions, computes what one device computes with
    the checkpoints on, and keeps less for the backward than without them."""
    base = FineTune("own-gpt2", pretrained=str(pretrained["gpt2"]))
    checkpointed = copy.deepcopy(base)
    checkpointed.model.model.gradient_checkpointing_enable()
    plain = copy.deepcopy(checkpointed)
    _fit(plain, "auto", EQUAL_STEPS)
    gpipe = copy.deepcopy(checkpointed)
    _fit(gpipe, PipeMareStrategy(stages=2, schedule="gpipe"), EQUAL_STEPS)
    assert _val(gpipe) == pytest.approx(_val(plain), rel=1e-4)

    saved = {}
    for label, module in (("off", copy.deepcopy(base)), ("on", copy.deepcopy(checkpointed))):
        strategy = PipeMareStrategy(stages=2, measure_activations=True)
        _fit(module, strategy, EQUAL_STEPS)
        assert strategy.recompute == (label == "on")
        said = [d for d in strategy.settings.decisions if d.subject == "recompute"]
        assert len(said) == (label == "on")
        saved[label] = strategy.pipeline.stages[0].peak_saved_bytes
    assert 0 < saved["on"] < saved["off"]


@pytest.mark.distributed
@TWO_PROCESSES
def test_the_docs_fine_tuning_example_runs_on_two_processes(pretrained, two_process_runs):
    """docs/your-model.md's example, run as written by the launch above (40 steps from the
    pretrained GPT-2): its adapter, saved by rank 0, loads on one device onto the same base
    and has learned the task."""
    from support.lora import base_model

    saved = two_process_runs / "doc-example" / "adapter"
    module = FineTune("lora-gpt2", pretrained=str(pretrained["gpt2"]))
    start = _val(module)
    module.model = peft.PeftModel.from_pretrained(base_model("gpt2", pretrained["gpt2"]), saved)
    assert _val(module) < 0.95 * start
