"""Per-stage checkpoints (docs/checkpoints.md, "Per-stage checkpoints"): each process writes its
own stage's tensors, nothing gathered; a resume at the same P continues as the run drained at
the checkpoint, at another P each process reads only the tensors it now owns; the shards
consolidate into one ordinary Lightning checkpoint.

The runs are the checkpoint tests' (``support/resume_worker.py``): BatchNorm, dropout,
momentum, a shuffled resumable DataLoader, so buffers, random streams and the data order count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.distributed.checkpoint import FileSystemReader

from pipemare.lightning import shards
from support import resume_worker as worker
from support.launch import environment, ranks, run, run_all

SUPPORT = Path(__file__).resolve().parents[1] / "support"
WORKER = str(SUPPORT / "resume_worker.py")
STAGE_1 = ("net.4.", "net.6.")  # balance="even" over 7 layers at P = 2: layers 4-6


def _launch(out: Path, *args: str, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    """A run that ends well starts both ranks itself; one where a rank kills itself is started
    by Lightning's launcher, which ends the other rank when one dies."""
    cmd = [sys.executable, WORKER, "--out", str(out), "--devices", "2", "--stages", "2", *args]
    if expect_ok:
        run_all(ranks(cmd, 2), timeout=400)
        return subprocess.CompletedProcess(cmd, 0)
    return run(cmd, environment(), timeout=400)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _files_of(path: Path) -> dict[str, str]:
    """Each saved key -> the file it was written to (``__RANK_0.distcp``)."""
    found = FileSystemReader(path).read_metadata()
    return {index.fqn: info.relative_path for index, info in found.storage_data.items()}


@pytest.mark.distributed
def test_two_processes_write_their_own_shards_and_resume_equal_to_the_drained_run(tmp_path):
    """Killed at step 17, resumed from the shards of step 15 on two processes: equal to the run
    drained after step 15 (rel 1e-6), the data order included."""
    killed = _launch(
        tmp_path / "killed", "--every", "5", "--kill-at", "17", "--kill-rank", "1", "--sharded",
        expect_ok=False,
    )  # fmt: skip
    assert killed.returncode != 0
    ckpt = tmp_path / "killed" / "ckpt"
    names = sorted(p.name for p in ckpt.iterdir())  # no partial directory left behind
    assert names == ["last.ckpt", "step=10.ckpt", "step=15.ckpt", "step=5.ckpt"]
    assert all(shards.is_sharded(ckpt / n) for n in names)
    # each process wrote its own stage's tensors, rank 0 also what no stage holds
    files = _files_of(ckpt / "last.ckpt")
    weights = {k[len("state_dict.") :]: f for k, f in files.items() if k.startswith("state_dict.")}
    assert weights and all(
        f == ("__1_0.distcp" if k.startswith(STAGE_1) else "__0_0.distcp")
        for k, f in weights.items()
    ), weights
    momentum = {k: f for k, f in files.items() if k.startswith("optimizer_states.0.state.")}
    assert {f for f in momentum.values()} == {"__0_0.distcp", "__1_0.distcp"}
    meta = torch.load(ckpt / "last.ckpt" / shards.META, weights_only=False)
    assert meta["global_step"] == 15 and "state_dict" not in meta

    _launch(tmp_path / "resumed", "--resume", str(ckpt / "last.ckpt"))
    worker.run(tmp_path / "drained", stages=2, drain_at=15)
    resumed = _weights(tmp_path / "resumed" / "final.pt")
    assert _max_diff(resumed, _weights(tmp_path / "drained" / "final.pt")) < 1e-6
    seen = json.loads((tmp_path / "resumed" / "seen.json").read_text())
    ref = json.loads((tmp_path / "drained" / "seen.json").read_text())
    assert seen["first"] == 15 and seen["seen"] == ref["seen"][15:]


@pytest.mark.parametrize("schedule", ["pipemare", "gpipe"])
def test_resumed_from_shards_at_p4_continues_as_promised(schedule, tmp_path):
    """At P = 4 (one process) from the shards of step 15: pipemare equals the run drained
    there (rel 1e-6), gpipe, which drains every step, the run never stopped (rel 1e-5)."""
    run = {"stages": 4, "schedule": schedule, "sharded": True}
    worker.run(tmp_path / "whole", every=15, **run)
    ckpt = tmp_path / "whole" / "ckpt" / "step=15.ckpt"
    assert shards.is_sharded(ckpt)
    worker.run(tmp_path / "resumed", resume=ckpt, **run)
    resumed = _weights(tmp_path / "resumed" / "final.pt")
    if schedule == "gpipe":
        want, tolerance = _weights(tmp_path / "whole" / "final.pt"), 1e-5
    else:
        worker.run(tmp_path / "drained", drain_at=15, **run)
        want, tolerance = _weights(tmp_path / "drained" / "final.pt"), 1e-6
    scale = max(v.abs().max().item() for v in want.values())
    assert _max_diff(resumed, want) <= tolerance * scale


def _run_lean(out: Path, *args: str) -> None:
    cmd = [sys.executable, str(SUPPORT / "shard_worker.py"), "--out", str(out), *args]
    devices = int(args[args.index("--devices") + 1]) if "--devices" in args else 2  # its default
    run_all(ranks(cmd, devices) if devices > 1 else [(cmd, environment())], timeout=400)


@pytest.mark.distributed
def test_a_resume_at_another_p_reads_only_its_own_tensors_and_the_shards_consolidate(tmp_path):
    """A GPT built on the meta device (its head tied to the embedding), AdamW. Shards of P = 4
    (one process) consolidate into one file that ``load_from_checkpoint`` reads on one device,
    its validation loss the pipeline's (rel 1e-6). Resumed at P = 2 (two processes) from the
    shards, each process reads only the tensors of its new stage (the tied embedding included),
    and the run equals the one resumed from the consolidated file, which each process reads
    memory-mapped."""
    from pipemare.experiments.bench.lean import LeanGPT, byte_loaders
    from support import shard_worker

    four = tmp_path / "four"
    _run_lean(four, "--devices", "1", "--stages", "4", "--steps", "6", "--every", "6",
              "--sharded")  # fmt: skip
    ckpt = four / "ckpt" / "step=6.ckpt"
    assert shards.is_sharded(ckpt)
    whole = tmp_path / "whole.ckpt"
    done = run([sys.executable, "-m", "pipemare", "consolidate", str(ckpt), str(whole)],
               environment(), timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    final = _weights(four / "final.pt")
    assert _max_diff(torch.load(whole, weights_only=False)["state_dict"], final) < 1e-6
    one = LeanGPT.load_from_checkpoint(
        whole, map_location="cpu", width=shard_worker.WIDTH, blocks=shard_worker.BLOCKS,
        heads=2, build_in_init=True,
    )  # fmt: skip
    _, val = byte_loaders(context=8, batch=4, rows=4 * 12)
    plain = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    (metrics,) = plain.validate(one, val, verbose=False)
    pipelined = json.loads((four / "val_loss.json").read_text())
    assert metrics["val_loss"] == pytest.approx(pipelined, rel=1e-6)

    _run_lean(tmp_path / "from-shards", "--resume", str(ckpt), "--record-reads")
    _run_lean(tmp_path / "from-file", "--resume", str(whole))
    a = _weights(tmp_path / "from-shards" / "final.pt")
    assert _max_diff(a, _weights(tmp_path / "from-file" / "final.pt")) < 1e-6
    stage_of = {"gpt.0.": 0, "gpt.1.": 0, "gpt.2.": 1, "gpt.3.": 1}  # balance [2, 2]
    for rank in (0, 1):
        read = json.loads((tmp_path / "from-shards" / f"reads-rank{rank}.json").read_text())
        weights = [k[len("state_dict.") :] for k in read if k.startswith("state_dict.")]
        others = [k for k in weights if stage_of[k[:6]] != rank and k != "gpt.0.weight"]
        assert weights and not others, (rank, weights)
        mine = {k for k in final if stage_of[k[:6]] == rank} - {"gpt.3.lm_head.weight"}
        assert mine <= set(weights)
    assert "gpt.0.weight" in weights  # rank 1's head, tied to the embedding, read under its name


def test_nested_values_survive_the_shards(tmp_path):
    """DCP splits a list or dict into a key per item; an optimiser's list of tensors (LBFGS's
    ``old_dirs``) and a module's dict of extra state come back whole."""
    import torch.distributed.checkpoint as dcp

    nested = [torch.ones(2), torch.zeros(1)]
    extra = {"scale": 2.0, "table": torch.arange(3)}
    saved = {
        "state_dict": {"net.0.weight": torch.ones(2), "net._extra_state": shards.pack(extra)},
        "optimizer_states": {"0": {"state": {"3": {"old_dirs": shards.pack(nested)}}}},
    }
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    meta = {
        shards.FORMAT: {"version": 1, "order": ["net.0.weight", "net._extra_state"], "ties": []},
        "optimizer_states": [{"param_groups": []}],
    }
    torch.save(meta, tmp_path / shards.META)
    loaded = shards.ShardedCheckpoint(tmp_path).checkpoint()
    state = loaded["state_dict"].read(loaded["state_dict"])
    assert state["net._extra_state"]["scale"] == 2.0
    assert state["net._extra_state"]["table"].tolist() == [0, 1, 2]
    (field,) = loaded["optimizer_states"][0]["state"].read([3]).values()
    assert [t.tolist() for t in field["old_dirs"]] == [[1.0, 1.0], [0.0]]
