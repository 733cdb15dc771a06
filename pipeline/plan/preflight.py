"""Pre-flight: every error that would kill a queued job in its first minute, found on the
login node in seconds. Each error names the config key and suggests a fix; all are collected.
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

from pipeline.config.presets import ModelShape
from pipeline.errors import PipelineError
from pipeline.io import deep_merge
from pipeline.plan.deepspeed_config import PIPELINE_ENGINE_KEYS, SEED_KEY_MAPPING, render_ds_config
from pipeline.plan.memory import Accounting
from pipeline.plan.spec import GB, KEYS, BatchSpec, Cluster, Strategy
from pipeline.plan.strategy import Plan, plan
from pipeline.plan.topology import batch_problems


class _ReadTracker(dict):
    """A dict that records which top-level keys DeepSpeedConfig looks at.

    ``DeepSpeedConfig`` silently accepts unknown top-level keys (only sub-sections are pydantic
    models with ``extra="forbid"``), so a typo such as ``gradient_clip`` would pass. It reads
    top-level keys with ``get``/``[]``/``in`` (``get_scalar_param``…) and ``in d.keys()``;
    the ``copy.copy`` it makes shares ``_seen`` (the instance ``__dict__`` is copied shallowly).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen: set[Any] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self._seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._seen.add(key)
        return super().__contains__(key)

    def keys(self) -> Any:  # type: ignore[override]
        tracker = self

        class _Keys:
            def __contains__(self, key: object) -> bool:
                return key in tracker

            def __iter__(self) -> Any:
                return iter(dict.keys(tracker))

            def __len__(self) -> int:
                return dict.__len__(tracker)

        return _Keys()


def validate_ds_config(config: dict[str, Any], *, world_size: int,
                       data_parallel_size: int | None = None) -> list[PipelineError]:
    """Validate with the installed ``deepspeed.runtime.config.DeepSpeedConfig`` at the real world
    size (its ``dist.get_rank/get_world_size`` patched: no process group on the login node).

    ``data_parallel_size`` stands for a pipeline's grid passed as ``mpu`` (its batch check then
    uses the data-parallel size). Returns one error per problem, naming ``train.deepspeed.<key>``.
    """
    try:
        import deepspeed.runtime.config as ds_config_module
    except ImportError as exc:  # pragma: no cover - deepspeed is a dependency
        return [PipelineError(f"{KEYS['deepspeed']}: cannot import deepspeed to validate the "
                              f"config ({exc}); install the project's dependencies")]
    errors: list[PipelineError] = []
    tracked = _ReadTracker(copy.deepcopy(config))
    mpu = None
    if data_parallel_size is not None:
        class _GridMPU:  # the part of PipelineModule's grid DeepSpeedConfig asks for
            def get_data_parallel_world_size(self) -> int:
                return data_parallel_size

        mpu = _GridMPU()
    dist = ds_config_module.dist
    try:
        with mock.patch.object(dist, "get_rank", return_value=0), \
                mock.patch.object(dist, "get_world_size", return_value=world_size):
            ds_config_module.DeepSpeedConfig(tracked, mpu=mpu)
    except Exception as exc:  # DeepSpeed raises AssertionError, ValueError, pydantic errors
        text = " ".join(str(exc).split())
        errors.append(PipelineError(
            f"{KEYS['deepspeed']}: the installed DeepSpeed rejects the rendered config at world "
            f"size {world_size}: {text[:600]} — remove or fix the option named there "
            f"(DeepSpeed config reference: https://www.deepspeed.ai/docs/config-json/)"))
    # Only meaningful after a complete parse: an exception stops DeepSpeed before later reads.
    unread = [] if errors else [k for k in config if k not in tracked._seen]
    for key in unread:
        hint = SEED_KEY_MAPPING.get(key, "remove it or check its spelling")
        errors.append(PipelineError(
            f"{KEYS['deepspeed']}.{key}: DeepSpeed does not read this top-level option (it "
            f"would be silently ignored); {hint}"))
    for sub in config.get("pipeline", {}) if isinstance(config.get("pipeline"), dict) else {}:
        if sub not in PIPELINE_ENGINE_KEYS:
            hint = SEED_KEY_MAPPING.get(f"pipeline.{sub}", "remove it")
            errors.append(PipelineError(
                f"{KEYS['deepspeed']}.pipeline.{sub}: DeepSpeed's PipelineEngine does not read "
                f"it; set {KEYS['pp']} instead ({hint})"))
    return errors


def check(*, model: ModelShape, cluster: Cluster, batch: BatchSpec,
          strategy: Strategy | None = None, accounting: Accounting = "deepspeed",
          headroom: float = 0.10, ds_overrides: dict[str, Any] | None = None,
          ds_render_kwargs: dict[str, Any] | None = None) -> tuple[Plan, list[PipelineError]]:
    """Plan, then collect every pre-flight error (empty list: safe to submit)."""
    request = strategy or Strategy()
    errors: list[PipelineError] = []
    if cluster.world_size is not None and cluster.world_size != cluster.world:
        errors.append(PipelineError(
            f"{KEYS['world_size']}: the launcher's world size {cluster.world_size} ≠ "
            f"{KEYS['nodes']} ({cluster.nodes}) × {KEYS['gpus_per_node']} "
            f"({cluster.gpus_per_node}) = {cluster.world}; make sbatch --nodes/--ntasks-per-node "
            f"match the config or fix the config"))
    the_plan = plan(model=model, cluster=cluster, batch=batch, strategy=request,
                    accounting=accounting, headroom=headroom)
    dims, chosen = the_plan.dims, the_plan.strategy
    errors += dims.problems(num_layers=model.num_layers, num_heads=model.num_heads,
                            num_kv_heads=model.num_kv_heads)
    if model.intermediate_size % dims.tp:
        divisors = [d for d in range(1, dims.gpus_per_node + 1)
                    if model.intermediate_size % d == 0 and dims.gpus_per_node % d == 0]
        errors.append(PipelineError(
            f"{KEYS['tp']}: TP={dims.tp} does not divide the model's intermediate size "
            f"{model.intermediate_size} (the MLP's gate/up/down projections are split over TP "
            f"ranks); use one of {divisors}, or change model.intermediate_size"))
    if batch.global_batch_size is not None:
        errors += batch_problems(dims=dims, global_batch_size=batch.global_batch_size)
    overrides = ds_overrides or {}
    bf16_on = batch.precision == "bf16" or _enabled(overrides, "bf16")
    fp16_on = batch.precision == "fp16" or _enabled(overrides, "fp16")
    if bf16_on and fp16_on:
        errors.append(PipelineError(
            f"{KEYS['precision']}: fp16 and bf16 are both enabled (precision={batch.precision!r}, "
            f"{KEYS['deepspeed']} overrides: bf16={_enabled(overrides, 'bf16')}, "
            f"fp16={_enabled(overrides, 'fp16')}); choose one with {KEYS['precision']} and drop "
            f"the other from {KEYS['deepspeed']}"))
    # What the engine itself cannot train (the ladder never proposes it; a pinned request can).
    refusal = chosen.unsupported()
    if refusal:
        if the_plan.suggestion is not None:
            refusal += f" ('{the_plan.suggestion.label()}' would fit)"
        errors.append(PipelineError(refusal))
    if dims.pp > 1 and model.tie_word_embeddings:
        errors.append(PipelineError(
            f"{KEYS['pp']}: PP={dims.pp} with tied embeddings: the embedding lives on the first "
            f"stage and lm_head on the last, so they cannot share one weight; set "
            f"model.tie_word_embeddings: false, or {KEYS['pp']}=1"))
    if chosen.engine == "deepspeed" and chosen.offload_params and chosen.zero_stage != 3:
        errors.append(PipelineError(
            f"{KEYS['offload_params']}: parameter offload needs ZeRO-3 (got ZeRO-"
            f"{chosen.zero_stage}); set {KEYS['zero_stage']}=3 or drop the offload"))
    mem = the_plan.memory
    if mem.total > the_plan.gpu_budget:
        fix = (f"'{the_plan.suggestion.label()}' would fit "
               f"({the_plan.suggestion.memory.total / GB:.1f} GB/GPU)"
               if the_plan.suggestion else
               "no rung of the ladder fits: add GPUs, shorten data.seq_len or lower "
               f"{KEYS['micro_batch_size']}")
        if chosen.engine == "ddp":
            fix += ("; ddp replicates every state on every GPU: train.backend=fsdp or deepspeed "
                    "shards them")
        errors.append(PipelineError(
            f"{KEYS['gpu_mem_gb']}: '{the_plan.chosen.label()}' needs {mem.total / GB:.1f} GB per "
            f"GPU, "
            f"{(mem.total - the_plan.gpu_budget) / GB:.1f} GB more than the "
            f"{the_plan.gpu_budget / GB:.1f} GB budget ({cluster.gpu_mem_gb:g} GB − "
            f"{cluster.gpu_reserved_gb:g} reserved, {headroom:.0%} headroom): params "
            f"{mem.params / GB:.1f}, grads {mem.grads / GB:.1f}, optimizer "
            f"{mem.optimizer / GB:.1f}, activations {mem.activations / GB:.1f}, buffers "
            f"{mem.buffers / GB:.1f}; {fix}"))
    if mem.host_per_node > the_plan.host_budget:
        what = "offloaded states" if mem.host_offload_per_node else "start-up model copies"
        errors.append(PipelineError(
            f"{KEYS['host_mem_gb']}: '{the_plan.chosen.label()}' needs "
            f"{mem.host_per_node / GB:.1f} GB of "
            f"host RAM per node ({what}; {mem.host_offload_per_node / GB:.1f} GB resident), "
            f"{(mem.host_per_node - the_plan.host_budget) / GB:.1f} GB more than the node's "
            f"{the_plan.host_budget / GB:.1f} GB budget; spread over more nodes, offload less "
            f"({KEYS['offload_params']}=false), or raise {KEYS['host_mem_gb']} if the node has "
            f"more"))
    if chosen.engine == "deepspeed":
        rendered = deep_merge(render_ds_config(the_plan, **(ds_render_kwargs or {})), overrides)
        errors += validate_ds_config(
            rendered, world_size=dims.world,
            data_parallel_size=dims.dp if dims.pp > 1 else None)
    return the_plan, errors


def _enabled(overrides: dict[str, Any], key: str) -> bool:
    section = overrides.get(key)
    return isinstance(section, dict) and bool(section.get("enabled"))


def preflight(*, model: ModelShape, cluster: Cluster, batch: BatchSpec,
              strategy: Strategy | None = None, accounting: Accounting = "deepspeed",
              headroom: float = 0.10, ds_overrides: dict[str, Any] | None = None,
              ds_render_kwargs: dict[str, Any] | None = None) -> Plan:
    """:func:`check`, raising one :class:`PipelineError` that lists every problem."""
    the_plan, errors = check(model=model, cluster=cluster, batch=batch, strategy=strategy,
                             accounting=accounting, headroom=headroom, ds_overrides=ds_overrides,
                             ds_render_kwargs=ds_render_kwargs)
    if errors:
        raise PipelineError(f"pre-flight found {len(errors)} problem(s):\n"
                            + "\n".join(f"- {e}" for e in errors))
    return the_plan
