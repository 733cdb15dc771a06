"""The render stage: one run's typed config → everything the train stage reads.

``python -m pipeline.render --config-json JSON --run NAME --out results/runs/NAME`` writes
``config.json``, ``ds_config.json``, ``fsdp.json``, ``topology.json``, ``plan.md`` and
``launch.json``. ``render_run`` is a pure function (typed config in, file contents out) so it is
tested against golden files; the CLI only writes what it returns.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, load_config, parse_run_config
from pipeline.distenv import torchrun_argv
from pipeline.errors import PipelineError
from pipeline.io import write_json_atomic, write_text_atomic


def ds_config(run: RunConfig) -> dict[str, Any]:
    """The DeepSpeed config for a run: only keys the installed engine reads."""
    t = run.train
    cfg: dict[str, Any] = {
        "train_batch_size": run.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 10**9,  # the loop logs; DeepSpeed's own prints would duplicate them
        "wall_clock_breakdown": False,
        "bf16": {"enabled": t.precision == "bf16"},
        "zero_optimization": {
            "stage": t.zero_stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": list(t.betas),
                "eps": t.eps,
                "weight_decay": t.weight_decay,
                "torch_adam": t.torch_adam,
            },
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": t.lr,
                "warmup_num_steps": t.warmup_steps,
                "total_num_steps": t.max_steps,
                "warmup_type": "linear",
            },
        },
    }
    if t.zero_stage == 3:
        # allgather_bucket_size is a stage 1/2 key; stage 3 has its own prefetch knobs.
        cfg["zero_optimization"].pop("allgather_bucket_size")
    if t.zero_stage == 0:
        cfg["zero_optimization"] = {"stage": 0}
    if t.offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


def fsdp_config(run: RunConfig) -> dict[str, Any]:
    """FSDP2 settings: mesh, mixed precision, wrap unit, resharding."""
    t = run.train
    return {
        "sharding": t.fsdp_sharding,
        "mesh": [run.world_size, 1] if t.fsdp_sharding == "NO_SHARD" else [run.world_size],
        "mesh_dim_names": ["replicate", "shard"] if t.fsdp_sharding == "NO_SHARD" else ["shard"],
        "wrap_unit": "decoder layer (model.model.layers[i]), then the root",
        "reshard_after_forward": t.fsdp_sharding == "FULL_SHARD",
        "mixed_precision": (
            {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
            if t.precision == "bf16"
            else None
        ),
        "activation_checkpointing": t.activation_checkpointing,
    }


def topology(run: RunConfig) -> dict[str, Any]:
    """Nodes × processes, parallel degrees and the batch arithmetic."""
    t = run.train
    return {
        "nodes": run.cluster.nodes,
        "gpus_per_node": run.cluster.gpus_per_node,
        "world_size": run.world_size,
        "tp": 1,
        "pp": 1,
        "dp": run.dp_size,
        "micro_batch_size": t.micro_batch_size,
        "grad_accum": t.grad_accum,
        "global_batch_size": run.global_batch_size,
        "tokens_per_step": run.global_batch_size * run.data.seq_len,
        "batch_arithmetic": (
            f"{t.micro_batch_size} micro × {t.grad_accum} accumulation × {run.dp_size} "
            f"data-parallel = {run.global_batch_size} sequences/step"
        ),
    }


def plan_md(run: RunConfig, topo: dict[str, Any]) -> str:
    """A human-readable summary of what will run."""
    t = run.train
    engine = (
        f"DeepSpeed ZeRO-{t.zero_stage}" + (" + optimizer offload" if t.offload_optimizer else "")
        if t.backend == "deepspeed"
        else f"FSDP2 {t.fsdp_sharding}"
    )
    return "\n".join(
        [
            f"# Plan for run `{run.name}`",
            "",
            f"- Engine: {engine}, {t.precision}"
            + (", activation checkpointing" if t.activation_checkpointing else ""),
            f"- Topology: {topo['nodes']} node(s) × {topo['gpus_per_node']} process(es) = "
            f"world {topo['world_size']} (TP 1 × PP 1 × DP {topo['dp']})",
            f"- Batch: {topo['batch_arithmetic']}; {topo['tokens_per_step']} tokens/step",
            f"- Steps: {t.max_steps} (warmup {t.warmup_steps}, peak lr {t.lr}), checkpoint "
            f"every {t.checkpoint_every}, keep {t.keep_last}",
            "",
        ]
    )


def render_run(run: RunConfig) -> dict[str, Any]:
    """Everything the render stage writes for one run, as a dict of file name → content."""
    topo = topology(run)
    argv = torchrun_argv(
        "python",
        node=None,
        nproc_per_node=run.cluster.gpus_per_node,
        module="pipeline.train",
        args=["worker", "--run-dir", f"results/runs/{run.name}", "--data-dir", "results/data"],
    )
    return {
        "config.json": run.model_dump(mode="json"),
        "ds_config.json": ds_config(run),
        "fsdp.json": fsdp_config(run),
        "topology.json": topo,
        "plan.md": plan_md(run, topo),
        "launch.json": {"per_node_argv": argv},
    }


def write_rendered(files: dict[str, Any], out: Path) -> None:
    """Write what ``render_run`` returned, each file atomically."""
    for name, content in files.items():
        if isinstance(content, str):
            write_text_atomic(out / name, content)
        else:
            write_json_atomic(out / name, content)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.render",
        description="Render one run's engine configs, topology and plan from the config.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help="a config YAML file (with --run)")
    src.add_argument(
        "--run-config-json", help="one run's effective config as JSON (what Snakemake passes)"
    )
    p.add_argument("--run", help="run name (a key of runs:), with --config")
    p.add_argument("--out", type=Path, required=True, help="output dir, e.g. results/runs/NAME")
    args = p.parse_args(argv)
    try:
        if args.config is not None:
            if not args.run:
                raise PipelineError("--config needs --run NAME (one of the config's runs:)")
            run = load_config(args.config).run(args.run)
        else:
            run = parse_run_config(json.loads(args.run_config_json))
        files = render_run(run)
        write_rendered(files, args.out)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(files["plan.md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
