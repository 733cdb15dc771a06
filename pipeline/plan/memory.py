"""Per-GPU and per-node host memory of one training configuration, in bytes.

Two accountings of the *model states* (parameters, gradients, optimizer states):

``paper``
    ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054, §3.1 and Figure 1): mixed-precision Adam
    keeps 2Ψ bytes of fp16 parameters, 2Ψ of fp16 gradients and KΨ of optimizer states with
    K = 12 (fp32 master weights, momentum, variance). Per GPU with N_d data-parallel ranks:
    baseline (2+2+K)Ψ, P_os 4Ψ + KΨ/N_d, P_os+g 2Ψ + (2+K)Ψ/N_d, P_os+g+p (4+K)Ψ/N_d.
    For Ψ = 7.5 B, N_d = 64 this gives the paper's 120 → 31.4 → 16.6 → 1.9 GB.

``deepspeed``
    What DeepSpeed 0.19 itself counts in ``estimate_zero2_model_states_mem_needs`` and
    ``estimate_zero3_model_states_mem_needs`` (deepspeed/runtime/zero/stage_1_and_2.py,
    stage3.py): 18 bytes per parameter in the partitioned part, "2 grads16 + 4 grads32 + 4
    params32 + 8 optimizer states", i.e. DeepSpeed keeps an fp32 gradient partition that the
    paper's K = 12 leaves out; ZeRO-3 adds 4 × the largest module (gathered fp16 working
    buffers); host RAM carries DeepSpeed's 1.5 "additional buffer factor". For the FSDP engine
    this accounting describes FSDP2's own storage instead (fp32 sharded parameters that double as
    master weights, fp32 reduced gradients, Adam m and v, bf16 unsharded working layers), and for
    the ddp engine DDP's (everything whole on every GPU: 4 + 4 + 8 bytes/param fp32, plus the
    autocast copy of the weights with bf16/fp16).

That is also why the seed guide's ≈ 70 GB for a 7 B model is wrong: 70 GB is ~10 bytes per
parameter (fp16 weights + fp16 grads + one fp32 copy), but mixed-precision Adam needs at least
16 bytes (2 + 2 + 12: paper, 112 GB) and DeepSpeed's implementation 20 (140 GB) before any
activation — on one GPU or per rank of plain data parallelism.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), §4: per layer, 16-bit, ``sbh(34 + 5as/h)`` bytes
without parallelism, ``sbh(10 + 24/t + 5as/(ht))`` with tensor parallelism ``t`` and
``sbh/t (34 + 5as/h)`` with sequence parallelism; full recomputation keeps ``2sbh`` per layer;
with 1F1B pipelining the first stage holds ``p`` micro batches of its ``L/p`` layers (§4.2.3),
i.e. as much as the whole unpipelined model (GPipe: every micro batch of the step). :func:`layer_activation_bytes` derives those
coefficients term by term so that Llama's SwiGLU MLP, GQA, no dropout and fused (SDPA/flash)
attention can be plugged in; with GPT's settings it returns exactly the paper's expression.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, get_args

from pipeline.config.presets import ModelShape
from pipeline.config.schema import Accounting
from pipeline.errors import PipelineError
from pipeline.plan.spec import BatchSpec, Strategy
from pipeline.plan.topology import ParallelDims, layer_params_per_tp_rank, params_per_stage

ACCOUNTINGS: tuple[str, ...] = get_args(Accounting)

#: ZeRO paper's optimizer-state multiplier for mixed-precision Adam (fp32 master + m + v).
PAPER_K = 12
#: DeepSpeed's per-parameter bytes in the partitioned part: 2 grads16 + 4 grads32 + 4 params32
#: + 8 optimizer states (comment in ``estimate_zero2_model_states_mem_needs``).
DEEPSPEED_PARTITIONED = 18
#: DeepSpeed's host-RAM estimation factor (``additional_buffer_factor`` default).
DEEPSPEED_HOST_BUFFER_FACTOR = 1.5
#: With ``overlap_comm`` DeepSpeed keeps about 4.5 × the bucket sizes in flight (DeepSpeed
#: config docs for ``overlap_comm``; HF's DeepSpeed guide: 5e8 buckets → 9 GB =
#: 5e8 × 2 bytes × 2 buckets × 4.5).
OVERLAP_COMM_FACTOR = 4.5
#: cuBLAS and cuBLASLt workspaces, 32 MiB each on Hopper (torch 2.11), taken from the caching
#: allocator at the first matmul and kept: 67.1 MB more than the model states after a step of
#: the tiny model on an H200 (docs/benchmarks/gpu.md), where its states are 9 MB.
CUDA_WORKSPACE_BYTES = 2 * 32 * 2**20
#: ``DistributedDataParallel``'s default gradient bucket (``bucket_cap_mb=25``).
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(kw_only=True, frozen=True)
class MemoryBreakdown:
    """Bytes per GPU by category, plus host RAM per node."""

    params: int
    """Parameters resident on the GPU (incl. gathered working layers for ZeRO-3/FSDP)."""

    grads: int
    """Gradients resident on the GPU (16-bit and fp32 partitions)."""

    optimizer: int
    """Optimizer states on the GPU (fp32 master weights where separate, Adam m and v)."""

    activations: int
    """Activations of the micro batches in flight (peak)."""

    buffers: int
    """Communication buckets (reduce/all-gather) and other engine working buffers."""

    grads_persistent: int | None = None
    """Part of ``grads`` kept from one step to the next (DDP's bucket views, ZeRO-3's 16-bit
    partition); the rest exists only from backward to the optimizer step. None: all of it."""

    grads_backward: int | None = None
    """Part of ``grads`` present at the end of backward, beside the buffers (ZeRO-1/2 keep only
    the 16-bit gradients then; the fp32 ones appear in the step). None: all of it."""

    layer_activations: int = 0
    """One layer's activations, alive with the gradients and buffers at the end of backward."""

    persistent_buffers: int = 0
    """Kept for the whole run, at every moment of a step: the CUDA libraries' workspaces
    (:data:`CUDA_WORKSPACE_BYTES`) and ZeRO-3's gradient bucket, allocated at start-up."""

    host_per_node: int
    """Host RAM per node for offloaded states and start-up copies (DeepSpeed's estimate)."""

    host_offload_per_node: int
    """Part of ``host_per_node`` that stays resident during training (offloaded states)."""

    notes: tuple[str, ...] = ()
    """Why a number is what it is (shown in plan.md)."""

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states: what DeepSpeed's estimators return."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The peak on one GPU: parameters and optimizer states, plus the largest of three
        moments of a step (measured on an H200, docs/benchmarks/gpu.md: the parts do not all
        coexist) - the loss, with every activation and only the persistent gradients; the end of
        backward, with the gradients there, the buffers and one layer's activations; the
        optimizer step, with every gradient and no activations."""
        persistent = self.grads if self.grads_persistent is None else self.grads_persistent
        backward = self.grads if self.grads_backward is None else self.grads_backward
        return self.params + self.optimizer + self.persistent_buffers + max(
            persistent + self.activations,
            backward + self.buffers + self.layer_activations,
            self.grads)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready bytes (and ``total``/``model_states``)."""
        out = asdict(self)
        out["notes"] = list(self.notes)
        out["model_states"] = self.model_states
        out["total"] = self.total
        return out


# -- parameters per GPU before data-parallel sharding ---------------------------------------------
def _scaled(model: ModelShape, count: int) -> int:
    # A ``--params N`` shape only approximates N with its architecture: scale to the exact N.
    if model.num_params_override is None:
        return count
    return int(count * model.num_params() / max(1, model._architecture_params()))


def _untied_for_pipeline(model: ModelShape, pp: int) -> ModelShape:
    # A pipeline cannot share one weight between the first and last stage; the pre-flight
    # refuses tied embeddings with pp > 1, and the memory of such a request counts two copies.
    if pp > 1 and model.tie_word_embeddings:
        return replace(model, tie_word_embeddings=False)
    return model


def local_params(model: ModelShape, *, tp: int = 1, pp: int = 1) -> int:
    """Parameters the busiest GPU owns before ZeRO/FSDP sharding: the largest entry of
    :func:`~pipeline.plan.topology.params_per_stage` (the engines' own split: decoder layers
    split over TP, embedding, norms and lm_head replicated over TP; layers over stages by
    :func:`~pipeline.plan.topology.stage_layers`, the embedding on the first stage, the final
    norm and lm_head on the last)."""
    if tp == 1 and pp == 1:
        return model.num_params()
    # A refused layout (pp > layers, tp not dividing the heads) still gets an estimate: the
    # pre-flight names the problem.
    pp = min(pp, model.num_layers)
    return _scaled(model, max(params_per_stage(_untied_for_pipeline(model, pp), tp=tp, pp=pp,
                                               exact=False)))


def decoder_unit_params(model: ModelShape, *, tp: int = 1, pp: int = 1) -> int:
    """Parameters of the largest FSDP wrap unit on one GPU: a decoder layer (its TP slice), or
    the embedding or final norm + lm_head (whole on every TP rank: TP splits decoder layers
    only). Without a pipeline the root unit holds embedding and lm_head together; the larger
    of the two is counted, as the planner always has (a known underestimate of the root's
    gathered copy, kept so that choices do not shift outside the TP/PP change)."""
    model = _untied_for_pipeline(model, pp)
    h = model.hidden_size
    root = max(model.embedding_params(), h + model.lm_head_params())
    return _scaled(model, max(layer_params_per_tp_rank(model, tp, exact=False), root))


# -- activations -------------------------------------------------------------------------------------
def layer_activation_bytes(*, seq_len: int, micro_batch: int, hidden: int, heads: int,
                           kv_heads: int | None = None, intermediate: int | None = None,
                           tp: int = 1, sequence_parallel: bool = False, gated_mlp: bool = True,
                           dropout: bool = False, fused_attention: bool = True) -> float:
    """Bytes of 16-bit activations one decoder layer keeps for backward (no recomputation).

    Term by term as Korthikanti et al. 2022 §4.1 (s = seq, b = micro batch, h = hidden,
    a = heads, t = TP degree):

    - replicated across TP ranks (inputs of column-parallel linears, norms, dropout masks):
      QKV input 2sbh + MLP input 2sbh + two norm inputs 4sbh + two dropout masks 2sbh = 10sbh
    - divided by t: Q, K 4sbh + V 2sbh + output-projection input 2sbh + MLP inner 16sbh = 24sbh
      (GeLU input and output, 2 × 2 bytes × 4h). SwiGLU keeps gate, up, silu(gate) and their
      product: 4 × 2 bytes × I. GQA shrinks K and V by kv_heads/heads.
    - attention scores, divided by t: softmax output 2as²b (+ dropout mask as²b and output 2as²b
      with dropout) = 5as²b. A fused kernel (SDPA/flash) keeps no s×s matrix, only the fp32
      log-sum-exp, 4asb.

    With GPT's settings (intermediate = 4h, gated_mlp=False, dropout=True, fused_attention=False,
    kv_heads = heads) this equals ``sbh(10 + 24/t + 5as/(ht))`` exactly, and
    ``sbh/t·(34 + 5as/h)`` with sequence parallelism.
    """
    s, b, h, a = seq_len, micro_batch, hidden, heads
    kv = heads if kv_heads is None else kv_heads
    inter = 4 * h if intermediate is None else intermediate
    sbh = s * b * h
    replicated = (2 + 2 + 4 + (2 if dropout else 0)) * sbh
    mlp_inner = (8 if gated_mlp else 4) * s * b * inter
    sharded = 2 * sbh + 2 * 2 * sbh * kv / a + 2 * sbh + mlp_inner
    scores = 4 * a * s * b if fused_attention else (5 if dropout else 2) * a * s * s * b
    if sequence_parallel:
        return (replicated + sharded + scores) / tp
    return replicated + (sharded + scores) / tp


#: Bytes per layer HF's Llama keeps beyond the count of :func:`layer_activation_bytes`, in units
#: of sbh, measured on an H200 (bench/gpu.py, 1.1 B Llama, s = 2048, b = 8; docs/benchmarks/
#: gpu.md): its RMSNorm computes in fp32 (an fp32 copy of each norm's input and the 16-bit
#: normalized tensor are saved, where the count has one 16-bit input) and SDPA saves its own
#: output beside o_proj's contiguous input. With 16-bit parameters (FSDP2's MixedPrecision,
#: DeepSpeed bf16/fp16): 6sbh. Under autocast over fp32 parameters (DDP's mixed precision) the
#: residual stream and the norms stay fp32 and the matmul inputs are extra 16-bit casts: 16sbh.
HF_EXTRA_SBH_16BIT_PARAMS = 6
HF_EXTRA_SBH_AUTOCAST = 16
#: The output side per token and vocabulary entry at its peak, mixed precision: cross entropy's
#: backward in fp32 (HF's loss upcasts the logits) - the saved log-softmax 4, the dense
#: gradient nll_loss hands back 4, log-softmax's exp(output) 4 and its result 4 (measured as
#: above: 15.9 for the 1.1 B model, vocabulary 27,076; ~13 for the tiny one, vocabulary 2,048).
OUTPUT_SBV_MIXED = 16


def hf_extra_sbh(engine: str, precision: str) -> int:
    """:data:`HF_EXTRA_SBH_16BIT_PARAMS` or :data:`HF_EXTRA_SBH_AUTOCAST` for this engine and
    precision; 0 in fp32 (not measured: the fp32 figures are the count doubled)."""
    if precision == "fp32":
        return 0
    return HF_EXTRA_SBH_AUTOCAST if engine == "ddp" else HF_EXTRA_SBH_16BIT_PARAMS


def layer_bytes(*, model: ModelShape, batch: BatchSpec, dims: ParallelDims,
                sequence_parallel: bool = False, fused_attention: bool = True,
                extra_sbh: int = 0) -> float:
    """One decoder layer's activations on one GPU (16-bit count + ``extra_sbh``·sbh), in the
    run's precision (fp32 doubles them)."""
    s, b, h, t = batch.seq_len, batch.micro_batch_size, model.hidden_size, dims.tp
    per_layer = layer_activation_bytes(
        seq_len=s, micro_batch=b, hidden=h, heads=model.num_heads, kv_heads=model.num_kv_heads,
        intermediate=model.intermediate_size, tp=t, sequence_parallel=sequence_parallel,
        fused_attention=fused_attention)
    per_layer += extra_sbh * s * b * h / (t if sequence_parallel else 1)
    return per_layer * (2 if batch.precision == "fp32" else 1)


def activation_bytes(*, model: ModelShape, batch: BatchSpec, dims: ParallelDims,
                     sequence_parallel: bool = False, fused_attention: bool = True,
                     pp_schedule: str = "1f1b", extra_sbh: int = 0) -> int:
    """Peak activation bytes on the busiest GPU for one configuration.

    Without recomputation every local layer keeps :func:`layer_activation_bytes` (+
    ``extra_sbh``·sbh: :func:`hf_extra_sbh`). With activation checkpointing (HF
    ``gradient_checkpointing`` per decoder layer) each layer keeps only its input, 2sbh
    (Korthikanti §4, "full recomputation"), and one layer's full set is rebuilt at a time during
    backward. The output side is added for the stage holding lm_head: final-norm and lm_head
    inputs 4sbh and :data:`OUTPUT_SBV_MIXED`·sbV (fp32 runs: bf16-free 10sbV, doubled) — whole
    on every TP rank, since the engines keep lm_head replicated over TP (no vocab-parallel
    loss). fp32 training doubles every figure.
    """
    s, b, h, t = batch.seq_len, batch.micro_batch_size, model.hidden_size, dims.tp
    scale = 2 if batch.precision == "fp32" else 1
    per_layer = layer_bytes(model=model, batch=batch, dims=dims,
                            sequence_parallel=sequence_parallel,
                            fused_attention=fused_attention, extra_sbh=extra_sbh) / scale
    layers = math.ceil(model.num_layers / dims.pp)
    if batch.activation_checkpointing:
        kept = 2 * s * b * h / (t if sequence_parallel else 1)
        # The layer being recomputed exists only in backward (MemoryBreakdown's end-of-backward
        # moment counts it); a pipeline stage keeps it with its micro batches in flight.
        stage = layers * kept + (per_layer if dims.pp > 1 else 0)
    else:
        stage = layers * per_layer
    # 1F1B: the first stage has min(p, micro batches per step) micro batches in flight (§4.2.3);
    # GPipe runs every forward of the step before the first backward: all of them.
    if dims.pp == 1:
        in_flight = 1
    elif pp_schedule == "gpipe":
        in_flight = dims.grad_accum
    else:
        in_flight = min(dims.pp, dims.grad_accum)
    first_stage = stage * in_flight
    vocab_coef = 10 if batch.precision == "fp32" else OUTPUT_SBV_MIXED
    output = 4 * s * b * h + vocab_coef * s * b * model.vocab_size
    last_stage = stage + output
    peak = max(first_stage, last_stage) if dims.pp > 1 else stage + output
    return int(peak * scale)


# -- model states ------------------------------------------------------------------------------------
def _shard_degrees(strategy: Strategy, dims: ParallelDims) -> tuple[int, int, int]:
    """Data-parallel degree over which (params, grads, optimizer states) are partitioned."""
    dp = dims.dp
    if strategy.engine == "ddp":
        return (1, 1, 1)  # DistributedDataParallel replicates everything
    if strategy.engine == "deepspeed":
        stage = strategy.zero_stage
        return (dp if stage == 3 else 1, dp if stage >= 2 else 1, dp if stage >= 1 else 1)
    sharding = strategy.fsdp_sharding
    if sharding == "NO_SHARD":
        return (1, 1, 1)
    if sharding == "HYBRID_SHARD":
        # Shard inside a node, replicate across nodes (HSDP mesh (replicate, shard)).
        shard = math.gcd(dp, max(1, dims.gpus_per_node // dims.tp))
        return (shard, shard, shard)
    if sharding == "SHARD_GRAD_OP":
        # Parameters are stored sharded but stay gathered from forward to backward
        # (reshard_after_forward=False): at the peak each GPU holds them whole.
        return (1, dp, dp)
    return (dp, dp, dp)


def estimate_memory(*, model: ModelShape, dims: ParallelDims, strategy: Strategy,
                    batch: BatchSpec, accounting: Accounting = "deepspeed",
                    fused_attention: bool = True) -> MemoryBreakdown:
    """Memory of one resolved strategy on one layout (pure; bytes)."""
    if accounting not in ACCOUNTINGS:
        raise PipelineError(f"accounting: {accounting!r} is not one of {', '.join(ACCOUNTINGS)}")
    assert strategy.is_resolved, "estimate_memory needs a resolved strategy (a ladder rung)"
    psi = local_params(model, tp=dims.tp, pp=dims.pp)
    p_shard, g_shard, os_shard = _shard_degrees(strategy, dims)
    pb = batch.param_bytes
    mixed = batch.precision != "fp32"
    notes: list[str] = []
    gpn = dims.gpus_per_node
    off_opt = bool(strategy.offload_optimizer)
    off_par = bool(strategy.offload_params)

    if accounting == "paper":
        # ZeRO §3.1: 2Ψ params + 2Ψ grads + KΨ optimizer (fp32 training: 4 + 4 + 8, K = 8).
        k = PAPER_K if mixed else 8
        params, grads, optim = pb * psi / p_shard, pb * psi / g_shard, k * psi / os_shard
        host = 0.0
        if off_opt:
            # ZeRO-Offload (Ren et al. 2021): fp16 gradients go down to the CPU, the fp32
            # optimizer states and the update live there.
            host += (grads + optim) * gpn
            grads, optim = 0.0, 0.0
        if off_par:
            host += params * gpn
            params = 0.0
        notes.append(f"paper accounting: model states = {pb}+{pb}+{k} bytes/param "
                     f"(K = {k}), no gathered-layer buffers, no host start-up copy")
        host_offload = host
    elif strategy.engine == "deepspeed":
        params, grads, optim, host, host_offload = _deepspeed_states(
            psi=psi, largest=_largest(model, dims), stage=strategy.zero_stage,
            dp=dims.dp, world=dims.world, gpn=gpn, nodes=dims.nodes, pb=pb, mixed=mixed,
            off_opt=off_opt, off_par=off_par)
    elif strategy.engine == "ddp":
        params, grads, optim, host, host_offload = _ddp_states(psi=psi, pb=pb, mixed=mixed)
    else:
        params, grads, optim, host, host_offload = _fsdp_states(
            psi=psi, unit=decoder_unit_params(model, tp=dims.tp, pp=dims.pp),
            shards=(p_shard, g_shard, os_shard),
            sharding=strategy.fsdp_sharding, gpn=gpn, pb=pb, mixed=mixed,
            offload=off_opt or off_par)

    extra = hf_extra_sbh(strategy.engine, batch.precision)
    acts = activation_bytes(model=model, batch=batch, dims=dims,
                            sequence_parallel=False,  # the trainer's TP has no sequence parallelism yet
                            fused_attention=fused_attention,
                            # DeepSpeed's PipelineEngine runs its own 1F1B-style schedule.
                            pp_schedule=strategy.pp_schedule if strategy.engine == "fsdp"
                            else "1f1b", extra_sbh=extra)
    layer = layer_bytes(model=model, batch=batch, dims=dims, fused_attention=fused_attention,
                        extra_sbh=extra)
    buffers = _comm_buffers(strategy=strategy, psi=psi, pb=pb,
                            unit=decoder_unit_params(model, tp=dims.tp, pp=dims.pp))
    if batch.activation_checkpointing:
        notes.append("activation checkpointing: 2sbh per layer kept + one layer recomputed")
    persistent, backward = (None, None) if accounting == "paper" else _grad_phases(
        strategy, grads=grads, psi=psi, dp=dims.dp, mixed=mixed)
    return MemoryBreakdown(params=int(params), grads=int(grads), optimizer=int(optim),
                           activations=int(acts), buffers=int(buffers),
                           grads_persistent=None if persistent is None else int(persistent),
                           grads_backward=None if backward is None else int(backward),
                           layer_activations=0 if accounting == "paper" else int(layer),
                           persistent_buffers=0 if accounting == "paper" else int(
                               _persistent_buffers(strategy, pb=pb)),
                           host_per_node=int(host), host_offload_per_node=int(host_offload),
                           notes=tuple(notes))


def _persistent_buffers(strategy: Strategy, *, pb: int) -> float:
    """:data:`CUDA_WORKSPACE_BYTES`, and for ZeRO-3 its 16-bit gradient bucket of
    ``reduce_bucket_size`` elements, allocated whole at start-up whatever the model's size (0.40
    GB for a 0.7 M-parameter model on an H200 with the default 2e8)."""
    bucket = pb * strategy.reduce_bucket_size if strategy.engine == "deepspeed" \
        and strategy.zero_stage == 3 else 0
    return CUDA_WORKSPACE_BYTES + bucket


def _grad_phases(strategy: Strategy, *, grads: float, psi: int, dp: int,
                 mixed: bool) -> tuple[float, float]:
    """(kept between steps, present at the end of backward) parts of ``grads``, per engine, as
    measured on an H200 (docs/benchmarks/gpu.md: allocated after a step, and the peaks).
    FSDP2 frees its gradients after the step (``zero_grad(set_to_none)``); DDP's are its
    all-reduce buckets and stay; DeepSpeed ZeRO-0/1/2 keep none between steps and only the
    16-bit ones in backward (the fp32 copies are made in the step); ZeRO-3 keeps its 16-bit
    gradient partition allocated."""
    if strategy.engine == "ddp":
        return grads, grads
    if strategy.engine == "fsdp":
        return 0.0, grads
    g16 = (2 * psi / (dp if (strategy.zero_stage or 0) >= 2 else 1)) if mixed else 0.0
    if strategy.zero_stage == 3:
        kept = min(grads, 2 * psi / dp) if mixed else 0.0
        return kept, kept
    return 0.0, min(grads, g16)


def _largest(model: ModelShape, dims: ParallelDims) -> int:
    # DeepSpeed gathers one module at a time; TP splits it (vocab-parallel embedding too).
    return model.largest_layer_params() // dims.tp


def _deepspeed_states(*, psi: int, largest: int, stage: int | None, dp: int, world: int,
                      gpn: int, nodes: int, pb: int, mixed: bool, off_opt: bool,
                      off_par: bool) -> tuple[float, float, float, float, float]:
    """DeepSpeed's own per-GPU and per-node host figures (see module docstring).

    Stage 2 and 3 reproduce ``estimate_zero{2,3}_model_states_mem_needs`` (zero_init=True for
    stage 3, as HF/DeepSpeed build the model under ``zero.Init``) with Ψ = per-GPU slice and
    N = data-parallel degree. Stages 0 and 1 follow the same bookkeeping with nothing (0) or only
    the optimizer side (1) partitioned. fp32 training has no 16-bit copies: 4 + 4 + 8 bytes.
    """
    f = DEEPSPEED_HOST_BUFFER_FACTOR
    if not mixed:
        p16, g16, g32, p32, opt = 4, 0, 4, 0, 8
    else:
        p16, g16, g32, p32, opt = 2, 2, 4, 4, 8  # 2 + (2 + 4 + 4 + 8 = 18)
    assert stage is not None
    if stage == 3:
        gathered = 2 * p16 * largest  # 4 × largest layer: DeepSpeed's "largest_layer_memory"
        params = p16 * psi / dp + gathered
        # DeepSpeed keeps the 18 of ZeRO-2 for ZeRO-3 although fp16 params are now partitioned
        # too, so we read it as 2 (params16) + 4 (fp32 grads; fp16 grads live in the reduce
        # buckets) + 12 (params32 + m + v) = 18 per parameter over N.
        grads = g32 * psi / dp
        optim = (p32 + opt) * psi / dp
        host_init = largest * 4 * gpn * f
        host_off = 0.0
        if off_opt:
            grads, optim = 0.0, 0.0
            host_off = psi * 16 * gpn / dp * f
        if off_par:
            host_off = pb * psi * gpn / dp * f if not off_opt else psi * 18 * gpn / dp * f
            params = gathered
        host = host_off if off_opt else max(host_init, host_off)
        return params, grads, optim, host, host_off
    # Stages 0-2: the 16-bit parameters stay whole on every rank.
    grad_shard = dp if stage >= 2 else 1
    os_shard = dp if stage >= 1 else 1
    params = p16 * psi
    if stage == 1 and mixed:
        grads = g16 * psi + g32 * psi / os_shard  # fp16 grads whole, fp32 partition
    else:
        grads = (g16 + g32) * psi / grad_shard
    optim = (p32 + opt) * psi / os_shard
    host_init = psi * 4 * gpn * f  # every rank builds the fp32 model on the CPU first
    if off_opt:
        grads = g16 * psi if stage == 1 and mixed else 0.0
        optim = 0.0
        # DeepSpeed's ZeRO-2 estimator writes max(4 · total_gpus, 16) · Ψ · 1.5 per node; the
        # resident part is 16Ψ/N per rank (fp32 master, m, v, fp32 grads) and the start-up part
        # 4Ψ per rank, so per node max(4 · gpus_per_node, 16 · gpus_per_node / N) · Ψ · 1.5.
        # Identical on one node (gpus_per_node = total_gpus); across nodes DeepSpeed's total_gpus
        # counts other nodes' ranks, which this node does not host.
        host_off = 16 * psi * gpn / os_shard * f
        host = max(host_init, host_off)
        return params, grads, optim, host, host_off
    return params, grads, optim, host_init, 0.0


def _fsdp_states(*, psi: int, unit: int, shards: tuple[int, int, int], sharding: str | None,
                 gpn: int, pb: int, mixed: bool,
                 offload: bool) -> tuple[float, float, float, float, float]:
    """FSDP2 storage: fp32 sharded parameters (they are the master weights), fp32 gradients
    (``reduce_dtype=float32``), Adam m and v, plus unsharded compute-dtype working copies —
    two decoder layers (current + prefetched) with resharding after forward, the whole model with
    SHARD_GRAD_OP (``reshard_after_forward=False``). ``CPUOffloadPolicy`` moves sharded
    parameters, gradients and optimizer states to pinned host memory together."""
    p_shard, g_shard, os_shard = shards
    if sharding == "SHARD_GRAD_OP":
        # Stored sharded (over the optimizer's degree) but gathered whole from forward to
        # backward: a compute-dtype copy of everything; in fp32 the gathered copy is the param.
        master = 4 * psi / os_shard if mixed else 4 * psi / p_shard
        working = pb * psi if mixed else 0.0
    else:
        master = 4 * psi / p_shard
        working = 2 * pb * unit
    params = master + working
    grads = 4 * psi / g_shard
    optim = 8 * psi / os_shard
    if offload:
        host = (master + grads + optim) * gpn
        return working, 0.0, 0.0, host, host
    return params, grads, optim, 0.0, 0.0


def _ddp_states(*, psi: int, pb: int, mixed: bool) -> tuple[float, float, float, float, float]:
    """``DistributedDataParallel`` with native AMP, the ZeRO-0 baseline: fp32 parameters (the
    master weights) plus, with autocast, their bf16/fp16 copies cast in forward and kept for
    backward; fp32 gradients (they are the all-reduce buckets: ``gradient_as_bucket_view``);
    Adam m and v. Nothing is sharded or offloaded; the start-up copy on the host is not counted
    (as for FSDP2: the model is built on the host and moved)."""
    params = 4 * psi + (pb * psi if mixed else 0)
    return params, 4 * psi, 8 * psi, 0.0, 0.0


def _comm_buffers(*, strategy: Strategy, psi: int, pb: int, unit: int) -> float:
    """Communication buckets. DeepSpeed: reduce + all-gather (ZeRO-3: prefetch) buckets, capped
    at the model size, × 4.5 with ``overlap_comm``. FSDP: one layer's fp32 reduce-scatter
    buffer."""
    if strategy.engine == "fsdp":
        return 4 * unit
    if strategy.engine == "ddp":
        # The gradients are the buckets; the collective's working copy is about one bucket.
        return min(DDP_BUCKET_BYTES, 4 * psi)
    reduce = min(strategy.reduce_bucket_size, psi)
    gather = min(strategy.allgather_bucket_size, psi) if strategy.zero_stage else 0
    factor = OVERLAP_COMM_FACTOR if strategy.overlap_comm and strategy.zero_stage else 1.0
    return pb * (reduce + gather) * factor
