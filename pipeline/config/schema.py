"""The one source of truth for experiment configuration.

A config file has a shared part (``data``, ``model``, ``cluster``, ``train``) and a ``runs:``
table. Each run is the shared part with that run's overrides deep-merged on top, so one config
describes a batch of experiments that share one tokenized dataset.

Config files are read, merged (a later file's ``runs:`` replaces the earlier runs as a whole)
and checked by :mod:`pipeline.config.files` (which imports this module, never the other way);
``python -m pipeline.config check|schema`` is :mod:`pipeline.config.__main__`.

The JSON schema (``config/schema.json``, for editors and docs) is generated from these classes
(``python -m pipeline.config schema``); ``tests/test_config.py`` fails when it is stale.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.config.types import (  # re-exported: the config's value sets and limits
    MAX_GLOBAL_BATCH,
    MAX_GPU_MEM_GB,
    MAX_GPUS_PER_NODE,
    MAX_GRAD_ACCUM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_HOST_MEM_GB,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_LR,
    MAX_MICRO_BATCH,
    MAX_NODES,
    MAX_POSITIONS,
    MAX_PP,
    MAX_SEQ_LEN,
    MAX_SHARDS,
    MAX_SOURCES,
    MAX_STEPS,
    MAX_TP,
    MAX_VOCAB_SIZE,
    RUN_NAME_RE,
    SOURCE_NAME_RE,
    Accounting,
    AttnImplementation,
    Backend,
    Beta,
    Device,
    DocSplit,
    FsdpSharding,
    OnExhausted,
    OnInvalid,
    PathStr,
    PipelineSchedule,
    Precision,
    SourceFormat,
    StrategyMode,
    Tracker,
    _Strict,
    check_model_parallel,
)
from pipeline.config.types import MAX_PARAMS as MAX_PARAMS
from pipeline.config.types import MAX_WORLD as MAX_WORLD
from pipeline.config.types import format_errors as _format_errors
from pipeline.errors import PipelineError
from pipeline.io import deep_merge


class SourceConfig(_Strict):
    """One input corpus: a path or glob of text files."""

    name: str | None = None
    """The source's name in ``train.mixture``, the manifest's per-source counts and the report
    (letters, digits, ``_ . -``); default ``source<i>`` by position."""
    path: PathStr
    """File, directory or glob. A leading ``<stdlib>`` expands to the Python standard library's
    source directory (the embedded default corpus, present on every machine)."""
    format: SourceFormat = "auto"
    """Input format; ``auto`` decides by file extension (``.gz``/``.zst`` are looked through).
    ``arrow``: Arrow IPC files; a folder ``datasets``' ``save_to_disk`` wrote names its own."""
    text_field: str = Field("text", min_length=1)
    """JSONL field / Parquet column holding the document text."""
    doc_split: DocSplit = "file"
    """For txt: one document per file, or one per blank-line-separated block."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not SOURCE_NAME_RE.fullmatch(value):
            raise ValueError(f"{value!r} must match {SOURCE_NAME_RE.pattern}")
        return value


class TokenizerConfig(_Strict):
    """Which tokenizer to use: a local one, or a byte-level BPE trained by the pipeline."""

    path: PathStr | None = None
    """A local HF tokenizer directory or ``tokenizer.json``. ``null`` trains a byte-level BPE."""
    vocab_size: int = Field(1024, ge=260, le=MAX_VOCAB_SIZE)
    """Vocabulary size of the trained BPE (ignored when ``path`` is set)."""
    train_max_bytes: int = Field(20_000_000, gt=0, le=1 << 40)
    """At most this many bytes of the corpus are read to train the BPE."""


class DataConfig(_Strict):
    """Raw text → packed token sequences."""

    sources: list[SourceConfig] = Field(min_length=1, max_length=MAX_SOURCES)
    """The corpora. Each source is read with its own options and tokenized into its own
    shards (``data.shards`` jobs per source) of one dataset and vocabulary; ``train.mixture``
    weighs them per run."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """Tokenizer settings."""
    seq_len: int = Field(128, ge=2, le=MAX_SEQ_LEN)
    """Tokens per packed training sequence."""
    shards: int = Field(2, ge=1, le=MAX_SHARDS)
    """Number of parallel tokenize jobs (and shard files) per source."""
    val_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    """Fraction of documents held out for validation (chosen by a hash of each document)."""
    on_invalid: OnInvalid = "skip"
    """Documents that are not valid UTF-8 (or bad JSONL lines): skip and count, or fail."""
    bos: bool = False
    """Prepend BOS to every document (EOS is always appended)."""

    @property
    def source_names(self) -> list[str]:
        """Each source's name: its ``name``, else ``source<i>`` by position."""
        return [s.name or f"source{i}" for i, s in enumerate(self.sources)]

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        names = self.source_names
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"data.sources: names must be unique, {dup} repeat")
        # Each source is tokenized by its own shard jobs with its own reading options, so
        # sources may differ in format, text_field and doc_split.
        return self


#: ModelConfig keys a preset fills (explicit keys in the config win).
_PRESET_KEYS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_layers",
    "num_heads": "num_heads",
    "num_kv_heads": "num_kv_heads",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "rope_theta": "rope_theta",
}


def model_base(base: dict[str, Any], override: Any) -> dict[str, Any]:
    """The earlier ``model`` section under a later one: a ``preset`` or ``init_from`` in the
    later section is a whole model, so the earlier section's shape (its ``_PRESET_KEYS``, its
    own preset or ``init_from``) gives way; keys given beside the preset in the later section
    still win, and settings that are not the shape (``attn_implementation``) stay."""
    if not isinstance(override, dict) or not (override.get("preset") or override.get("init_from")):
        return base
    drop = {*_PRESET_KEYS, "preset", "init_from"}
    return {k: v for k, v in base.items() if k not in drop}


class ModelConfig(_Strict):
    """A Llama-style causal LM built from a config (no hub download), or a local HF model."""

    preset: str | None = None
    """Architecture numbers from a named preset (``llama2-7b``, ``llama3-8b``, ``mistral-7b``,
    ``tiny``, …; see ``python -m pipeline.plan --help``); keys set here override it. The
    vocabulary always comes from the tokenizer."""
    init_from: PathStr | None = None
    """A local HF model directory to continue training from; ``null`` builds from scratch."""
    hidden_size: int = Field(64, ge=8, le=MAX_HIDDEN)
    """Width of the residual stream."""
    intermediate_size: int = Field(172, ge=8, le=MAX_INTERMEDIATE)
    """Width of the MLP."""
    num_layers: int = Field(2, ge=1, le=MAX_LAYERS)
    """Number of decoder layers."""
    num_heads: int = Field(4, ge=1, le=MAX_HEADS)
    """Attention heads."""
    num_kv_heads: int | None = Field(None, ge=1, le=MAX_HEADS)
    """Key/value heads (grouped-query attention); ``null`` means equal to ``num_heads``."""
    max_position_embeddings: int = Field(256, ge=2, le=MAX_POSITIONS)
    """Longest sequence the rotary embedding is set up for."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output projection."""
    rope_theta: float = Field(10000.0, gt=0, le=1e12)
    """Base of the rotary position embedding."""
    attn_implementation: AttnImplementation = "sdpa"
    """Attention kernel used in training (``eager`` makes logits comparisons exact)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("preset"):
            return data
        from pipeline.config.presets import PRESETS

        name = data["preset"]
        if name not in PRESETS:
            raise ValueError(f"model.preset: unknown preset {name!r}; known: {sorted(PRESETS)}")
        shape = PRESETS[name]
        filled = {key: getattr(shape, attr) for key, attr in _PRESET_KEYS.items()}
        return {**filled, **data}

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_heads ({self.num_heads})"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"model.hidden_size / model.num_heads ({self.hidden_size} / {self.num_heads}) "
                "must be even: the rotary embedding rotates pairs of each head's dimensions"
            )
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({kv})"
            )
        return self


class ClusterConfig(_Strict):
    """Where training runs. Locally, 'GPUs' are CPU processes."""

    nodes: int = Field(1, ge=1, le=MAX_NODES)
    """Number of nodes (one ``torchrun`` per node)."""
    gpus_per_node: int = Field(2, ge=1, le=MAX_GPUS_PER_NODE)
    """Processes per node: GPUs on a GPU node, CPU processes on a CPU node."""
    device: Device = "auto"
    """``auto`` uses CUDA when every process of a node has a GPU of its own (``gpus_per_node``
    GPUs visible), else the CPU with gloo; ``cuda`` requires them; ``cpu`` never uses one."""
    gpu_mem_gb: float = Field(80.0, gt=0, le=MAX_GPU_MEM_GB)
    """Memory of one GPU, for the memory plan."""
    host_mem_gb: float = Field(256.0, gt=0, le=MAX_HOST_MEM_GB)
    """Host RAM of one node, for the memory plan (offload)."""


class TrainConfig(_Strict):
    """Optimization and checkpointing."""

    backend: Backend = "fsdp"
    """Training engine: FSDP2 (``fully_shard``, DCP checkpoints), DeepSpeed (ZeRO), or ddp (torch
    DistributedDataParallel: full replicas, native AMP, DCP checkpoints)."""
    zero_stage: int = Field(1, ge=0, le=3)
    """DeepSpeed ZeRO stage (``backend: deepspeed``)."""
    fsdp_sharding: FsdpSharding = "FULL_SHARD"
    """FSDP2 sharding (``backend: fsdp``): FULL_SHARD (ZeRO-3-like), SHARD_GRAD_OP (keeps
    parameters gathered between forward and backward), HYBRID_SHARD (shard within a node,
    replicate across nodes), NO_SHARD (replicate: DDP-like)."""
    strategy: StrategyMode = "manual"
    """``auto``: the planner picks ZeRO stage / FSDP sharding, offload and activation
    checkpointing, the least communication that fits in memory (the choice is written to the
    rendered config.json). ``tp`` and ``pp`` stay as set: they change the data-parallel degree
    and so the global batch (``python -m pipeline.plan`` proposes them)."""
    offload_optimizer: bool = False
    """Keep optimizer states on the host (DeepSpeed ZeRO-Offload)."""
    offload_params: bool = False
    """Keep parameters on the host between uses (DeepSpeed ZeRO-3 only)."""
    tp: int = Field(1, ge=1, le=MAX_TP)
    """Tensor-parallel degree, inside a node: DTensor TP on ``backend: fsdp``, AutoTP on
    ``backend: deepspeed`` (ZeRO 0-2). It must divide gpus_per_node, the attention and KV heads
    and the MLP's intermediate size."""
    pp: int = Field(1, ge=1, le=MAX_PP)
    """Pipeline-parallel degree: ``torch.distributed.pipelining`` stages on ``backend: fsdp``,
    DeepSpeed's ``PipelineModule`` on ``backend: deepspeed`` (ZeRO 0-1). The decoder layers are
    split evenly over the stages; the micro batches of one step (``grad_accum``) flow through."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule on ``backend: fsdp`` (``gpipe``: all forwards, then all backwards;
    ``1f1b``: one forward one backward, less activation memory; it needs grad_accum >= pp).
    DeepSpeed runs its own 1F1B-style schedule."""
    precision: Precision = "fp32"
    """Compute precision; bf16/fp16 keep fp32 master weights (fp16 with loss scaling: DeepSpeed's,
    or ``torch.amp.GradScaler`` with ``backend: ddp``, which runs bf16/fp16 as autocast)."""
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    """Extra DeepSpeed config keys merged over the rendered ``ds_config.json`` (checked against
    the installed DeepSpeed at render time)."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in backward to save memory."""
    micro_batch_size: int = Field(8, ge=1, le=MAX_MICRO_BATCH)
    """Sequences per process per forward/backward."""
    grad_accum: int = Field(1, ge=1, le=MAX_GRAD_ACCUM)
    """Micro batches accumulated per optimizer step."""
    global_batch_size: int | None = Field(None, ge=1, le=MAX_GLOBAL_BATCH)
    """Sequences per optimizer step; if given it must equal micro × accumulation × data-parallel."""
    max_steps: int = Field(200, ge=1, le=MAX_STEPS)
    """Optimizer steps to train."""
    lr: float = Field(3e-3, gt=0, le=MAX_LR)
    """Peak learning rate, in (0, 1] (a run that diverges below that is stopped by the trainer at
    the first non-finite loss, with its last good checkpoint kept)."""
    warmup_steps: int = Field(10, ge=0, le=MAX_STEPS)
    """Linear warmup from 0 to ``lr``; then linear decay to 0 at ``max_steps``."""
    weight_decay: float = Field(0.1, ge=0, le=10.0)
    """AdamW weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    """AdamW betas, each in [0, 1)."""
    eps: float = Field(1e-8, gt=0, le=1.0)
    """AdamW epsilon."""
    grad_clip: float = Field(1.0, ge=0, le=1e6)
    """Clip the global gradient norm to this (0 disables)."""
    torch_adam: bool = True
    """DeepSpeed: use torch's AdamW instead of the JIT-compiled fused kernel."""
    checkpoint_every: int = Field(50, ge=1, le=MAX_STEPS)
    """Save a checkpoint every this many optimizer steps (and at the end)."""
    keep_last: int = Field(3, ge=1, le=10_000)
    """Complete checkpoints kept; older ones are deleted."""
    seed: int = Field(1234, ge=0, le=2**32 - 1)
    """Seed for weights init and the data order."""
    record_samples: bool = False
    """Write the sequence indices each rank consumed, per step, to ``samples-rankNNNNN.jsonl``
    (an audit of the data order across restarts)."""
    loss_scale_init: float = Field(65536.0, gt=0, le=2.0**32)
    """fp16 with ``backend: ddp``: the GradScaler's initial loss scale (halved on every step
    whose gradients overflow, which is then skipped)."""
    loss_scale_growth_interval: int = Field(2000, ge=1, le=MAX_STEPS)
    """fp16 with ``backend: ddp``: the loss scale doubles after this many steps without
    overflow."""
    compile: bool = False
    """Compile each decoder layer with ``torch.compile`` (torchtitan's approach: per layer, in
    place, so parameter names and checkpoints are unchanged). Every engine and layout but
    DeepSpeed ZeRO-3; on CPU Inductor needs a C++ compiler (``CXX``, default g++)."""
    trackers: list[Tracker] = Field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers that receive every metric, the evaluation results and the run config
    (``mlflow`` and ``wandb`` are optional extras: ``pip install -e '.[trackers]'``)."""
    mixture: dict[str, float] | None = None
    """Sampling weight of each data source by name (``data.sources[].name``); ``null``: in
    proportion to each source's tokens. Weights are relative (they need not sum to 1)."""
    on_source_exhausted: OnExhausted = "repeat"
    """When a source of the mixture runs out of sequences: start it over (a new epoch of that
    source, reshuffled), or stop training there."""
    checkpoint_async: bool = True
    """Save checkpoints in the background: training waits only while the rank's state is copied
    to host memory (pinned on GPUs, and kept there between saves: a second copy of the rank's
    model and optimizer states); the files, their fsync and the manifest follow in a background
    thread. At most one save is in flight (the next waits); a stop and the last step wait for it.
    fsdp/ddp: DCP's ``async_save``; deepspeed: its files staged, written by this pipeline."""

    @field_validator("mixture")
    @classmethod
    def _weights(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None:
            if not value:
                raise ValueError("give at least one source's weight, or null for proportional")
            bad = {k: w for k, w in value.items() if not w > 0}
            if bad:
                raise ValueError(f"weights must be > 0: {bad}")
        return value

    @field_validator("trackers")
    @classmethod
    def _unique_trackers(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"{value}: each tracker once")
        return value

    @field_validator("deepspeed")
    @classmethod
    def _finite_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Written into ds_config.json: JSON with finite numbers only (NaN is not JSON).
        import json

        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"must be plain JSON with finite numbers ({err})") from None
        return value

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"train.warmup_steps ({self.warmup_steps}) must be smaller than "
                f"train.max_steps ({self.max_steps})"
            )
        if self.offload_optimizer and self.backend != "deepspeed":
            raise ValueError("train.offload_optimizer needs train.backend: deepspeed")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("train.offload_optimizer needs train.zero_stage >= 1")
        if self.offload_params and (self.backend != "deepspeed" or self.zero_stage != 3):
            raise ValueError("train.offload_params needs train.backend: deepspeed and zero_stage: 3")
        if self.precision == "fp16" and self.backend == "fsdp":
            raise ValueError(
                "train.precision: fp16 needs loss scaling (backend: deepspeed, or ddp with a "
                "GradScaler); use bf16 with fsdp"
            )
        if self.deepspeed and self.backend != "deepspeed":
            raise ValueError("train.deepspeed: extra DeepSpeed keys need train.backend: deepspeed")
        if self.compile and self.backend == "deepspeed" and self.zero_stage == 3:
            raise ValueError(
                "train.compile with ZeRO-3: DeepSpeed gathers each submodule's parameters in a "
                "forward hook torch.compile cannot trace; use train.zero_stage <= 2, backend fsdp "
                "(FULL_SHARD shards like ZeRO-3) or train.compile: false")
        if self.tp > 1 or self.pp > 1:
            check_model_parallel(self)
        return self

class PlanConfig(_Strict):
    """How the render stage's memory planner judges a layout."""

    accounting: Accounting = "deepspeed"
    """Model-state accounting: DeepSpeed's own estimators, or the ZeRO paper's (K = 12)."""
    headroom: float = Field(0.10, ge=0.0, lt=1.0)
    """Fraction of GPU and host memory kept free."""
    enforce_memory: bool = True
    """A layout that does not fit is an error (on CPU-only runs the plan is advisory)."""


class RunConfig(_Strict):
    """One fully-resolved experiment: what one training job uses."""

    name: str
    """The run's name (its directory under ``results/runs/``)."""
    data: DataConfig
    """Data settings (shared by every run of a config)."""
    model: ModelConfig = ModelConfig()
    """Model settings."""
    cluster: ClusterConfig = ClusterConfig()
    """Cluster shape."""
    train: TrainConfig = TrainConfig()
    """Training settings."""
    plan: PlanConfig = PlanConfig()
    """Memory-planner settings."""

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: the world over the tensor- and pipeline-parallel degrees."""
        return self.world_size // (self.train.tp * self.train.pp)

    @property
    def global_batch_size(self) -> int:
        return self.train.micro_batch_size * self.train.grad_accum * self.dp_size

    @model_validator(mode="after")
    def _check_batch(self) -> RunConfig:
        t = self.train
        if t.global_batch_size is not None and t.global_batch_size != self.global_batch_size:
            raise ValueError(
                f"train.global_batch_size ({t.global_batch_size}) must equal "
                f"train.micro_batch_size ({t.micro_batch_size}) × train.grad_accum "
                f"({t.grad_accum}) × data-parallel degree ({self.dp_size} = cluster.nodes × "
                f"cluster.gpus_per_node / (train.tp × train.pp)) = {self.global_batch_size}; "
                "change one of them"
            )
        unknown = sorted(set(t.mixture or {}) - set(self.data.source_names))
        if unknown:
            raise ValueError(
                f"train.mixture names {unknown}, which are not data sources: the sources are "
                f"{self.data.source_names} (set data.sources[].name)"
            )
        if t.pp > 1 and self.model.tie_word_embeddings:
            raise ValueError(
                f"train.pp ({t.pp}) with model.tie_word_embeddings: the embedding lives on the "
                "first pipeline stage and the LM head on the last, so they cannot share one "
                "weight; set model.tie_word_embeddings: false"
            )
        if t.pp > self.model.num_layers:
            raise ValueError(
                f"train.pp ({t.pp}) exceeds model.num_layers ({self.model.num_layers}): every "
                "pipeline stage needs at least one decoder layer"
            )
        if self.data.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_position_embeddings "
                f"({self.model.max_position_embeddings})"
            )
        if not RUN_NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"run name {self.name!r} must match {RUN_NAME_RE.pattern} (it becomes a "
                "directory and a Slurm job name)"
            )
        return self


class Config(_Strict):
    """A config file: shared settings plus a table of runs."""

    data: DataConfig
    """Data settings, shared by every run."""
    model: ModelConfig = ModelConfig()
    """Default model settings for every run."""
    cluster: ClusterConfig = ClusterConfig()
    """Default cluster shape for every run."""
    train: TrainConfig = TrainConfig()
    """Default training settings for every run."""
    plan: PlanConfig = PlanConfig()
    """Default memory-planner settings for every run."""
    runs: dict[str, RunOverrides] = Field(default_factory=lambda: {"main": RunOverrides()},
                                          min_length=1, max_length=10_000)
    """Run name → overrides of ``model``/``cluster``/``train`` for that run (``{}`` or an
    empty entry: none). A config file that has ``runs:`` replaces the runs of the files merged
    before it as a whole; every other section is deep-merged."""

    @model_validator(mode="before")
    @classmethod
    def _empty_runs_entries(cls, data: Any) -> Any:
        # `runs: {small: }` (YAML null) is a run without overrides, as `small: {}` is.
        if isinstance(data, dict) and isinstance(data.get("runs"), dict):
            runs = {k: ({} if v is None else v) for k, v in data["runs"].items()}
            return {**data, "runs": runs}
        return data

    @field_validator("runs")
    @classmethod
    def _check_run_names(cls, runs: dict[str, Any]) -> dict[str, Any]:
        # A run name becomes results/runs/<name>/, a Slurm job name and a Snakemake wildcard
        # value: no path separators, spaces, shell metacharacters or line breaks; and two names
        # must not collide on a case-insensitive file system.
        seen: dict[str, str] = {}
        for name in runs:
            if not isinstance(name, str) or not RUN_NAME_RE.fullmatch(name):
                raise ValueError(
                    f"run name {name!r} must match {RUN_NAME_RE.pattern} (letters, "
                    "digits, '_', '.', '-'; it becomes a directory and a Slurm job name)"
                )
            if name.lower() in seen:
                raise ValueError(
                    f"run names {seen[name.lower()]!r} and {name!r} differ only in "
                    "case (their directories collide on a case-insensitive file system)"
                )
            seen[name.lower()] = name
        return runs

    def run_names(self) -> list[str]:
        return list(self.runs)

    def run(self, name: str) -> RunConfig:
        """The effective config of one run (shared settings with its overrides on top)."""
        if name not in self.runs:
            raise PipelineError(f"unknown run {name!r}; the config defines {sorted(self.runs)}")
        base = self.model_dump(mode="json", exclude={"runs"})
        over = self.runs[name].model_dump(exclude_none=True)
        base["model"] = model_base(base["model"], over.get("model"))
        # Python mode: JSON mode would turn an override's .inf/.nan into null, silently.
        merged = deep_merge(base, over)
        return _validate(RunConfig, {"name": name, **merged}, where=f"runs.{name}.")


class RunOverrides(_Strict):
    """Per-run overrides; any key of ``model``, ``cluster``, ``train`` or ``plan``."""

    model: dict[str, Any] | None = None
    """Overrides of ``model`` for this run."""
    cluster: dict[str, Any] | None = None
    """Overrides of ``cluster`` for this run."""
    train: dict[str, Any] | None = None
    """Overrides of ``train`` for this run."""
    plan: dict[str, Any] | None = None
    """Overrides of ``plan`` for this run."""


Config.model_rebuild()

#: Where each class's fields live in a config file (for help texts and messages).
_SECTION: dict[type[BaseModel], str] = {
    SourceConfig: "data.sources[]",
    TokenizerConfig: "data.tokenizer",
    DataConfig: "data",
    ModelConfig: "model",
    ClusterConfig: "cluster",
    TrainConfig: "train",
    PlanConfig: "plan",
}


def _validate(cls: type[BaseModel], raw: Any, where: str = "") -> Any:
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        raise PipelineError("invalid config:\n" + _format_errors(err, where)) from None


def json_schema() -> dict[str, Any]:
    """The JSON schema of a config file, generated from the classes above."""
    schema = Config.model_json_schema()
    schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    return schema
