"""Tensor and pipeline parallelism on the deepspeed backend (issue 11): AutoTP and
``PipelineModule``, the real trainer.

Real ``torchrun`` on gloo (CPU), the render stage and the worker, test_ddp's tokenized data and
tiny Llama (2 layers, 4 heads). All runs start together so that their start-up costs overlap
(DeepSpeed's start-up is slow and erratic under load):

- ``dsdp``: pure data parallelism with ZeRO-1, 2 processes × micro 4 × accumulation 2 (global
  batch 16);
- ``autotp``: ``train.tp: 2`` (AutoTP) on 2 processes, micro 8 × accumulation 2: the same
  global batch, so the same sequences per step (both TP ranks read the whole batch);
- ``dspp``: ``train.pp: 2`` (a ``PipelineModule`` of 2 stages), micro 8 × accumulation 2 (the
  step's micro batches flow through the pipeline): the same again;
- ``dsppstop``: the ``dspp`` run stopped by a STOP file after a few steps (per-layer and
  per-stage checkpoint files) and resumed on the same layout: the uninterrupted run's losses.

Gradient clipping at 0.3 acts (DeepSpeed's own default of 1.0 would act differently: the
rendered ``gradient_clipping`` is train.grad_clip). Losses equal the DP run's within 1e-3
relative (AdamW magnifies the changed reduction order); each checkpoint consolidates into a
directory whose ``from_pretrained`` model gives the engine's probe logits.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import consolidated_probe
from tests.test_ddp import BASE, STEPS, data_dir, losses, max_rel, metrics, torchrun  # noqa: F401
from tests.test_resume import run_cli
from tests.test_tp import consumed

pytestmark = pytest.mark.slow

TRAIN = {**BASE["train"], "backend": "deepspeed", "zero_stage": 1, "grad_clip": 0.3,
         "record_samples": True}
PP = {"train": {"pp": 2, "micro_batch_size": 8}}
RUNS = {
    "dsdp": {},
    "autotp": {"train": {"tp": 2, "micro_batch_size": 8}},
    "dspp": PP,
    "dsppstop": PP,
}
NPROC = dict.fromkeys(RUNS, 2)
#: Stopped after a few steps, then resumed on the same layout.
STOPPED = ("dsppstop",)
#: DeepSpeed's start-up took up to ~5 minutes on a loaded 2-core machine.
TIMEOUT = 900


@pytest.fixture(scope="module")
def runs(data_dir) -> dict[str, Path]:  # noqa: F811
    work = data_dir.parent
    cfg = {**BASE, "train": TRAIN, "runs": RUNS}
    (work / "ds-parallel.yaml").write_text(yaml.safe_dump(cfg))
    dirs = {name: work / "ds-parallel" / name for name in RUNS}
    for name, run_dir in dirs.items():
        run_cli("pipeline.render", "--config", str(work / "ds-parallel.yaml"), "--run", name,
                "--out", str(run_dir), "--data-manifest", str(data_dir / "manifest.json"))
    t0 = time.perf_counter()
    procs = {name: torchrun(dirs[name], data_dir, NPROC[name]) for name in RUNS}
    for name in STOPPED:
        stop = dirs[name]
        while (not (stop / "metrics.jsonl").exists()
               or len((stop / "metrics.jsonl").read_text().splitlines()) < 3):
            if procs[name].poll() is not None or time.perf_counter() - t0 > TIMEOUT:
                break
            time.sleep(0.005)
        (stop / "STOP").touch()  # the ranks agree on a step, save a checkpoint and exit 75
    errors = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=TIMEOUT)
        if (proc.returncode != 0) != (name in STOPPED):
            errors[name] = (proc.returncode, err[-3000:])
    assert not errors, errors
    for name in STOPPED:
        stop = dirs[name]
        stopped = json.loads((stop / "stopped.json").read_text())["step"]
        assert 3 <= stopped < STEPS
        (stop / "STOP").unlink()
        proc = torchrun(stop, data_dir, NPROC[name])
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err[-3000:]
    return dirs


@pytest.mark.parametrize("name", ["autotp", "dspp"])
def test_losses_equal_pure_dp_with_the_same_global_batch(runs, name):
    dp = losses(runs["dsdp"])
    assert all(math.isfinite(x) for x in dp) and dp[-1] < dp[0]
    assert max_rel(losses(runs[name]), dp) < 1e-3
    # The clipped gradient norm is the global one (over TP shards, over pipeline stages).
    norms = [r["grad_norm"] for r in metrics(runs[name]).values()]
    ref = [r["grad_norm"] for r in metrics(runs["dsdp"]).values()]
    assert max_rel(norms, ref) < 1e-2
    assert ref[0] > TRAIN["grad_clip"]  # clipping really acted
    # The same sequences every step as the pure-DP run; both TP ranks (both stages) read the
    # same batch.
    assert consumed(runs[name], 2, 2) == consumed(runs["dsdp"], 2, 1)
    manifest = json.loads(
        (runs[name] / "checkpoints" / "step-000010" / "manifest.json").read_text())
    assert manifest["backend"] == "deepspeed" and manifest["world_size"] == 2


def test_stopped_pipeline_run_resumes_with_the_uninterrupted_losses(runs):
    ref, got = metrics(runs["dspp"]), metrics(runs["dsppstop"])
    assert list(got) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "lr", "grad_norm"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-6), (step, key)
    assert {r["attempt"] for r in got.values()} == {1, 2}
    assert consumed(runs["dsppstop"], 2, 2) == consumed(runs["dspp"], 2, 2)


@pytest.mark.parametrize("name", ["dsdp", "autotp", "dspp"])
def test_checkpoint_consolidates_to_the_engine_logits(runs, data_dir, name):  # noqa: F811
    model, logits, probe = consolidated_probe(runs[name], data_dir,
                                              data_dir.parent / f"hf-{name}")
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (32, 32)
    assert torch.allclose(logits, probe["logits"], rtol=1e-4, atol=1e-5), (
        (logits - probe["logits"]).abs().max())
