"""The planner: memory accounting, strategy choice, engine configs and pre-flight, GPU-free.

Typical use from the render stage::

    from pipeline.plan import (BatchSpec, Cluster, PRESETS, Strategy, plan, preflight,
                               render_ds_config, render_fsdp_config, render_plan_md)
    p = preflight(model=PRESETS["llama2-7b"], cluster=Cluster(nodes=4, gpus_per_node=8),
                  batch=BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=8),
                  strategy=Strategy(engine="deepspeed"))   # raises PipelineError listing all
    ds = render_ds_config(p, lr=3e-4, total_steps=1000)
"""

from pipeline.config.presets import PRESETS, ModelShape, resolve_model
from pipeline.errors import PipelineError
from pipeline.plan.deepspeed_config import SEED_KEY_MAPPING, render_ds_config
from pipeline.plan.fsdp_config import render_fsdp_config
from pipeline.plan.memory import MemoryBreakdown, estimate_memory
from pipeline.plan.preflight import check, preflight, validate_ds_config
from pipeline.plan.report import render_plan_md
from pipeline.plan.spec import GB, KEYS, BatchSpec, Cluster, Strategy
from pipeline.plan.strategy import Plan, Rung, plan
from pipeline.plan.topology import ParallelDims, params_per_rank, render_topology, stage_layers

__all__ = [
    "GB",
    "KEYS",
    "PRESETS",
    "SEED_KEY_MAPPING",
    "BatchSpec",
    "Cluster",
    "MemoryBreakdown",
    "ModelShape",
    "ParallelDims",
    "PipelineError",
    "Plan",
    "Rung",
    "Strategy",
    "check",
    "estimate_memory",
    "params_per_rank",
    "plan",
    "preflight",
    "render_ds_config",
    "render_fsdp_config",
    "render_plan_md",
    "render_topology",
    "resolve_model",
    "stage_layers",
    "validate_ds_config",
]
