"""FSDP2 settings from a plan (``fsdp.json``): mesh, mixed precision, wrap unit, resharding.

Strategy → FSDP2 (``torch.distributed.fsdp.fully_shard``) mapping:

- FULL_SHARD   → 1-D ``dp_shard`` mesh, ``reshard_after_forward=True``        (≈ ZeRO-3)
- SHARD_GRAD_OP → 1-D ``dp_shard`` mesh, ``reshard_after_forward=False``      (≈ ZeRO-2)
- HYBRID_SHARD → 2-D ``(dp_replicate, dp_shard)`` mesh, shard inside a node, replicate across
- NO_SHARD     → 2-D ``(dp_replicate=dp, dp_shard=1)``: pure replication (DDP-like)
- TP > 1 adds a ``tp`` mesh dimension (innermost: a TP group = consecutive ranks of one node),
  PP > 1 a ``pp`` dimension (outermost); torchtitan's order ``(pp, dp_replicate, dp_shard, tp)``.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.plan.strategy import Plan


def render_fsdp_config(plan: Plan) -> dict[str, Any]:
    """The FSDP2 settings for ``plan``'s chosen strategy (pure; JSON-ready)."""
    s, d, batch = plan.strategy, plan.dims, plan.batch
    assert s.engine == "fsdp", "render_fsdp_config needs an fsdp plan"
    sharding = s.fsdp_sharding or "FULL_SHARD"
    if sharding == "HYBRID_SHARD":
        shard = math.gcd(d.dp, max(1, d.gpus_per_node // d.tp))
        replicate = d.dp // shard
    elif sharding == "NO_SHARD":
        shard, replicate = 1, d.dp
    else:
        shard, replicate = d.dp, 1
    names, shape = [], []
    for name, size in (("pp", d.pp), ("dp_replicate", replicate), ("dp_shard", shard),
                       ("tp", d.tp)):
        if size > 1 or name == "dp_shard":
            names.append(name)
            shape.append(size)
    mixed = batch.precision != "fp32"
    return {
        "sharding_strategy": sharding,
        "mesh": {"dim_names": names, "shape": shape},
        "reshard_after_forward": sharding not in ("SHARD_GRAD_OP", "NO_SHARD"),
        # Parameters are stored (sharded) in fp32 and double as master weights; compute in the
        # low dtype, reduce gradients in fp32 for accuracy.
        "mixed_precision": {"param_dtype": batch.precision if mixed else "fp32",
                            "reduce_dtype": "fp32", "output_dtype": None},
        "wrap_unit": "decoder_layer",
        "wrap_order": "fully_shard each decoder layer, then the root module",
        "cpu_offload": bool(s.offload_params or s.offload_optimizer),
        "activation_checkpointing": batch.activation_checkpointing,
        "tp": d.tp,
        "sequence_parallel": False,  # not built yet (HF Llama's mask needs the full sequence)
        "pp": d.pp,
        "micro_batch_size": d.micro_batch_size,
        "grad_accum": d.grad_accum,
    }
