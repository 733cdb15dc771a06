"""The ddp engine (issue 11, the guide's first row): DistributedDataParallel with native AMP.

Real ``torchrun`` with 2 CPU processes on gloo (one run with 1 process), the real trainer, a
tiny Llama on test_resume's tokenized data (the same data config, built the same way). All first
runs start together so that their start-up costs overlap:

- ``fsdp`` / ``ddp``: fp32 with the same global batch, gradient clipping off: equal losses
  within 1e-5 relative (AdamW; pure data parallelism changes only the reduction order);
- ``ddp1``: one process, 4 × the accumulation (same global batch) and activation checkpointing
  on every decoder layer: the same losses again;
- ``bf16``: autocast bf16 (fp32 master weights) within bf16 tolerance of fp32, and not equal;
- ``fp16``: autocast fp16 + GradScaler with a loss scale so high that the first steps
  overflow: those steps are skipped and counted in metrics.jsonl, then the loss falls;
- ``fp16stop``: the same run stopped after a few steps (STOP file: a checkpoint with the
  scaler's state) and resumed: the uninterrupted run's losses, scales and skip counts, bit
  for bit;
- the ``ddp`` checkpoint consolidates (the DCP reader, unchanged) into a directory whose
  ``from_pretrained`` model gives the engine's probe logits exactly.

The planner, render and config checks for ddp (no processes) close the file.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import PY, consolidated_probe, subprocess_env
from tests.test_resume import CONFIG as RESUME_CONFIG
from tests.test_resume import run_cli, tokenize_for_tests

STEPS = 10
BASE = {
    "data": RESUME_CONFIG["data"],
    "model": RESUME_CONFIG["model"],
    "cluster": {"nodes": 1, "gpus_per_node": 2},
    "train": {"micro_batch_size": 4, "grad_accum": 2, "max_steps": STEPS, "warmup_steps": 2,
              "checkpoint_every": 5, "keep_last": 2, "grad_clip": 0.0},
}
# Gradients of this model overflow fp16 above a loss scale of about 2^20: the first steps, and
# the first step after each growth of the scale, are skipped.
FP16 = {"backend": "ddp", "precision": "fp16", "loss_scale_init": 2.0**22,
        "loss_scale_growth_interval": 4}
RUNS = {
    "fsdp": {},
    "ddp": {"train": {"backend": "ddp"}},
    "ddp1": {"cluster": {"gpus_per_node": 1},
             "train": {"backend": "ddp", "grad_accum": 4, "activation_checkpointing": True}},
    "bf16": {"train": {"backend": "ddp", "precision": "bf16"}},
    "fp16": {"train": FP16},
    "fp16stop": {"train": FP16},
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """test_resume's tokenized data (same sources, tokenizer and shards), built once here."""
    return tokenize_for_tests(tmp_path_factory.mktemp("ddp-data"), RESUME_CONFIG)


def torchrun(run_dir: Path, data_dir: Path, nproc: int) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "pipeline.train", "worker", "--run-dir", str(run_dir), "--data-dir", str(data_dir)],
        env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def metrics(run_dir: Path) -> dict[int, dict]:
    """Step → its metrics record (a resumed run repeats steps: the last record wins)."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return dict(sorted(out.items()))


def losses(run_dir: Path) -> list[float]:
    return [rec["loss"] for rec in metrics(run_dir).values()]


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS, (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def train_together(data_dir: Path, cfg: dict, folder: str, nproc: dict[str, int],
                   stopped: tuple[str, ...] = (), timeout: int = 600) -> dict[str, Path]:
    """Render every run of ``cfg`` into ``<work>/<folder>/<run>`` and train them all at once
    under torchrun (their start-ups overlap on the 2 cores). Each run in ``stopped`` gets a STOP
    file once it has logged 3 steps: its ranks agree on a step, save and exit 75 (torchrun
    reports that as a failure), and the STOP file is removed again. Asserts every run ended so;
    returns the run directories."""
    work = data_dir.parent
    config = work / f"{folder}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    dirs = {name: work / folder / name for name in cfg["runs"]}
    for name, run_dir in dirs.items():
        run_cli("pipeline.render", "--config", str(config), "--run", name, "--out", str(run_dir),
                "--data-manifest", str(data_dir / "manifest.json"))
    procs = {name: torchrun(dirs[name], data_dir, nproc[name]) for name in dirs}
    deadline = time.monotonic() + timeout
    for name in stopped:
        metrics_file = dirs[name] / "metrics.jsonl"
        while (not metrics_file.exists() or len(metrics_file.read_text().splitlines()) < 3):
            if procs[name].poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        (dirs[name] / "STOP").touch()
    errors = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=timeout)
        if (proc.returncode != 0) != (name in stopped):
            errors[name] = (proc.returncode, err[-3000:])
    assert not errors, errors
    for name in stopped:
        assert 3 <= json.loads((dirs[name] / "stopped.json").read_text())["step"] < STEPS
        (dirs[name] / "STOP").unlink()
    return dirs


def resume(run_dir: Path, data_dir: Path, nproc: int, timeout: int = 600) -> None:
    """Train a stopped run to the end (asserting it finishes)."""
    proc = torchrun(run_dir, data_dir, nproc)
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def runs(data_dir) -> dict[str, Path]:
    """Every run rendered by the render stage and trained by the worker under torchrun; the
    ``fp16stop`` run is stopped after 3+ steps, then resumed to the end."""
    nproc = {name: (RUNS[name].get("cluster") or {}).get("gpus_per_node", 2) for name in RUNS}
    dirs = train_together(data_dir, {**BASE, "runs": RUNS}, "runs", nproc, ("fp16stop",))
    resume(dirs["fp16stop"], data_dir, 2)
    return dirs


@pytest.mark.slow
def test_ddp_fp32_equals_fsdp_with_the_same_global_batch(runs):
    fsdp = losses(runs["fsdp"])
    assert all(math.isfinite(x) for x in fsdp) and fsdp[-1] < fsdp[0]
    assert max_rel(losses(runs["ddp"]), fsdp) < 1e-5
    # One process with 4 micro batches per step (DDP over a group of one), each decoder layer
    # recomputed in backward: still the same experiment.
    assert max_rel(losses(runs["ddp1"]), fsdp) < 1e-5
    manifest = json.loads(
        (runs["ddp"] / "checkpoints" / "step-000010" / "manifest.json").read_text())
    assert manifest["backend"] == "ddp" and manifest["world_size"] == 2
    assert not (runs["ddp"] / "ds_config.json").exists()
    assert not (runs["ddp"] / "fsdp.json").exists()
    assert "DDP" in (runs["ddp"] / "plan.md").read_text()


@pytest.mark.slow
def test_bf16_autocast_matches_fp32_within_bf16_tolerance(runs):
    fp32, bf16 = losses(runs["ddp"]), losses(runs["bf16"])
    assert bf16 != fp32  # autocast really ran in bf16
    assert max_rel(bf16, fp32) < 2e-2
    assert "loss_scale" not in metrics(runs["bf16"])[1]  # no scaler without fp16


@pytest.mark.slow
def test_fp16_with_grad_scaler_skips_overflowing_steps_and_trains(runs):
    recs = list(metrics(runs["fp16"]).values())
    assert len(recs) == STEPS and all(math.isfinite(r["loss"]) for r in recs)
    skipped = [r["scaler_skipped"] for r in recs]
    assert skipped[0], "the first step with a 2^22 loss scale must overflow in fp16"
    assert [r["skipped_steps"] for r in recs] == [sum(skipped[: i + 1]) for i in range(STEPS)]
    # A skip halves the scale (the first one from loss_scale_init); 4 good steps double it.
    assert recs[0]["loss_scale"] == 2.0**21
    for prev, rec in itertools.pairwise(recs):
        factor = 0.5 if rec["scaler_skipped"] else 1.0
        assert rec["loss_scale"] in (prev["loss_scale"] * factor, prev["loss_scale"] * 2)
    real = [r for r in recs if not r["scaler_skipped"]]
    assert len(real) >= 5 and all(math.isfinite(r["grad_norm"]) for r in real)
    # A skipped step does not advance the learning-rate schedule: the real steps use the
    # schedule's rates in order (those of the fp32 run, which skips nothing).
    schedule = [rec["lr"] for rec in metrics(runs["fsdp"]).values()]
    assert [r["lr"] for r in real] == schedule[: len(real)]
    assert real[-1]["loss"] < real[0]["loss"] - 0.03


@pytest.mark.slow
def test_stopped_fp16_run_resumes_with_the_uninterrupted_losses_and_scaler(runs):
    ref, got = metrics(runs["fp16"]), metrics(runs["fp16stop"])
    assert list(got) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "lr", "grad_norm", "loss_scale", "skipped_steps", "scaler_skipped"):
            a, b = got[step][key], ref[step][key]
            same = a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
            assert same, (step, key, a, b)  # a skipped step's grad norm is nan or inf
    assert {r["attempt"] for r in got.values()} == {1, 2}


@pytest.mark.slow
def test_ddp_checkpoint_consolidates_to_the_engine_logits(runs, data_dir):
    model, logits, probe = consolidated_probe(runs["ddp"], data_dir,
                                              data_dir.parent / "hf-ddp")
    assert model.dtype == torch.float32
    assert torch.equal(logits, probe["logits"]), (logits - probe["logits"]).abs().max()


# -- planner, render and config (no processes) ---------------------------------------------------


def _llama7b_plan(engine: str, precision: str, **strategy):
    from pipeline.plan import BatchSpec, Cluster, Strategy, check, resolve_model

    return check(model=resolve_model("llama2-7b"),
                 cluster=Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=80),
                 batch=BatchSpec(seq_len=4096, micro_batch_size=1, precision=precision),
                 strategy=Strategy(engine=engine, **strategy))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_planner_counts_ddp_as_zero_0_with_fp32_master_weights(precision):
    plan, _ = _llama7b_plan("ddp", precision)
    psi = plan.model.num_params()
    mem = plan.memory
    assert plan.strategy.label() == "DDP" and plan.dims.dp == 8
    # Nothing sharded: fp32 params (+ the autocast copy), fp32 grads, Adam m and v, per GPU.
    assert mem.params == 4 * psi + (0 if precision == "fp32" else 2 * psi)
    assert (mem.grads, mem.optimizer) == (4 * psi, 8 * psi)
    if precision == "fp32":  # the same model states as DeepSpeed's plain data parallelism
        zero0, _ = _llama7b_plan("deepspeed", "fp32", zero_stage=0)
        assert zero0.memory.model_states == mem.model_states
    # 7 B does not fit replicated on 80 GB: the pre-flight says so and names the sharding engines.
    _, errors = _llama7b_plan("ddp", precision)
    assert any("train.backend=fsdp or deepspeed" in str(e) for e in errors), errors


def test_planner_refuses_what_ddp_cannot_run():
    from pipeline.errors import PipelineError
    from pipeline.plan import Strategy

    for key, value in (("zero_stage", 1), ("fsdp_sharding", "FULL_SHARD")):
        with pytest.raises(PipelineError, match=key):
            Strategy(engine="ddp", **{key: value})
    _, errors = _llama7b_plan("ddp", "bf16", offload_optimizer=True)
    assert any("keeps every state on the GPU" in str(e) for e in errors), errors
    _, errors = _llama7b_plan("ddp", "bf16", tp=2)
    assert any("data parallel only" in str(e) for e in errors), errors


@pytest.mark.parametrize("strategy", ["manual", "auto"])
def test_render_of_a_ddp_run_writes_no_engine_config(strategy):
    from pipeline.config.files import parse_run_config
    from pipeline.plan.run import render_run

    run = parse_run_config({**BASE, "name": "r", "train": {
        **BASE["train"], "backend": "ddp", "precision": "fp16", "strategy": strategy}})
    files = render_run(run, vocab_size=384)
    assert "ds_config.json" not in files and "fsdp.json" not in files
    assert files["config.json"]["train"]["backend"] == "ddp"
    assert files["plan.json"]["engine"] == "ddp" and files["plan.json"]["strategy"] == "DDP"


def test_fp16_needs_a_loss_scaler():
    from pydantic import ValidationError

    from pipeline.config.schema import TrainConfig

    assert TrainConfig(backend="ddp", precision="fp16").loss_scale_init == 2.0**16
    with pytest.raises(ValidationError, match="fp16 needs loss scaling"):
        TrainConfig(backend="fsdp", precision="fp16")
