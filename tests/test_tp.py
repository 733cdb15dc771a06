"""Tensor parallelism on the fsdp backend (issue 11): DTensor TP × FSDP2, the real trainer.

Real ``torchrun`` on gloo (CPU), the render stage and the worker, test_ddp's tokenized data and
tiny Llama (4 heads, intermediate 64). All runs start together so their start-up costs overlap:

- ``dp``: pure data parallelism, 2 processes × micro 4 × accumulation 2 (global batch 16);
- ``tp``: ``train.tp: 2`` on 2 processes (dp = 1), micro 8 × accumulation 2: the same global
  batch, so the same sequences per step (both TP ranks read the whole batch) and the same
  losses within 1e-3 relative (AdamW magnifies the reduction order TP changes; gradient
  clipping at 0.3 acts, over parameters that live on two meshes);
- ``tpdp``: tp 2 × dp 2 on 4 processes, micro 4 × accumulation 2: the same again;
- ``tpstop``: the ``tp`` run stopped by a STOP file after a few steps (a DCP checkpoint of
  DTensor state) and resumed on the same layout: the uninterrupted run's losses;
- the ``tp`` checkpoint consolidates (DCP reshards TP shards into full tensors without a
  process group) into a directory whose ``from_pretrained`` model gives the engine's logits.

Config and pre-flight checks for tp (no processes) close the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import consolidated_probe
from tests.test_ddp import (  # noqa: F401
    BASE,
    STEPS,
    data_dir,
    losses,
    max_rel,
    metrics,
    resume,
    train_together,
)
from tests.test_resume import run_cli

TRAIN = {**BASE["train"], "grad_clip": 0.3, "record_samples": True}
TP = {"train": {"tp": 2, "micro_batch_size": 8}}
RUNS = {
    "dp": {},
    "tp": TP,
    "tpdp": {"cluster": {"gpus_per_node": 4}, "train": {"tp": 2}},
    "tpstop": TP,
    "relayout": {"cluster": {"gpus_per_node": 4}, "train": {"tp": 2}},
}
NPROC = {"dp": 2, "tp": 2, "tpdp": 4, "tpstop": 2, "relayout": 4}
#: Stopped after a few steps, then resumed: on the same layout, or re-rendered as pure DP.
STOPPED = ("tpstop", "relayout")


def consumed(run_dir: Path, nproc: int, tp: int) -> dict[int, list[int]]:
    """Step → the sorted global sample indices the data-parallel ranks consumed (each TP
    group's first rank; the others must have read the same; the last attempt wins)."""
    by_rank = []
    for rank in range(nproc):
        seen: dict[int, list[int]] = {}
        for line in (run_dir / f"samples-rank{rank:05d}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            seen[rec["step"]] = rec["indices"]
        by_rank.append(seen)
    for rank in range(nproc):
        assert by_rank[rank] == by_rank[rank - rank % tp], f"rank {rank} read another batch"
    out: dict[int, list[int]] = {}
    for rank in range(0, nproc, tp):
        for step, idx in by_rank[rank].items():
            out.setdefault(step, []).extend(idx)
    return {step: sorted(idx) for step, idx in sorted(out.items())}


@pytest.fixture(scope="module")
def runs(data_dir) -> dict[str, Path]:  # noqa: F811
    work = data_dir.parent
    cfg = {**BASE, "train": TRAIN, "runs": RUNS}
    dirs = train_together(data_dir, cfg, "tp-runs", NPROC, STOPPED)
    # "relayout" (tp 2 × dp 2) continues as pure data parallelism (dp 4, micro 2 × 2) with the
    # same global batch: the layout is not part of the checkpoint's config hash, and DCP
    # reshards DTensor state.
    (work / "tp-config-dp.yaml").write_text(yaml.safe_dump(
        {**cfg, "runs": {"relayout": {"cluster": {"gpus_per_node": 4},
                                      "train": {"micro_batch_size": 2}}}}))
    run_cli("pipeline.render", "--config", str(work / "tp-config-dp.yaml"), "--run", "relayout",
            "--out", str(dirs["relayout"]), "--data-manifest", str(data_dir / "manifest.json"))
    for name in STOPPED:
        resume(dirs[name], data_dir, NPROC[name])
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp", "tpdp"])
def test_tp_losses_equal_pure_dp_with_the_same_global_batch(runs, name):
    dp = losses(runs["dp"])
    assert all(math.isfinite(x) for x in dp) and dp[-1] < dp[0]
    assert max_rel(losses(runs[name]), dp) < 1e-3
    # The clipped gradient norm over two meshes is the global one.
    norms = [r["grad_norm"] for r in metrics(runs[name]).values()]
    ref = [r["grad_norm"] for r in metrics(runs["dp"]).values()]
    assert max_rel(norms, ref) < 1e-2
    assert ref[0] > TRAIN["grad_clip"]  # clipping really acted
    # The same sequences every step as the pure-DP run; both TP ranks read the same batch.
    assert consumed(runs[name], NPROC[name], 2) == consumed(runs["dp"], 2, 1)
    manifest = json.loads(
        (runs[name] / "checkpoints" / "step-000010" / "manifest.json").read_text())
    assert manifest["backend"] == "fsdp" and manifest["world_size"] == NPROC[name]


@pytest.mark.slow
def test_stopped_tp_run_resumes_with_the_uninterrupted_losses(runs):
    ref, got = metrics(runs["tp"]), metrics(runs["tpstop"])
    assert list(got) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "lr", "grad_norm"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-6), (step, key)
    assert {r["attempt"] for r in got.values()} == {1, 2}
    assert consumed(runs["tpstop"], 2, 2) == consumed(runs["tp"], 2, 2)


@pytest.mark.slow
def test_tp_checkpoint_resumes_as_pure_data_parallel(runs):
    """tp 2 × dp 2 → dp 4: the resumed steps continue the run (no fresh start) with the losses of an
    uninterrupted run of either layout (they agree within 1e-3)."""
    got = metrics(runs["relayout"])
    assert list(got) == list(range(1, STEPS + 1))
    assert {r["attempt"] for r in got.values()} == {1, 2}
    first = min(s for s, r in got.items() if r["attempt"] == 2)
    assert first > 3  # resumed from its checkpoint, not from step 1
    assert max_rel(losses(runs["relayout"]), losses(runs["tp"])) < 1e-3
    assert max_rel(losses(runs["relayout"]), losses(runs["dp"])) < 1e-3
    assert not list((runs["relayout"]).glob("checkpoints.old-*"))  # nothing set aside


@pytest.mark.slow
def test_tp_checkpoint_consolidates_to_the_engine_logits(runs, data_dir):  # noqa: F811
    model, logits, probe = consolidated_probe(runs["tp"], data_dir,
                                              data_dir.parent / "hf-tp")
    assert model.dtype == torch.float32
    # Full weights (DCP reshards the TP shards); only the TP matmuls' summation order differs.
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (32, 32)
    assert torch.allclose(logits, probe["logits"], rtol=1e-4, atol=1e-5), (
        (logits - probe["logits"]).abs().max())


# -- config and pre-flight (no processes) --------------------------------------------------------


def test_each_engine_accepts_the_layouts_it_runs_and_names_the_one_that_runs_the_rest():
    from pydantic import ValidationError

    from pipeline.config.files import parse_run_config
    from pipeline.config.schema import TrainConfig
    from pipeline.errors import PipelineError

    assert TrainConfig(backend="fsdp", tp=2, pp=2, grad_accum=2).pp == 2
    assert TrainConfig(backend="deepspeed", tp=2, zero_stage=2).tp == 2
    assert TrainConfig(backend="deepspeed", pp=2, zero_stage=1).pp == 2
    with pytest.raises(ValidationError, match="backend: fsdp"):
        TrainConfig(backend="ddp", tp=2)
    with pytest.raises(ValidationError, match=r"cannot combine AutoTP.*backend: fsdp"):
        TrainConfig(backend="deepspeed", tp=2, pp=2)
    with pytest.raises(ValidationError, match=r"train\.zero_stage <= 1"):
        TrainConfig(backend="deepspeed", pp=2, zero_stage=2)
    with pytest.raises(ValidationError, match=r"train\.zero_stage <= 2"):
        TrainConfig(backend="deepspeed", tp=2, zero_stage=3)
    with pytest.raises(ValidationError, match=r"train\.grad_accum \(1\) < train\.pp \(2\)"):
        TrainConfig(backend="fsdp", pp=2, grad_accum=1)
    assert TrainConfig(backend="fsdp", pp=2, grad_accum=1, pp_schedule="gpipe").pp == 2
    with pytest.raises(PipelineError, match="tie_word_embeddings"):
        parse_run_config({**BASE, "name": "r", "model": {**BASE["model"],
                                                         "tie_word_embeddings": True},
                          "train": {**BASE["train"], "pp": 2}})
    with pytest.raises(PipelineError, match=r"exceeds model\.num_layers"):
        parse_run_config({**BASE, "name": "r", "cluster": {"gpus_per_node": 4},
                          "train": {**BASE["train"], "pp": 4, "grad_accum": 4}})
    run = parse_run_config({**BASE, "name": "r", "cluster": {"gpus_per_node": 4},
                            "train": {**BASE["train"], "tp": 2}})
    assert run.dp_size == 2 and run.global_batch_size == 4 * 2 * 2
    with pytest.raises(PipelineError, match=r"train\.tp × train\.pp"):
        parse_run_config({**BASE, "name": "r", "cluster": {"gpus_per_node": 4},
                          "train": {**BASE["train"], "tp": 2, "global_batch_size": 32}})


def test_preflight_passes_fsdp_tp2_and_names_what_tp_must_divide():
    from pipeline.plan import BatchSpec, Cluster, ModelShape, Strategy, check

    def errors(**shape):
        model = ModelShape(name="m", vocab_size=384, hidden_size=32, num_layers=2,
                           **{"intermediate_size": 64, "num_heads": 4, "num_kv_heads": 4,
                              **shape})
        _, errs = check(model=model, cluster=Cluster(nodes=1, gpus_per_node=2),
                        batch=BatchSpec(seq_len=32, micro_batch_size=8),
                        strategy=Strategy(engine="fsdp", tp=2))
        return [str(e) for e in errs]

    assert errors() == []
    assert any("attention heads" in e for e in errors(num_heads=3, num_kv_heads=3, head_dim=8))
    assert any("KV heads" in e for e in errors(num_kv_heads=1))
    msg = [e for e in errors(intermediate_size=65) if "intermediate size" in e]
    assert msg and msg[0].startswith("train.tp") and "[1]" in msg[0]
