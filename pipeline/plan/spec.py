"""Typed inputs of the planner: the cluster, the batch/precision settings, the strategy.

Every field names the config key it comes from (:data:`KEYS`), so that an error found here can
tell the user exactly what to change in ``config.yaml``. The value sets (precision, engine, FSDP
sharding) and the defaults of the fields that mirror a config key are those of
:mod:`pipeline.config.schema`, defined there once; ``pipeline.plan.run.planner_inputs`` maps a run's
config onto these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from pipeline.config.files import field_default
from pipeline.config.schema import (
    MAX_GLOBAL_BATCH,
    MAX_GPU_MEM_GB,
    MAX_GPUS_PER_NODE,
    MAX_GRAD_ACCUM,
    MAX_HOST_MEM_GB,
    MAX_MICRO_BATCH,
    MAX_NODES,
    MAX_PP,
    MAX_SEQ_LEN,
    MAX_TP,
    MAX_WORLD,
    Backend,
    ClusterConfig,
    FsdpSharding,
    PipelineSchedule,
    Precision,
)
from pipeline.errors import PipelineError

#: Config key path for each planner input (``config/config.yaml`` / ``pipeline/config/schema.py``).
KEYS: dict[str, str] = {
    "nodes": "cluster.nodes",
    "gpus_per_node": "cluster.gpus_per_node",
    "gpu_mem_gb": "cluster.gpu_mem_gb",
    "host_mem_gb": "cluster.host_mem_gb",
    "world_size": "cluster.world_size",
    "seq_len": "data.seq_len",
    "micro_batch_size": "train.micro_batch_size",
    "grad_accum": "train.grad_accum",
    "global_batch_size": "train.global_batch_size",
    "precision": "train.precision",
    "activation_checkpointing": "train.activation_checkpointing",
    "engine": "train.backend",
    "zero_stage": "train.zero_stage",
    "fsdp_sharding": "train.fsdp_sharding",
    "offload_optimizer": "train.offload_optimizer",
    "offload_params": "train.offload_params",
    "tp": "train.tp",
    "pp": "train.pp",
    "pp_schedule": "train.pp_schedule",
    "deepspeed": "train.deepspeed",
}

#: The planner's engine is the config's ``train.backend``.
Engine = Backend
ENGINES: tuple[str, ...] = get_args(Backend)
PRECISIONS: tuple[str, ...] = get_args(Precision)
FSDP_SHARDINGS: tuple[str, ...] = get_args(FsdpSharding)
PP_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)

GB = 1_000_000_000
"""Bytes per GB. Decimal, as the ZeRO paper (120 GB = 16 × 7.5e9) and GPU marketing use it."""


#: The largest value of each count the planner takes: the config's limits
#: (``pipeline.config.types``). The planner's work grows with them (a table per TP rank and
#: stage), so each is checked before any planning.
LIMITS: dict[str, int] = {
    "nodes": MAX_NODES, "gpus_per_node": MAX_GPUS_PER_NODE, "world_size": MAX_WORLD,
    "seq_len": MAX_SEQ_LEN, "micro_batch_size": MAX_MICRO_BATCH, "grad_accum": MAX_GRAD_ACCUM,
    "global_batch_size": MAX_GLOBAL_BATCH, "tp": MAX_TP, "pp": MAX_PP,
}


def check_count(key: str, value: object) -> None:
    """``value`` is an integer from 1 to ``LIMITS[key]``, else an error naming the config key."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipelineError(f"{KEYS[key]}: must be a positive integer, got {value!r}")
    if value > LIMITS[key]:
        raise PipelineError(f"{KEYS[key]}: {value} is more than {LIMITS[key]}, the largest the "
                            "pipeline allows")




@dataclass(kw_only=True, frozen=True)
class Cluster:
    """The machines a job gets."""

    nodes: int = field_default(ClusterConfig, "nodes")
    """Number of nodes (``sbatch --nodes``)."""

    gpus_per_node: int = field_default(ClusterConfig, "gpus_per_node")
    """GPUs (ranks) per node (``--gpus-per-node``, ``--ntasks-per-node``)."""

    gpu_mem_gb: float = field_default(ClusterConfig, "gpu_mem_gb")
    """Memory of one GPU in GB (1e9 bytes)."""

    host_mem_gb: float = field_default(ClusterConfig, "host_mem_gb")
    """Host RAM of one node in GB usable by the job (``--mem``)."""

    gpu_reserved_gb: float = 2.0
    """Per-GPU memory never available to tensors: CUDA context, NCCL, allocator fragmentation."""

    world_size: int | None = None
    """The world size the launcher will really start, when known (e.g. ``SLURM_NTASKS``)."""

    def __post_init__(self) -> None:
        check_count("nodes", self.nodes)
        check_count("gpus_per_node", self.gpus_per_node)
        for key, limit in (("gpu_mem_gb", MAX_GPU_MEM_GB), ("host_mem_gb", MAX_HOST_MEM_GB)):
            value = getattr(self, key)
            if not 0 < value <= limit:  # NaN and infinities fail this too
                raise PipelineError(f"{KEYS[key]}: must be > 0 and at most {limit}, got "
                                    f"{value!r}")
        if not 0 <= self.gpu_reserved_gb < self.gpu_mem_gb:
            raise PipelineError(
                f"cluster.gpu_reserved_gb: must be in [0, gpu_mem_gb), got {self.gpu_reserved_gb!r}")
        if self.world_size is not None:
            check_count("world_size", self.world_size)

    @property
    def world(self) -> int:
        """Ranks in the job: nodes × GPUs per node."""
        return self.nodes * self.gpus_per_node


@dataclass(kw_only=True, frozen=True)
class BatchSpec:
    """Per-step training settings that drive memory: batch arithmetic, sequence, precision."""

    seq_len: int = 4096
    """Tokens per sequence ``s``."""

    micro_batch_size: int = 1
    """Sequences per GPU per forward/backward ``b``."""

    grad_accum: int | None = None
    """Micro batches accumulated per optimizer step; ``None``: derived from ``global_batch_size``."""

    global_batch_size: int | None = None
    """Sequences per optimizer step over all data-parallel ranks; ``None``: derived."""

    precision: Precision = "bf16"
    """Parameter/activation dtype in compute: ``bf16``/``fp16`` (mixed precision) or ``fp32``."""

    activation_checkpointing: bool | None = False
    """Recompute each decoder layer in backward (keeps only its input, Korthikanti et al. §4);
    ``None``: the ``auto`` ladder decides (it tries it before tensor and pipeline parallelism)."""

    def __post_init__(self) -> None:
        check_count("seq_len", self.seq_len)
        check_count("micro_batch_size", self.micro_batch_size)
        if self.grad_accum is not None:
            check_count("grad_accum", self.grad_accum)
        if self.global_batch_size is not None:
            check_count("global_batch_size", self.global_batch_size)
        if self.activation_checkpointing not in (None, True, False):
            raise PipelineError(f"{KEYS['activation_checkpointing']}: must be true or false, got "
                                f"{self.activation_checkpointing!r}")
        if self.precision not in PRECISIONS:
            raise PipelineError(
                f"{KEYS['precision']}: {self.precision!r} is not one of {', '.join(PRECISIONS)}")

    @property
    def param_bytes(self) -> int:
        """Bytes of one compute-dtype element (params, grads, activations in compute)."""
        return 4 if self.precision == "fp32" else 2


@dataclass(kw_only=True, frozen=True)
class Strategy:
    """How the model is spread over the GPUs. ``None`` fields are chosen by the ``auto`` ladder."""

    engine: Engine = "deepspeed"
    """Training backend: ``deepspeed`` (ZeRO stages), ``fsdp`` (FSDP2 ``fully_shard``) or ``ddp``
    (``DistributedDataParallel``: nothing sharded, like ZeRO-0)."""

    zero_stage: int | None = None
    """DeepSpeed ZeRO stage 0–3 (0 = plain data parallel); ``None`` = auto."""

    fsdp_sharding: FsdpSharding | None = None
    """FSDP sharding strategy; ``None`` = auto."""

    offload_optimizer: bool | None = None
    """Keep fp32 master weights and Adam moments in host RAM and step on the CPU; ``None`` = auto."""

    offload_params: bool | None = None
    """Keep parameters in host RAM between uses (ZeRO-3 / FSDP only); ``None`` = auto."""

    tp: int | None = None
    """Tensor-parallel degree (inside a node); ``None`` = auto."""

    pp: int | None = None
    """Pipeline-parallel degree (across nodes); ``None`` = auto."""

    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule of the fsdp engine (``gpipe`` keeps every micro batch of a step in
    flight, ``1f1b`` at most ``pp``); DeepSpeed's PipelineEngine always runs its own 1F1B."""

    reduce_bucket_size: int = 200_000_000
    """Elements per gradient reduce bucket (DeepSpeed ``reduce_bucket_size``)."""

    allgather_bucket_size: int = 200_000_000
    """Elements per parameter all-gather bucket (ZeRO-1/2) / prefetch bucket (ZeRO-3)."""

    overlap_comm: bool = True
    """Overlap gradient reduction with backward; costs 4.5 × the bucket sizes (see memory.py)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise PipelineError(
                f"{KEYS['engine']}: {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise PipelineError(
                f"{KEYS['zero_stage']}: ZeRO stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.fsdp_sharding is not None and self.fsdp_sharding not in FSDP_SHARDINGS:
            raise PipelineError(f"{KEYS['fsdp_sharding']}: {self.fsdp_sharding!r} is not one of "
                                f"{', '.join(FSDP_SHARDINGS)}")
        if self.engine == "fsdp" and self.zero_stage is not None:
            raise PipelineError(f"{KEYS['zero_stage']}: set only with train.backend=deepspeed; "
                                f"for fsdp use {KEYS['fsdp_sharding']}")
        if self.engine == "deepspeed" and self.fsdp_sharding is not None:
            raise PipelineError(f"{KEYS['fsdp_sharding']}: set only with train.backend=fsdp; "
                                f"for deepspeed use {KEYS['zero_stage']}")
        if self.engine == "ddp" and self.zero_stage is not None:
            raise PipelineError(f"{KEYS['zero_stage']}: set only with train.backend=deepspeed; "
                                "ddp shards nothing (every rank holds the whole model)")
        if self.engine == "ddp" and self.fsdp_sharding is not None:
            raise PipelineError(f"{KEYS['fsdp_sharding']}: set only with train.backend=fsdp; "
                                "ddp shards nothing (every rank holds the whole model)")
        if self.pp_schedule not in PP_SCHEDULES:
            raise PipelineError(f"{KEYS['pp_schedule']}: {self.pp_schedule!r} is not one of "
                                f"{', '.join(PP_SCHEDULES)}")
        for key in ("tp", "pp"):
            value = getattr(self, key)
            if value is not None:
                check_count(key, value)
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise PipelineError(f"train.{key}: must be a positive integer, got {value!r}")

    @property
    def is_resolved(self) -> bool:
        """Every choice made (no ``None`` left): a rung of the ladder, not a request."""
        sharding = {"deepspeed": self.zero_stage, "fsdp": self.fsdp_sharding}.get(self.engine, 0)
        return None not in (sharding, self.offload_optimizer, self.offload_params, self.tp, self.pp)

    @property
    def shards_params(self) -> bool:
        """Parameters partitioned over data-parallel ranks (ZeRO-3, FULL/HYBRID_SHARD)."""
        if self.engine == "deepspeed":
            return self.zero_stage == 3
        if self.engine == "ddp":
            return False
        return self.fsdp_sharding in ("FULL_SHARD", "HYBRID_SHARD")

    def unsupported(self) -> str | None:
        """Why the engine cannot train this resolved strategy (``None``: it can).

        The rules of ``pipeline.config.schema.TrainConfig._check_model_parallel``, the engines' own:
        fsdp runs TP × PP × DP (DTensor, ``torch.distributed.pipelining``, FSDP2/HSDP);
        DeepSpeed runs AutoTP (TP with ZeRO 0-2) or its ``PipelineModule`` (PP with ZeRO 0-1),
        never both, and neither with offload; ddp is data parallel only.
        """
        tp, pp = self.tp or 1, self.pp or 1
        offload = bool(self.offload_optimizer or self.offload_params)
        if self.engine == "ddp" and offload:
            return (f"{KEYS['offload_optimizer']}/{KEYS['offload_params']}: train.backend=ddp "
                    f"keeps every state on the GPU; drop the offload, or use "
                    f"train.backend=deepspeed (ZeRO-Offload)")
        if self.engine == "ddp" and (tp > 1 or pp > 1):
            return (f"{KEYS['tp']}/{KEYS['pp']}: train.backend=ddp is data parallel only "
                    f"(tp = pp = 1); use train.backend=fsdp for tensor or pipeline parallelism")
        if self.engine == "fsdp" and offload:
            return (f"{KEYS['offload_optimizer']}/{KEYS['offload_params']}: the fsdp trainer has "
                    f"no CPU offload; use train.backend=deepspeed (ZeRO-Offload), or more GPUs")
        if self.engine != "deepspeed" or (tp == 1 and pp == 1):
            return None
        if tp > 1 and pp > 1:
            return (f"{KEYS['tp']} × {KEYS['pp']}: DeepSpeed cannot combine AutoTP (TP={tp}) "
                    f"with its PipelineModule (PP={pp}); use train.backend=fsdp, which runs "
                    f"TP × PP × DP, or keep one of the two at 1")
        if tp > 1 and (self.zero_stage or 0) > 2:
            return (f"{KEYS['zero_stage']}: DeepSpeed's AutoTP (TP={tp}) trains with ZeRO 0-2, "
                    f"not ZeRO-{self.zero_stage}; set {KEYS['zero_stage']} ≤ 2 or "
                    f"train.backend=fsdp")
        if pp > 1 and (self.zero_stage or 0) > 1:
            return (f"{KEYS['zero_stage']}: ZeRO-{self.zero_stage} cannot be combined with a "
                    f"pipeline ({KEYS['pp']}={pp}): DeepSpeed's PipelineEngine supports ZeRO stage "
                    f"0 or 1 only; set {KEYS['zero_stage']}=1, or {KEYS['pp']}=1 with ZeRO-3, or "
                    f"train.backend=fsdp")
        if offload:
            return (f"{KEYS['offload_optimizer']}/{KEYS['offload_params']}: DeepSpeed's tensor "
                    f"and pipeline parallelism run without offload; set both to false, or "
                    f"{KEYS['tp']}={KEYS['pp']}=1")
        return None

    def label(self) -> str:
        """Short human name of a resolved strategy, e.g. ``ZeRO-2 + optimizer offload``."""
        if self.engine == "deepspeed":
            base = "DP (ZeRO-0)" if self.zero_stage == 0 else f"ZeRO-{self.zero_stage}"
        elif self.engine == "ddp":
            base = "DDP"
        else:
            base = f"FSDP {self.fsdp_sharding}"
        parts = [base]
        if self.offload_optimizer and self.offload_params:
            parts.append("optimizer + param offload")
        elif self.offload_optimizer:
            parts.append("optimizer offload")
        elif self.offload_params:
            parts.append("param offload")
        if (self.tp or 1) > 1:
            parts.append(f"TP={self.tp}")
        if (self.pp or 1) > 1:
            parts.append(f"PP={self.pp}")
        return " + ".join(parts)
