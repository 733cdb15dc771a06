"""The config's building blocks: value sets (one ``Literal`` per choice), limits, and the strict
base class every config section derives from. :mod:`pipeline.config.schema` re-exports all of it;
import from there."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from pipeline.artifacts import MAX_SEQ_LEN as _MAX_SEQ_LEN
from pipeline.artifacts import MAX_VOCAB_SIZE as _MAX_VOCAB_SIZE

#: Run names become directory names and Slurm job names: keep them boring. Matched with
#: ``fullmatch`` (``$`` alone would let a trailing newline through).
RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

#: Sane maxima. Beyond them a value is a typo or an attack, not an experiment: the planner, the
#: tokenizer and the launcher allocate or iterate in proportion to these numbers. Every size
#: and count of the config has one (the schema's fields, the planner's inputs and the stage
#: CLIs' options that mirror a field all check these).
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 1024
#: Tensor parallelism stays inside a node.
MAX_TP = MAX_GPUS_PER_NODE
MAX_LAYERS = 4096
#: Every pipeline stage holds at least one decoder layer.
MAX_PP = MAX_LAYERS
#: All ranks of a job; the data-parallel degree (and an HSDP group) is at most this.
MAX_WORLD = MAX_NODES * MAX_GPUS_PER_NODE
MAX_GPU_MEM_GB = 100_000
MAX_HOST_MEM_GB = 1_000_000
MAX_HEADS = 4096
MAX_HIDDEN = 1 << 17
MAX_INTERMEDIATE = 1 << 20
MAX_POSITIONS = 1 << 24
MAX_MICRO_BATCH = 1 << 20
MAX_GRAD_ACCUM = 1 << 20
MAX_GLOBAL_BATCH = 1 << 30
MAX_STEPS = 10**10
MAX_SOURCES = 1024
MAX_SHARDS = 100_000
#: The largest model ``python -m pipeline.plan --params`` sizes (100 T parameters).
MAX_PARAMS = 10**14
#: A learning rate above 1 is a typo (1e-3 written as 1e3), not an experiment.
MAX_LR = 1.0
#: The data manifest's limits are the contract's (its reader sits below the config).
MAX_SEQ_LEN = _MAX_SEQ_LEN
MAX_VOCAB_SIZE = _MAX_VOCAB_SIZE

# The value sets of the config's choices, defined once: the planner (pipeline.plan.spec), the
# stage CLIs and the readers take them from here.
SourceFormat = Literal["auto", "txt", "jsonl", "parquet", "arrow"]
DocSplit = Literal["file", "blank-line"]
OnInvalid = Literal["skip", "fail"]
Device = Literal["auto", "cpu", "cuda"]
Backend = Literal["fsdp", "deepspeed", "ddp"]
FsdpSharding = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
StrategyMode = Literal["manual", "auto"]
Precision = Literal["fp32", "bf16", "fp16"]
Accounting = Literal["deepspeed", "paper"]
AttnImplementation = Literal["eager", "sdpa"]
PipelineSchedule = Literal["gpipe", "1f1b"]
Tracker = Literal["tensorboard", "mlflow", "wandb"]
OnExhausted = Literal["repeat", "stop"]
#: A data source's name: a key of ``train.mixture``, part of shard file names.
SOURCE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("a path must not contain a NUL character")
    return value


#: A file-system path in a config: not empty, no NUL byte.
PathStr = Annotated[str, Field(min_length=1), AfterValidator(_no_nul)]
#: An Adam beta: a decay rate in [0, 1).
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
#: Field types that a boolean must not stand in for.
_NUMBERS = (int, float, int | None, float | None)


class _Strict(BaseModel):
    # extra="forbid": an unknown key is an error, not silently ignored.
    # use_attribute_docstrings: the docstring under each field becomes its schema description.
    # allow_inf_nan=False: .inf / .nan / Infinity are refused in every float field.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # Lax mode reads true/false as 1/0 (`lr: true` would train at lr 1): a typo, not a number.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and field.annotation in _NUMBERS:
            raise ValueError("expected a number, not a boolean")
        return value


def format_errors(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        path = where + ".".join(str(p) for p in e["loc"]) if e["loc"] else where.rstrip(".")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling against config/schema.json)"
        elif e["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"  {path or '<top level>'}: {msg}" + _got(e))
    return "\n".join(lines)


def _got(e: dict[str, Any]) -> str:
    if e["type"] in ("extra_forbidden", "missing") or isinstance(e.get("input"), dict):
        return ""
    return f" (got {e.get('input')!r})"


def check_model_parallel(t: Any) -> None:
    """Which layouts each engine runs (``TrainConfig``'s check when tp or pp > 1); the
    planner's ladder offers the same rungs only."""
    what = f"train.tp ({t.tp})" if t.tp > 1 else f"train.pp ({t.pp})"
    if t.backend == "ddp":
        raise ValueError(
            f"{what}: backend ddp keeps a full replica per process (no tensor or pipeline "
            "parallelism); use train.backend: fsdp, which runs TP × PP × DP"
        )
    if t.backend == "deepspeed":
        if t.tp > 1 and t.pp > 1:
            raise ValueError(
                f"train.tp ({t.tp}) with train.pp ({t.pp}): DeepSpeed cannot combine "
                "AutoTP with its PipelineModule; use train.backend: fsdp for TP × PP × DP"
            )
        if t.tp > 1 and t.zero_stage > 2:
            raise ValueError(
                f"train.tp ({t.tp}): DeepSpeed's AutoTP trains with ZeRO 0-2; set "
                "train.zero_stage <= 2 (or use train.backend: fsdp)"
            )
        if t.pp > 1 and t.zero_stage > 1:
            raise ValueError(
                f"train.pp ({t.pp}): DeepSpeed's pipeline engine allows ZeRO 0-1 only; "
                "set train.zero_stage <= 1 (or use train.backend: fsdp)"
            )
        if t.offload_optimizer or t.offload_params:
            raise ValueError(
                f"{what}: DeepSpeed's tensor and pipeline parallelism run without offload; "
                "set train.offload_optimizer and train.offload_params to false"
            )
    if t.backend == "fsdp" and t.pp > 1 and t.pp_schedule == "1f1b" \
            and t.grad_accum < t.pp:
        raise ValueError(
            f"train.pp_schedule 1f1b needs at least one micro batch per stage: "
            f"train.grad_accum ({t.grad_accum}) < train.pp ({t.pp}); raise "
            "train.grad_accum or use train.pp_schedule: gpipe"
        )
