"""Rendered configs: golden files for the seed guide's examples and three model × cluster cases;
every rendered ds_config passes the installed DeepSpeedConfig at its world size.

Regenerate the golden files after an intended change with::

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_plan_render.py

and review the diff under tests/golden/plan/ before committing.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from pipeline.cluster.options import LaunchOptions
from pipeline.cluster.sbatch import render_submission
from pipeline.plan import (
    PRESETS,
    BatchSpec,
    Cluster,
    Strategy,
    plan,
    render_ds_config,
    render_fsdp_config,
    render_plan_md,
    render_topology,
    validate_ds_config,
)
from pipeline.plan.strategy import ladder

GOLDEN = Path(__file__).parent / "golden" / "plan"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
#: Host RAM per node of the clusters below (the config default, cluster.host_mem_gb, is smaller).
HOST_GB = 512

CASES = {
    # Seed guide: ZeRO-2 + optimizer offload on a 7B, 4 nodes × 8 GPUs, bf16, checkpointing.
    "seed_zero2_offload_7b_4x8": dict(
        model="llama2-7b", cluster=Cluster(nodes=4, gpus_per_node=8, host_mem_gb=HOST_GB),
        batch=BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=8,
                        activation_checkpointing=True),
        strategy=Strategy(zero_stage=2, offload_optimizer=True)),
    # Seed guide's 3D example: TP inside a node × PP across nodes × DP. DeepSpeed cannot
    # combine AutoTP with its PipelineModule; fsdp runs all three.
    "seed_3d_tp4_pp4_70b_4x8": dict(
        model="llama2-70b", cluster=Cluster(nodes=4, gpus_per_node=8, host_mem_gb=HOST_GB),
        batch=BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=16,
                        activation_checkpointing=True),
        strategy=Strategy(engine="fsdp", fsdp_sharding="FULL_SHARD", tp=4, pp=4)),
    # What DeepSpeed does run of it: AutoTP alone (ZeRO ≤ 2), or a PipelineModule alone (ZeRO-1).
    "llama2_70b_autotp8_zero2_4x8": dict(
        model="llama2-70b", cluster=Cluster(nodes=4, gpus_per_node=8, host_mem_gb=HOST_GB),
        batch=BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=16,
                        activation_checkpointing=True),
        strategy=Strategy(zero_stage=2, tp=8)),
    "llama2_13b_pp4_zero1_4x8": dict(
        model="llama2-13b", cluster=Cluster(nodes=4, gpus_per_node=8, host_mem_gb=HOST_GB),
        batch=BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=16,
                        activation_checkpointing=True),
        strategy=Strategy(zero_stage=1, pp=4)),
    # auto, checkpointing left to the planner: the time-for-memory rung before TP and PP.
    "llama2_70b_auto_4x8": dict(
        model="llama2-70b", cluster=Cluster(nodes=4, gpus_per_node=8, host_mem_gb=HOST_GB),
        batch=BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=16,
                        activation_checkpointing=None),
        strategy=Strategy()),
    "llama3_8b_fsdp_2x8": dict(
        model="llama3-8b", cluster=Cluster(nodes=2, gpus_per_node=8, host_mem_gb=HOST_GB),
        batch=BatchSpec(seq_len=8192, micro_batch_size=1, global_batch_size=64),
        strategy=Strategy(engine="fsdp")),
    "mistral_7b_auto_1x8_40gb": dict(
        model="mistral-7b",
        cluster=Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=40, host_mem_gb=HOST_GB),
        batch=BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=4,
                        activation_checkpointing=True),
        strategy=Strategy()),
    "llama2_13b_auto_2x4_80gb": dict(
        model="llama2-13b", cluster=Cluster(nodes=2, gpus_per_node=4, host_mem_gb=HOST_GB),
        batch=BatchSpec(seq_len=4096, micro_batch_size=2, grad_accum=4,
                        activation_checkpointing=True),
        strategy=Strategy()),
}


def _plan(case: dict):
    return plan(model=PRESETS[case["model"]], cluster=case["cluster"], batch=case["batch"],
                strategy=case["strategy"])


def _render(case: dict) -> dict[str, str]:
    p = _plan(case)
    engine = p.strategy.engine
    config = (render_ds_config(p, lr=3e-4, warmup_steps=100, total_steps=1000)
              if engine == "deepspeed" else render_fsdp_config(p))
    return {
        "ds_config.json" if engine == "deepspeed" else "fsdp.json":
            json.dumps(config, indent=2, sort_keys=True) + "\n",
        "topology.json": json.dumps(render_topology(p.dims, seq_len=p.batch.seq_len),
                                    indent=2, sort_keys=True) + "\n",
        "plan.md": render_plan_md(p),
        **_submission(p, LaunchOptions(partition="gpu")),
    }


def _submission(p, opts: LaunchOptions) -> dict[str, str]:
    """The sbatch submission the plan's job would be: its argv and its script."""
    sub = render_submission(opts, nodes=p.dims.nodes, gpus_per_node=p.dims.gpus_per_node,
                            device="cuda", folder="/path/to/results/runs/r/submitit/%j",
                            python="python")
    return {"sbatch.argv.json": json.dumps(sub.command(), indent=2) + "\n",
            "sbatch.sh": sub.script}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    rendered = _render(CASES[name])
    folder = GOLDEN / name
    if UPDATE:
        folder.mkdir(parents=True, exist_ok=True)
        for fname, text in rendered.items():
            (folder / fname).write_text(text)
    for fname, text in rendered.items():
        assert (folder / fname).read_text() == text, f"{name}/{fname} differs from golden"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_cases_pass_deepspeed_and_fit(name: str) -> None:
    p = _plan(CASES[name])
    assert p.fits and p.unsupported is None
    if p.strategy.engine == "deepspeed":
        cfg = render_ds_config(p)
        assert validate_ds_config(cfg, world_size=p.dims.world,
                                  data_parallel_size=p.dims.dp if p.dims.pp > 1 else None) == []


def test_seed_example_contents() -> None:
    cfg = render_ds_config(_plan(CASES["seed_zero2_offload_7b_4x8"]))
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 2
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["overlap_comm"] and zero["contiguous_gradients"] and zero["reduce_scatter"]
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["scheduler"]["type"] == "WarmupDecayLR"
    assert cfg["scheduler"]["params"]["warmup_type"] == "linear"
    assert cfg["optimizer"]["type"] == "AdamW"
    assert cfg["train_batch_size"] == 1 * 8 * 32
    assert "activation_checkpointing" in cfg


def test_3d_example_maps_seed_keys() -> None:
    cfg = render_fsdp_config(_plan(CASES["seed_3d_tp4_pp4_70b_4x8"]))
    assert cfg["mesh"] == {"dim_names": ["pp", "dp_shard", "tp"], "shape": [4, 2, 4]}
    tp = render_ds_config(_plan(CASES["llama2_70b_autotp8_zero2_4x8"]))
    assert tp["tensor_parallel"] == {"autotp_size": 8} and "pipeline" not in tp
    assert tp["train_batch_size"] == 1 * 16 * 32  # AutoTP: DeepSpeed counts the TP ranks
    pp = render_ds_config(_plan(CASES["llama2_13b_pp4_zero1_4x8"]))
    assert "stages" not in pp["pipeline"] and "tensor_parallel" not in pp
    assert pp["train_batch_size"] == 1 * 16 * 8  # the pipeline grid's DP = 32 / 4


def test_deepspeed_tp_with_pp_is_refused_naming_fsdp() -> None:
    case = {**CASES["seed_3d_tp4_pp4_70b_4x8"], "strategy": Strategy(zero_stage=1, tp=4, pp=4)}
    p = _plan(case)
    assert p.unsupported and "train.backend=fsdp" in p.unsupported
    assert p.suggestion is not None and p.suggestion.strategy.unsupported() is None
    assert "NOT TRAINABLE" in render_plan_md(p)


def _all_rungs():
    for engine in ("deepspeed",):
        for cluster in (Cluster(nodes=1, gpus_per_node=8), Cluster(nodes=4, gpus_per_node=8)):
            for s in ladder(PRESETS["llama2-13b"], cluster, engine, pinned=True):
                yield cluster, s


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_every_rendered_ds_config_passes_deepspeed(precision: str) -> None:
    batch = BatchSpec(seq_len=2048, micro_batch_size=2, grad_accum=3, precision=precision,
                      activation_checkpointing=True)
    count = 0
    for cluster, s in _all_rungs():
        p = plan(model=PRESETS["llama2-13b"], cluster=cluster, batch=batch, strategy=s)
        assert p.strategy == s
        cfg = render_ds_config(p, torch_adam=True)
        errors = validate_ds_config(cfg, world_size=p.dims.world,
                                    data_parallel_size=p.dims.dp if p.dims.pp > 1 else None)
        assert errors == [], (s.label(), errors)
        count += 1
    assert count > 20


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"])
def test_fsdp_mesh_covers_world(sharding: str) -> None:
    p = plan(model=PRESETS["llama2-7b"], cluster=Cluster(nodes=2, gpus_per_node=8),
             batch=BatchSpec(), strategy=Strategy(engine="fsdp", fsdp_sharding=sharding, tp=2))
    cfg = render_fsdp_config(p)
    assert math.prod(cfg["mesh"]["shape"]) == 16
    assert cfg["mesh"]["dim_names"][-1] == "tp"
    assert cfg["reshard_after_forward"] == (sharding in ("FULL_SHARD", "HYBRID_SHARD"))
    assert cfg["mixed_precision"] == {"param_dtype": "bf16", "reduce_dtype": "fp32",
                                      "output_dtype": None}
    if sharding == "HYBRID_SHARD":
        assert dict(zip(cfg["mesh"]["dim_names"], cfg["mesh"]["shape"], strict=True)) == {
            "dp_replicate": 2, "dp_shard": 4, "tp": 2}


def test_plan_md_lists_rejected_rungs() -> None:
    p = plan(model=PRESETS["mistral-7b"], cluster=Cluster(nodes=1, gpus_per_node=8,
                                                          gpu_mem_gb=24),
             batch=BatchSpec(seq_len=4096, activation_checkpointing=True))
    md = render_plan_md(p)
    assert f"## Chosen: {p.strategy.label()}" in md
    for r in p.rejected:
        assert f"| {r.strategy.label()} |" in md
    assert "short by" in md


def test_submission_carries_hostile_names_as_data() -> None:
    # (Was: the sbatch preview quotes hostile names. The submission puts them on sbatch's
    # argv, one argument each, and keeps them out of the script.)
    p = _plan(CASES["seed_zero2_offload_7b_4x8"])
    files = _submission(p, LaunchOptions(job_name="a b;rm -rf /", sbatch_extra=["--comment=x y"]))
    argv, text = json.loads(files["sbatch.argv.json"]), files["sbatch.sh"]
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text
    assert "--job-name=a b;rm -rf /" in argv and "--comment=x y" in argv
    assert "rm -rf" not in text and "x y" not in text
