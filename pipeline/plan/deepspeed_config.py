"""``ds_config.json`` from a plan: only keys the installed DeepSpeed really reads.

Mapping from the seed guide's 3D example, whose keys DeepSpeed 0.19 does not read:

- ``tensor_parallel.tp_size`` → ``tensor_parallel.autotp_size``. ``TPTrainingConfig`` has no
  ``tp_size`` (it is rejected as an unknown key); ``tensor_parallel.tp.tp_size`` exists but
  belongs to the *inference* ``TPConfig``. AutoTP training reads ``autotp_size``, and its batch
  check counts TP ranks: ``train_batch_size = micro × gas × world`` (not world / tp).
- ``pipeline.stages`` → ``PipelineModule(layers, num_stages=pp, partition_method=...)``.
  ``get_pipeline_config`` copies the ``pipeline`` dict but ``PipelineEngine`` reads only
  ``activation_checkpoint_interval``, ``pipe_partitioned`` and ``grad_partitioned`` from it;
  ``stages``/``partition`` are constructor arguments of the model wrapper. With a pipeline the
  engine receives the module's grid as ``mpu`` and its batch check uses the data-parallel size.
"""

from __future__ import annotations

from typing import Any

from pipeline.plan.strategy import Plan

#: Seed-guide keys → what the engine reads instead (also shown in plan.md).
SEED_KEY_MAPPING: dict[str, str] = {
    "tensor_parallel.tp_size": "tensor_parallel.autotp_size (AutoTP training)",
    "pipeline.stages": "PipelineModule(num_stages=pp) — a constructor argument, not a config key",
    "pipeline.partition": "PipelineModule(partition_method=...) — a constructor argument",
}

#: ``pipeline`` sub-keys ``PipelineEngine`` reads (deepspeed/runtime/pipe/engine.py).
PIPELINE_ENGINE_KEYS = ("activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned")


def render_ds_config(plan: Plan, *, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.95),
                     eps: float = 1e-8, weight_decay: float = 0.1, warmup_steps: int = 100,
                     total_steps: int = 1000, warmup_min_lr: float = 0.0,
                     gradient_clipping: float = 1.0, torch_adam: bool = False,
                     pin_memory: bool = True, steps_per_print: int = 10) -> dict[str, Any]:
    """The DeepSpeed config for ``plan``'s chosen strategy (pure; JSON-ready)."""
    s, d, batch = plan.strategy, plan.dims, plan.batch
    assert s.engine == "deepspeed", "render_ds_config needs a deepspeed plan"
    stage = s.zero_stage or 0
    cfg: dict[str, Any] = {
        # DeepSpeed asserts train_batch_size == micro * gas * world_size at initialize; world_size
        # counts TP ranks without an mpu (see ParallelDims.deepspeed_batch_world).
        "train_batch_size": d.deepspeed_train_batch_size,
        "train_micro_batch_size_per_gpu": d.micro_batch_size,
        "gradient_accumulation_steps": d.grad_accum,
        "gradient_clipping": gradient_clipping,
        "steps_per_print": steps_per_print,
        "wall_clock_breakdown": False,
    }
    if batch.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif batch.precision == "fp16":
        # Dynamic loss scaling (loss_scale 0), DeepSpeed's documented defaults.
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update({
            "contiguous_gradients": True,
            "overlap_comm": s.overlap_comm,
            "reduce_scatter": True,
            "reduce_bucket_size": s.reduce_bucket_size,
        })
        if stage < 3:
            zero.update({"allgather_partitions": True,
                         "allgather_bucket_size": s.allgather_bucket_size})
        else:
            zero.update({"stage3_prefetch_bucket_size": s.allgather_bucket_size,
                         "stage3_param_persistence_threshold": 100_000,
                         "stage3_max_live_parameters": 1_000_000_000,
                         "stage3_max_reuse_distance": 1_000_000_000,
                         # consolidation reads a 16-bit state dict on save
                         "stage3_gather_16bit_weights_on_model_save": True})
        if s.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
        if s.offload_params and stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    cfg["zero_optimization"] = zero
    cfg["optimizer"] = {"type": "AdamW", "params": {
        "lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay,
        # torch_adam: torch.optim.AdamW instead of JIT-building FusedAdam (CPU tests, no CUDA).
        "torch_adam": torch_adam}}
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": warmup_min_lr, "warmup_max_lr": lr,
        "warmup_num_steps": warmup_steps, "total_num_steps": max(total_steps, warmup_steps + 1),
        "warmup_type": "linear"}}
    if batch.activation_checkpointing:
        # Read by deepspeed.checkpointing (Megatron-style); HF models recompute through
        # model.gradient_checkpointing_enable(), which the train stage calls. Kept plain.
        cfg["activation_checkpointing"] = {
            "partition_activations": False, "contiguous_memory_optimization": False,
            "cpu_checkpointing": False, "synchronize_checkpoint_boundary": False,
            "profile": False}
    if d.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": d.tp}
    if d.pp > 1:
        cfg["pipeline"] = {"activation_checkpoint_interval": 1 if batch.activation_checkpointing
                           else 0, "pipe_partitioned": True, "grad_partitioned": True}
    return cfg
