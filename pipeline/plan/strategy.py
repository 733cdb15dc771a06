"""The ``auto`` ladder: the least-communication configuration that fits, with every rejection.

Ladder (ZeRO paper §5, ZeRO-Offload, Megatron-LM): plain data parallel → ZeRO-1 →
ZeRO-2 / FSDP SHARD_GRAD_OP → ZeRO-3 / FULL_SHARD → + optimizer offload → + parameter offload
→ tensor parallelism inside a node → pipeline parallelism across nodes. Each step trades more
communication (or PCIe traffic, or pipeline bubbles) for memory, so the first rung that fits is
the cheapest one that fits. Fields the user fixed in the requested :class:`Strategy` filter the
ladder; when nothing is left the request itself is the only rung.

Activation checkpointing is the "time for memory" rung (the seed guide's §6.2): when the
request leaves it open (``BatchSpec.activation_checkpointing=None``) every group of rungs with
one layout is tried without it first, then with it — so a data-parallel rung that fits with
checkpointing is chosen before any TP or PP rung (:func:`with_checkpointing`).

The ladder holds only rungs the engine trains (:meth:`Strategy.unsupported`): fsdp runs TP × PP
× DP without offload; DeepSpeed runs AutoTP (ZeRO ≤ 2) or a PipelineModule (ZeRO ≤ 1), never
both, neither with offload; ddp is data parallel only. plan.md says which rungs were left out
and why (:func:`skipped_rungs`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import groupby
from typing import Any

from pipeline.config.presets import ModelShape
from pipeline.errors import PipelineError
from pipeline.plan.memory import ACCOUNTINGS, Accounting, MemoryBreakdown, estimate_memory
from pipeline.plan.spec import GB, BatchSpec, Cluster, Strategy
from pipeline.plan.topology import ParallelDims, resolve_grad_accum


@dataclass(kw_only=True, frozen=True)
class Rung:
    """One candidate configuration, its memory and whether it fits."""

    strategy: Strategy
    """The resolved strategy (no ``None`` left)."""

    dims: ParallelDims
    """The layout it implies (DP = world / (TP × PP), accumulation resolved for that DP)."""

    memory: MemoryBreakdown
    """Per-GPU bytes and host bytes per node."""

    fits: bool
    """Whether GPU total and host RAM are within budget (after headroom)."""

    reason: str
    """Why it was rejected, or ``fits``."""

    comm_bytes: int
    """Rough bytes each GPU sends per optimizer step (network + PCIe), for the report."""

    activation_checkpointing: bool = False
    """Whether this rung recomputes decoder layers in backward."""

    checkpointing_chosen: bool = False
    """Whether the planner chose ``activation_checkpointing`` (the request left it open)."""

    def label(self) -> str:
        """The strategy's label, plus activation checkpointing when the planner turned it on."""
        extra = " + activation checkpointing" if (self.activation_checkpointing
                                                  and self.checkpointing_chosen) else ""
        return self.strategy.label() + extra

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {"strategy": self.label(), "fits": self.fits, "reason": self.reason,
                "tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp,
                "activation_checkpointing": self.activation_checkpointing,
                "comm_bytes_per_gpu_per_step": self.comm_bytes,
                "memory": self.memory.as_dict()}


@dataclass(kw_only=True, frozen=True)
class Plan:
    """The planner's answer: chosen strategy, its memory, every rejected rung."""

    model: ModelShape
    """The model planned for."""

    cluster: Cluster
    """The machines."""

    batch: BatchSpec
    """Batch, sequence and precision settings of the chosen rung (activation checkpointing
    resolved); what the engine configs are rendered from."""

    request: Strategy
    """What the user asked for (``None`` = auto)."""

    accounting: str
    """``paper`` or ``deepspeed``."""

    headroom: float
    """Fraction of GPU and host memory kept free."""

    chosen: Rung
    """The selected rung (the first that fits; the requested/closest one when none fits)."""

    rejected: tuple[Rung, ...] = ()
    """Rungs tried before ``chosen`` and why each was rejected."""

    suggestion: Rung | None = None
    """When ``chosen`` does not fit: the first rung of the unconstrained ladder that does."""

    notes: tuple[str, ...] = field(default=())
    """Warnings and explanations for plan.md."""

    @property
    def strategy(self) -> Strategy:
        """The chosen resolved strategy."""
        return self.chosen.strategy

    @property
    def dims(self) -> ParallelDims:
        """The chosen layout."""
        return self.chosen.dims

    @property
    def memory(self) -> MemoryBreakdown:
        """The chosen rung's memory."""
        return self.chosen.memory

    @property
    def fits(self) -> bool:
        """Whether the chosen rung fits."""
        return self.chosen.fits

    @property
    def unsupported(self) -> str | None:
        """Why the chosen engine cannot train the chosen rung (a pinned request), or ``None``."""
        return self.strategy.unsupported()

    def train_settings(self) -> dict[str, Any]:
        """The ``train.*`` keys that make the trainer run the chosen rung (the render stage
        writes them into ``config.json``): sharding, offload, layout, checkpointing."""
        s = self.strategy
        out: dict[str, Any] = {"offload_optimizer": bool(s.offload_optimizer),
                               "offload_params": bool(s.offload_params),
                               "tp": self.dims.tp, "pp": self.dims.pp,
                               "activation_checkpointing": bool(
                                   self.batch.activation_checkpointing)}
        if s.engine == "deepspeed":
            out["zero_stage"] = s.zero_stage or 0
        elif s.engine == "fsdp":
            out["fsdp_sharding"] = s.fsdp_sharding
        return out

    @property
    def gpu_budget(self) -> int:
        """Bytes per GPU available to the job after the reserve and the headroom."""
        return gpu_budget(self.cluster, self.headroom)

    @property
    def host_budget(self) -> int:
        """Host bytes per node available after the headroom."""
        return host_budget(self.cluster, self.headroom)

    def as_dict(self) -> dict[str, Any]:
        """``--json`` output: per-GPU bytes, host bytes per node, the chosen strategy."""
        mem = self.memory
        return {
            "model": self.model.name,
            "num_params": self.model.num_params(),
            "accounting": self.accounting,
            "strategy": self.chosen.label(),
            "engine": self.strategy.engine,
            "zero_stage": self.strategy.zero_stage,
            "fsdp_sharding": self.strategy.fsdp_sharding,
            "offload_optimizer": self.strategy.offload_optimizer,
            "offload_params": self.strategy.offload_params,
            "activation_checkpointing": bool(self.batch.activation_checkpointing),
            "fits": self.fits,
            "unsupported": self.unsupported,
            "topology": {"nodes": self.dims.nodes, "gpus_per_node": self.dims.gpus_per_node,
                         "world_size": self.dims.world, "tp": self.dims.tp, "pp": self.dims.pp,
                         "dp": self.dims.dp, "micro_batch_size": self.dims.micro_batch_size,
                         "grad_accum": self.dims.grad_accum,
                         "global_batch_size": self.dims.global_batch_size},
            # Model states (params + grads + optimizer) as one figure beside its parts: the
            # ZeRO paper's Table 1 figure, what DeepSpeed's estimators return.
            "per_gpu_bytes": {"params": mem.params, "grads": mem.grads,
                              "optimizer": mem.optimizer, "model_states": mem.model_states,
                              "activations": mem.activations, "buffers": mem.buffers,
                              "total": mem.total},
            "gpu_budget_bytes": self.gpu_budget,
            "host_bytes_per_node": mem.host_per_node,
            "host_offload_bytes_per_node": mem.host_offload_per_node,
            "host_budget_bytes": self.host_budget,
            "rejected": [r.as_dict() for r in self.rejected],
            "suggestion": self.suggestion.label() if self.suggestion else None,
            "notes": list(self.notes),
        }


def gpu_budget(cluster: Cluster, headroom: float) -> int:
    """(GPU memory − reserve) × (1 − headroom), bytes."""
    return int((cluster.gpu_mem_gb - cluster.gpu_reserved_gb) * GB * (1 - headroom))


def host_budget(cluster: Cluster, headroom: float) -> int:
    """Host RAM per node × (1 − headroom), bytes."""
    return int(cluster.host_mem_gb * GB * (1 - headroom))


# -- the ladder --------------------------------------------------------------------------------------
def _tp_candidates(model: ModelShape, cluster: Cluster) -> list[int]:
    # TP inside a node only, dividing both head counts (whole heads per rank) and the MLP width.
    return [t for t in (2, 4, 8, 16) if t <= cluster.gpus_per_node
            and cluster.gpus_per_node % t == 0 and model.num_heads % t == 0
            and model.num_kv_heads % t == 0 and model.intermediate_size % t == 0]


def _pp_candidates(model: ModelShape, cluster: Cluster) -> list[int]:
    # PP across nodes: whole nodes per stage, stages dividing the layers: the divisors ≥ 2 of
    # gcd(nodes, layers), found by iterating up to the layer count, never the node count
    # (cluster.nodes: 1e9 must not hang the planner). Tied embeddings cannot be pipelined (the
    # first and last stage would share one weight).
    from math import gcd

    if model.tie_word_embeddings:
        return []
    g = gcd(cluster.nodes, model.num_layers)
    return [p for p in range(2, g + 1) if g % p == 0]


def ladder(model: ModelShape, cluster: Cluster, engine: str = "deepspeed", *,
           pinned: bool = False) -> list[Strategy]:
    """The ordered ladder for one engine (before filtering by the request): only rungs the
    engine trains (:meth:`Strategy.unsupported` is ``None`` for each).

    ``pinned``: include rungs that only make sense when the user fixed a field (ZeRO-Offload on
    stages 1 and 2: when nothing is pinned the ZeRO-3 rungs before them fit whenever they do).
    """
    out: list[Strategy] = []
    tps, pps = _tp_candidates(model, cluster), _pp_candidates(model, cluster)
    if engine == "deepspeed":
        def ds(stage: int, oo: bool = False, op: bool = False, tp: int = 1,
               pp: int = 1) -> Strategy:
            return Strategy(engine="deepspeed", zero_stage=stage, offload_optimizer=oo,
                            offload_params=op, tp=tp, pp=pp)
        out += [ds(0), ds(1), ds(2), ds(3), ds(3, True), ds(3, True, True)]
        if pinned:
            out += [ds(1, True), ds(2, True)]
        # AutoTP trains with ZeRO 0-2 (ZeRO-0 is dominated by ZeRO-1: same traffic, more memory).
        out += [ds(stage, tp=t) for t in tps for stage in (1, 2)]
        # PipelineModule: ZeRO 0-1, and never together with AutoTP.
        out += [ds(1, pp=p) for p in pps]
    elif engine == "ddp":
        # DistributedDataParallel: one rung, nothing sharded or offloaded, data parallel only.
        out.append(Strategy(engine="ddp", offload_optimizer=False, offload_params=False, tp=1,
                            pp=1))
    else:
        def fs(sharding: str, tp: int = 1, pp: int = 1) -> Strategy:
            return Strategy(engine="fsdp", fsdp_sharding=sharding,  # type: ignore[arg-type]
                            offload_optimizer=False, offload_params=False, tp=tp, pp=pp)
        out += [fs("NO_SHARD"), fs("SHARD_GRAD_OP")]
        if cluster.nodes > 1:
            out.append(fs("HYBRID_SHARD"))  # less inter-node traffic than FULL_SHARD
        # No offload rung: the fsdp trainer has no CPU offload (skipped_rungs says so).
        out.append(fs("FULL_SHARD"))
        out += [fs("FULL_SHARD", tp=t) for t in tps]
        out += [fs("FULL_SHARD", tp=t, pp=p) for p in pps for t in [1, *tps]]
    assert all(s.unsupported() is None for s in out), [s.label() for s in out]
    return out


def with_checkpointing(strategies: Iterable[Strategy],
                       checkpointing: bool | None) -> list[tuple[Strategy, bool]]:
    """The ladder with activation checkpointing decided per rung.

    Pinned (``True``/``False``): every rung with that setting. Open (``None``): consecutive rungs
    of one layout (same TP, PP and offload) are tried without checkpointing, then again with it,
    before the next layout: recomputation (one more forward per layer, about a third more
    compute, no extra traffic) is cheaper than TP's per-layer all-reduces, PP's bubble or
    offload's PCIe round trips, but dearer than ZeRO's sharding, which costs no compute.
    """
    rungs = list(strategies)
    if checkpointing is not None:
        return [(s, checkpointing) for s in rungs]
    out: list[tuple[Strategy, bool]] = []

    def layout(s: Strategy) -> tuple[int, int, bool]:
        return (s.tp or 1, s.pp or 1, bool(s.offload_optimizer or s.offload_params))

    for _, group in groupby(rungs, key=layout):
        members = list(group)
        out += [(s, False) for s in members] + [(s, True) for s in members]
    return out


def skipped_rungs(model: ModelShape, cluster: Cluster, engine: str) -> list[str]:
    """Rungs the ladder leaves out for this engine and model, and why (for plan.md)."""
    tps, pps = _tp_candidates(model, cluster), _pp_candidates(model, cluster)
    out = []
    if engine == "deepspeed":
        if tps and pps:
            out.append("no TP × PP rungs: DeepSpeed cannot combine AutoTP with its "
                       "PipelineModule; train.backend=fsdp runs TP × PP × DP")
        if tps:
            out.append("TP rungs only with ZeRO-1/2 and no offload: DeepSpeed's AutoTP trains "
                       "with ZeRO 0-2, without offload")
        if pps:
            out.append("PP rungs only with ZeRO-1 and no offload: DeepSpeed's PipelineEngine "
                       "supports ZeRO 0-1, without offload")
    elif engine == "fsdp":
        out.append("no offload rung: the fsdp trainer has no CPU offload; train.backend="
                   "deepspeed has ZeRO-Offload")
    else:
        out.append("no sharding, offload, TP or PP rungs: train.backend=ddp is data parallel "
                   "only; train.backend=fsdp or deepspeed shard the model states")
    if engine != "ddp" and model.tie_word_embeddings and cluster.nodes > 1:
        out.append("no PP rungs: the model ties its embeddings, and a pipeline keeps the "
                   "embedding on the first stage and lm_head on the last")
    return ["ladder: " + line for line in out]


def _matches(candidate: Strategy, request: Strategy) -> bool:
    for name in ("zero_stage", "fsdp_sharding", "offload_optimizer", "offload_params", "tp",
                 "pp"):
        wanted = getattr(request, name)
        if wanted is not None and getattr(candidate, name) != wanted:
            return False
    return True


def _fill(request: Strategy) -> Strategy:
    """The request with every ``None`` replaced by the cheapest default."""
    defaults: dict[str, Any] = {"offload_optimizer": False, "offload_params": False, "tp": 1,
                                "pp": 1}
    if request.engine == "deepspeed":
        defaults["zero_stage"] = 1
    elif request.engine == "fsdp":
        defaults["fsdp_sharding"] = "FULL_SHARD"
    return replace(request, **{k: v for k, v in defaults.items()
                               if getattr(request, k) is None})


def _comm_bytes(strategy: Strategy, dims: ParallelDims, model: ModelShape, batch: BatchSpec,
                psi_local: int) -> int:
    """Bytes a GPU moves per optimizer step (ring collectives ≈ 1× the buffer each way).

    All-reduce = reduce-scatter + all-gather = 2Ψ; ZeRO-2 reduce-scatters every micro batch;
    ZeRO-3 / FULL_SHARD all-gather in forward and backward (3Ψ per micro batch, ZeRO §7);
    offload adds the PCIe round trip of gradients and parameters; TP all-reduces 4 activations
    per layer per micro batch (Megatron-LM: 2 forward + 2 backward); PP sends one activation per
    stage boundary each way.
    """
    pb = batch.param_bytes
    gas = dims.grad_accum
    if strategy.engine == "deepspeed":
        per = {0: 2 * psi_local, 1: 2 * psi_local, 2: psi_local * (gas + 1),
               3: 3 * psi_local * gas}[strategy.zero_stage or 0]
    elif strategy.engine == "ddp":
        # One bucketed all-reduce of the fp32 gradients per step (no_sync while accumulating).
        pb, per = 4, 2 * psi_local
    else:
        per = {"NO_SHARD": 2 * psi_local, "SHARD_GRAD_OP": psi_local * (gas + 1)}.get(
            strategy.fsdp_sharding or "", 3 * psi_local * gas)
    total = pb * per
    if strategy.offload_optimizer:
        total += 2 * pb * psi_local // max(1, dims.dp)
    if strategy.offload_params:
        total += 2 * pb * psi_local * gas // max(1, dims.dp)
    sbh = batch.seq_len * batch.micro_batch_size * model.hidden_size
    if dims.tp > 1:
        total += int(4 * pb * sbh * model.num_layers / dims.pp * 2 * (dims.tp - 1) / dims.tp
                     * gas)
    if dims.pp > 1:
        total += 2 * pb * sbh * gas
    return int(total)


def evaluate_rung(*, model: ModelShape, cluster: Cluster, batch: BatchSpec,
                  strategy: Strategy, accounting: Accounting = "deepspeed",
                  headroom: float = 0.10, fused_attention: bool = True,
                  checkpointing_chosen: bool = False) -> Rung:
    """Memory and fit of one resolved strategy (``batch.activation_checkpointing`` ``None``
    counts as off)."""
    from pipeline.plan.memory import local_params

    batch = replace(batch, activation_checkpointing=bool(batch.activation_checkpointing))
    tp, pp = strategy.tp or 1, strategy.pp or 1
    dp = max(1, cluster.world // (tp * pp))
    accum = resolve_grad_accum(micro_batch_size=batch.micro_batch_size, dp=dp,
                               grad_accum=batch.grad_accum,
                               global_batch_size=batch.global_batch_size)
    dims = ParallelDims(nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node, tp=tp, pp=pp,
                        micro_batch_size=batch.micro_batch_size, grad_accum=accum)
    mem = estimate_memory(model=model, dims=dims, strategy=strategy, batch=batch,
                          accounting=accounting, fused_attention=fused_attention)
    budget, hbudget = gpu_budget(cluster, headroom), host_budget(cluster, headroom)
    reasons = []
    if mem.total > budget:
        reasons.append(
            f"needs {mem.total / GB:.1f} GB/GPU > budget {budget / GB:.1f} GB "
            f"(short by {(mem.total - budget) / GB:.1f} GB: params {mem.params / GB:.1f}, "
            f"grads {mem.grads / GB:.1f}, optimizer {mem.optimizer / GB:.1f}, activations "
            f"{mem.activations / GB:.1f}, buffers {mem.buffers / GB:.1f})")
    if mem.host_per_node > hbudget:
        reasons.append(f"needs {mem.host_per_node / GB:.1f} GB host RAM/node > budget "
                       f"{hbudget / GB:.1f} GB (short by "
                       f"{(mem.host_per_node - hbudget) / GB:.1f} GB)")
    if (strategy.engine == "fsdp" and pp > 1 and strategy.pp_schedule == "1f1b"
            and accum < pp):
        # torch's 1F1B schedules refuse fewer micro batches than stages.
        reasons.append(f"1F1B needs grad_accum ≥ pp: {accum} micro batches < {pp} stages "
                       f"(raise train.grad_accum or use train.pp_schedule: gpipe)")
    comm = _comm_bytes(strategy, dims, model, batch, local_params(model, tp=tp, pp=pp))
    return Rung(strategy=strategy, dims=dims, memory=mem, fits=not reasons,
                reason="; ".join(reasons) or "fits", comm_bytes=comm,
                activation_checkpointing=bool(batch.activation_checkpointing),
                checkpointing_chosen=checkpointing_chosen)


def plan(*, model: ModelShape, cluster: Cluster, batch: BatchSpec,
         strategy: Strategy | None = None, accounting: Accounting = "deepspeed",
         headroom: float = 0.10, fused_attention: bool = True) -> Plan:
    """Choose a strategy (pure; no GPU, no process group).

    ``strategy`` fields left ``None`` are chosen by the ladder; fixed ones filter it; so is
    ``batch.activation_checkpointing`` (``None``: the planner decides). The result always has a
    ``chosen`` rung; ``Plan.fits`` says whether it fits, ``Plan.unsupported`` whether a pinned
    request is one the engine cannot train, and ``Plan.suggestion`` names the first
    unconstrained rung that fits when either goes wrong.
    """
    request = strategy or Strategy()
    if accounting not in ACCOUNTINGS:
        raise PipelineError(f"--accounting: {accounting!r} is not one of {', '.join(ACCOUNTINGS)}")
    if not 0 <= headroom < 1:
        raise PipelineError(f"headroom: must be in [0, 1), got {headroom!r}")
    checkpointing = batch.activation_checkpointing
    schedule = request.pp_schedule

    def rung(s: Strategy, ac: bool) -> Rung:
        return evaluate_rung(model=model, cluster=cluster,
                             batch=replace(batch, activation_checkpointing=ac),
                             strategy=replace(s, pp_schedule=schedule), accounting=accounting,
                             headroom=headroom, fused_attention=fused_attention,
                             checkpointing_chosen=checkpointing is not True)

    pinned = any(getattr(request, k) is not None for k in (
        "zero_stage", "fsdp_sharding", "offload_optimizer", "offload_params", "tp", "pp"))
    full = ladder(model, cluster, request.engine, pinned=pinned)
    candidates = [s for s in full if _matches(s, request)] or [_fill(request)]
    tried: list[Rung] = []
    chosen: Rung | None = None
    for cand, ac in with_checkpointing(candidates, checkpointing):
        r = rung(cand, ac)
        if r.fits:
            chosen = r
            break
        tried.append(r)
    notes: list[str] = []
    fitted = chosen is not None
    if chosen is None:
        # Nothing fits: report the last (most memory-frugal) rung of the request.
        chosen = tried.pop()
    suggestion = None
    if not fitted or chosen.strategy.unsupported():
        # The first rung that would fit without the user's constraints.
        for cand, ac in with_checkpointing(ladder(model, cluster, request.engine),
                                           None if checkpointing is not True else True):
            if (replace(cand, pp_schedule=schedule), ac) == (chosen.strategy,
                                                             chosen.activation_checkpointing):
                continue
            r = rung(cand, ac)
            if r.fits:
                suggestion = r
                break
    would = f"'{suggestion.label()}' would" if suggestion else (
        "none of the ladder's rungs fits either: more GPUs, a shorter sequence or a "
        "smaller micro batch are needed")
    if chosen.strategy.unsupported():
        notes.append(f"the requested '{chosen.label()}' is not one train.backend="
                     f"{request.engine} trains: {chosen.strategy.unsupported()}; "
                     + (f"'{suggestion.label()}' would fit" if suggestion else would))
    if not fitted:
        notes.append("no configuration within the request fits; " + would)
    notes.extend(_explanations(model, batch, chosen, accounting))
    notes.extend(_ladder_notes(model=model, cluster=cluster, request=request, chosen=chosen,
                               checkpointing=checkpointing, rung=rung))
    return Plan(model=model, cluster=cluster,
                batch=replace(batch, activation_checkpointing=chosen.activation_checkpointing),
                request=request, accounting=accounting, headroom=headroom, chosen=chosen,
                rejected=tuple(tried), suggestion=suggestion, notes=tuple(notes))


def _ladder_notes(*, model: ModelShape, cluster: Cluster, request: Strategy, chosen: Rung,
                  checkpointing: bool | None, rung: Any) -> list[str]:
    """Why checkpointing is on, what a pinned ``false`` costs, which rungs the engine skips."""
    out = []
    d = chosen.dims
    beyond_dp = d.tp > 1 or d.pp > 1 or bool(chosen.strategy.offload_optimizer
                                             or chosen.strategy.offload_params)
    if chosen.activation_checkpointing and checkpointing is None:
        out.append("activation checkpointing chosen by the planner (time for memory): no rung "
                   "of this layout fits without it, and recomputing each layer's forward (about "
                   "a third more compute) is tried before offload, TP and PP")
    if checkpointing is False and (beyond_dp or not chosen.fits):
        # Would a data-parallel rung fit if checkpointing were allowed?
        dp_only = [s for s in ladder(model, cluster, request.engine)
                   if (s.tp or 1) == 1 and (s.pp or 1) == 1 and not s.offload_optimizer
                   and not s.offload_params and _matches(s, replace(request, tp=None, pp=None))]
        for s in dp_only:
            r = rung(s, True)
            if r.fits:
                out.append(f"train.activation_checkpointing is false: with it, "
                           f"'{r.strategy.label()}' would fit "
                           f"({r.memory.total / GB:.1f} GB/GPU) without offload, TP or PP")
                break
    if beyond_dp or not chosen.fits or chosen.strategy.unsupported():
        out.extend(skipped_rungs(model, cluster, request.engine))
    return out


def _explanations(model: ModelShape, batch: BatchSpec, chosen: Rung,
                  accounting: str) -> list[str]:
    n = model.num_params()
    out = []
    if batch.precision != "fp32":
        out.append(
            f"mixed-precision Adam on one replica: {16 * n / GB:.0f} GB (ZeRO paper, 2+2+12 "
            f"bytes/param) or {20 * n / GB:.0f} GB (DeepSpeed, 2+18 incl. an fp32 gradient copy) "
            f"of model states before activations; a figure of ~10 bytes/param (e.g. 70 GB for "
            f"7B) forgets the fp32 master weights and Adam's two moments")
    if model.num_params_override is not None:
        out.append(f"model given by parameter count only: activations use a synthetic "
                   f"Llama-like shape ({model.num_layers} layers, hidden {model.hidden_size})")
    if chosen.dims.tp > 1 and chosen.strategy.engine == "deepspeed" and chosen.dims.pp == 1:
        out.append(f"DeepSpeed AutoTP: train_batch_size counts TP ranks "
                   f"({chosen.dims.deepspeed_train_batch_size} = micro × accum × world "
                   f"{chosen.dims.world}) although {chosen.dims.global_batch_size} distinct "
                   f"sequences are consumed per step; ranks of one TP group must read the same "
                   f"data")
    return out
