"""Parallel layout and batch arithmetic as one pure class (no process group needed).

Rank order is TP fastest, then DP, then PP (Megatron-LM / torchtitan convention): a TP group is
``tp`` consecutive ranks, so it stays inside one node when ``tp`` divides ``gpus_per_node``;
pipeline stages are the slowest dimension, so with ``pp`` dividing ``nodes`` each stage owns
whole nodes and only point-to-point activations cross the slower inter-node links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.errors import PipelineError
from pipeline.plan.spec import KEYS, check_count

if TYPE_CHECKING:
    from pipeline.config.presets import ModelShape


@dataclass(kw_only=True, frozen=True)
class ParallelDims:
    """World = TP × PP × DP, plus micro batch × accumulation × DP = global batch."""

    nodes: int
    """Nodes in the job."""

    gpus_per_node: int
    """Ranks per node."""

    tp: int = 1
    """Tensor-parallel degree (ranks of one TP group share the same data)."""

    pp: int = 1
    """Pipeline stages."""

    micro_batch_size: int = 1
    """Sequences per rank per forward/backward."""

    grad_accum: int = 1
    """Micro batches per optimizer step (DeepSpeed ``gradient_accumulation_steps``)."""

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node", "tp", "pp", "micro_batch_size", "grad_accum"):
            check_count(key, getattr(self, key))

    @property
    def world(self) -> int:
        """All ranks: nodes × GPUs per node."""
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """Data-parallel degree world / (TP × PP); only meaningful when :meth:`problems` is empty."""
        return max(1, self.world // (self.tp * self.pp))

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro × accumulation × DP (TP ranks share data)."""
        return self.micro_batch_size * self.grad_accum * self.dp

    @property
    def deepspeed_batch_world(self) -> int:
        """The world size DeepSpeed's batch assertion multiplies by.

        DeepSpeed 0.19 checks ``train_batch_size == micro * gas * world_size`` where, without an
        ``mpu``, ``world_size`` is *all* ranks, TP ranks included (AutoTP passes no mpu; seen in
        ../shared/notes/cpu-engines.md). With a pipeline, ``PipelineModule``'s grid is passed as
        ``mpu`` and ``world_size`` becomes its data-parallel size.
        """
        return self.dp if self.pp > 1 else self.world

    @property
    def deepspeed_train_batch_size(self) -> int:
        """``train_batch_size`` that DeepSpeed's assertion accepts (≠ samples/step when TP > 1)."""
        return self.micro_batch_size * self.grad_accum * self.deepspeed_batch_world

    def problems(self, *, num_layers: int | None = None, num_heads: int | None = None,
                 num_kv_heads: int | None = None) -> list[PipelineError]:
        """Every layout error at once, each naming its key and a fix."""
        out: list[PipelineError] = []
        if self.tp > self.gpus_per_node:
            out.append(PipelineError(
                f"{KEYS['tp']}: TP={self.tp} exceeds {KEYS['gpus_per_node']}={self.gpus_per_node}; "
                f"tensor parallelism needs NVLink-class bandwidth and must stay inside a node — "
                f"use tp ≤ {self.gpus_per_node} and add pipeline stages ({KEYS['pp']}) instead"))
        elif self.gpus_per_node % self.tp:
            out.append(PipelineError(
                f"{KEYS['tp']}: TP={self.tp} does not divide {KEYS['gpus_per_node']}="
                f"{self.gpus_per_node}, so a TP group would span two nodes; use a divisor of "
                f"{self.gpus_per_node}"))
        for what, count in (("attention heads", num_heads), ("KV heads", num_kv_heads)):
            if count is not None and count % self.tp:
                divisors = [d for d in range(1, count + 1) if count % d == 0
                            and d <= self.gpus_per_node]
                out.append(PipelineError(
                    f"{KEYS['tp']}: TP={self.tp} does not divide the model's {count} {what} "
                    f"(each TP rank must own whole heads); use one of {divisors}"))
        if num_layers is not None and self.pp > num_layers:
            # Uneven splits are fine (stage_layers gives the first stages one layer more); an
            # empty stage is not.
            out.append(PipelineError(
                f"{KEYS['pp']}: PP={self.pp} exceeds the model's {num_layers} layers; every "
                f"pipeline stage needs at least one decoder layer: use pp ≤ {num_layers}"))
        if self.world % (self.tp * self.pp):
            out.append(PipelineError(
                f"{KEYS['tp']} × {KEYS['pp']}: TP×PP={self.tp * self.pp} does not divide the "
                f"world size {self.world} (= {KEYS['nodes']} × {KEYS['gpus_per_node']}); "
                f"TP × PP × DP must equal the world size"))
        elif self.pp > 1 and self.nodes > 1 and self.nodes % self.pp and self.pp % self.nodes:
            out.append(PipelineError(
                f"{KEYS['pp']}: PP={self.pp} neither divides nor is a multiple of "
                f"{KEYS['nodes']}={self.nodes}; stages would straddle nodes unevenly"))
        return out

    def validate(self, **model: int | None) -> None:
        """Raise the first of :meth:`problems` (all of them, joined)."""
        errors = self.problems(**model)
        if errors:
            raise PipelineError("\n".join(str(e) for e in errors))


def batch_problems(*, dims: ParallelDims, global_batch_size: int | None) -> list[PipelineError]:
    """Global batch ≠ micro × accumulation × DP, with the nearest values that would work."""
    if global_batch_size is None or global_batch_size == dims.global_batch_size:
        return []
    per_step = dims.micro_batch_size * dims.dp
    lower = max(per_step, global_batch_size // per_step * per_step)
    upper = lower + per_step if lower < global_batch_size else lower
    accum_hint = (f"set {KEYS['grad_accum']}={global_batch_size // per_step}"
                  if global_batch_size % per_step == 0 else
                  f"set {KEYS['global_batch_size']} to a multiple of {per_step} "
                  f"(e.g. {lower} or {upper})")
    return [PipelineError(
        f"{KEYS['global_batch_size']}: {global_batch_size} ≠ {KEYS['micro_batch_size']} "
        f"({dims.micro_batch_size}) × {KEYS['grad_accum']} ({dims.grad_accum}) × data-parallel "
        f"degree ({dims.dp} = world {dims.world} / (TP {dims.tp} × PP {dims.pp})) = "
        f"{dims.global_batch_size}; {accum_hint}, or drop one of the two keys")]


def resolve_grad_accum(*, micro_batch_size: int, dp: int, grad_accum: int | None,
                       global_batch_size: int | None) -> int:
    """Accumulation steps from whichever of ``grad_accum`` / ``global_batch_size`` is given.

    When both are given ``grad_accum`` wins here and :func:`batch_problems` reports a mismatch.
    When only the global batch is given and it does not divide, the floor is used (≥ 1) and the
    mismatch is again reported by :func:`batch_problems`.
    """
    if grad_accum is not None:
        return grad_accum
    if global_batch_size is not None:
        return max(1, global_batch_size // (micro_batch_size * dp))
    return 1


def render_topology(dims: ParallelDims, *, seq_len: int) -> dict[str, Any]:
    """``topology.json``: the layout and the batch arithmetic, for humans and the train stage."""
    return {
        "nodes": dims.nodes,
        "gpus_per_node": dims.gpus_per_node,
        "world_size": dims.world,
        "tp": dims.tp,
        "pp": dims.pp,
        "dp": dims.dp,
        "rank_order": "tp fastest, then dp, then pp (a TP group = consecutive ranks in one node)",
        "micro_batch_size": dims.micro_batch_size,
        "grad_accum": dims.grad_accum,
        "global_batch_size": dims.global_batch_size,
        "seq_len": seq_len,
        "tokens_per_step": dims.global_batch_size * seq_len,
        "batch_formula": (f"global {dims.global_batch_size} = micro {dims.micro_batch_size} × "
                          f"accum {dims.grad_accum} × dp {dims.dp}"),
        "deepspeed_train_batch_size": dims.deepspeed_train_batch_size,
    }


# -- what each rank holds ------------------------------------------------------------------------
def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The decoder layers each pipeline stage owns: THE rule, shared by the planner and the
    trainers (torch-free, so the login node and the ranks compute the same split).

    Contiguous blocks in layer order, as equal as possible: stage ``s`` owns
    ``range(start_s, start_s + n_s)`` with ``n_s = num_layers // pp + (1 if s < num_layers % pp
    else 0)`` — when ``pp`` divides ``num_layers`` every stage gets ``num_layers / pp`` layers,
    otherwise the first ``num_layers % pp`` stages get one more. Contiguity keeps a stage's
    input the previous stage's output (one point-to-point send per boundary); putting the
    extra layers first leaves the last stage, which also holds the final norm and lm_head and
    computes the loss, the lighter block.
    """
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise PipelineError(f"model.num_layers: must be a positive integer, got {num_layers!r}")
    check_count("pp", pp)
    if pp > num_layers:
        raise PipelineError(
            f"{KEYS['pp']}: PP={pp} exceeds the model's {num_layers} layers; every pipeline "
            f"stage needs at least one decoder layer: use pp ≤ {num_layers}")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for stage in range(pp):
        count = base + (1 if stage < extra else 0)
        out.append(range(start, start + count))
        start += count
    return out


def _tp_split(what: str, size: int, tp: int, exact: bool = True) -> int:
    if size % tp and not exact:
        return -(-size // tp)  # the largest slice, for a memory estimate of a refused layout
    if size % tp:
        raise PipelineError(
            f"{KEYS['tp']}: TP={tp} does not divide the model's {what} ({size}); each TP rank "
            f"must own an equal slice: use a divisor of {size}")
    return size // tp


def layer_params_per_tp_rank(model: ModelShape, tp: int = 1, *, exact: bool = True) -> int:
    """Parameters of one decoder layer on one TP rank (every rank holds the same count).

    Megatron-LM's split, as DTensor's ``ColwiseParallel``/``RowwiseParallel`` apply it
    (``pipeline/train/tp.py``): q, k, v, gate and up are split on their output dimension
    (weight rows and bias), o and down on their input dimension (weight columns; their bias is
    added after the all-reduce, so it is replicated), and both RMSNorm weights are replicated.
    ``tp`` must divide the heads, the KV heads and the intermediate size (``exact=False``: the
    largest rank's slice of a layout the pre-flight refuses, for its memory estimate).
    """
    h, d, i = model.hidden_size, model.head_size, model.intermediate_size
    q_out = _tp_split("attention heads", model.num_heads, tp, exact) * d
    kv_out = _tp_split("KV heads", model.num_kv_heads, tp, exact) * d
    i_local = _tp_split("intermediate size", i, tp, exact)
    attn = h * q_out + 2 * h * kv_out + q_out * h
    if model.attention_bias:
        attn += q_out + 2 * kv_out + h  # q/k/v biases split, o bias whole
    mlp = 3 * h * i_local + ((2 * i_local + h) if model.mlp_bias else 0)
    return attn + mlp + 2 * h


def params_per_rank(model: ModelShape, *, tp: int = 1, pp: int = 1,
                    exact: bool = True) -> dict[tuple[int, int], int]:
    """Model parameters each rank holds before data-parallel sharding, keyed by
    ``(pp_stage, tp_rank)``.

    - decoder layers: :func:`stage_layers` decides which stage owns which layer; each layer is
      split over TP as :func:`layer_params_per_tp_rank` says;
    - ``embed_tokens`` on the first stage, the final norm and ``lm_head`` on the last, all
      replicated over TP (the fsdp trainer's TP plan shards the decoder layers only);
    - with ``pp == 1`` a tied ``lm_head`` is the embedding, counted once (as ``transformers``
      does); a pipeline needs untied embeddings (the first and last stage each hold one).

    The sum over the stages of one TP rank, with ``tp == 1``, is ``model.num_params()``.
    Architecture counts: a ``--params`` shape's override is not applied here. ``exact=False``
    (the memory planner, for a layout the pre-flight refuses anyway) rounds TP slices up instead
    of raising.
    """
    per_stage = params_per_stage(model, tp=tp, pp=pp, exact=exact)
    return {(s, r): count for s, count in enumerate(per_stage) for r in range(tp)}


def params_per_stage(model: ModelShape, *, tp: int = 1, pp: int = 1,
                     exact: bool = True) -> list[int]:
    """Parameters one TP rank of each pipeline stage holds (every TP rank of a stage holds the
    same count): :func:`params_per_rank` without a key per TP rank (the planner's estimate
    needs only the largest)."""
    if pp > 1 and model.tie_word_embeddings:
        raise PipelineError(
            f"{KEYS['pp']}: PP={pp} with tied embeddings: the embedding lives on the first stage "
            f"and lm_head on the last, so they cannot share one weight; set "
            f"model.tie_word_embeddings: false, or {KEYS['pp']}=1")
    check_count("tp", tp)
    per_layer = layer_params_per_tp_rank(model, tp, exact=exact)
    h = model.hidden_size
    embed = model.vocab_size * h
    head = h + (0 if model.tie_word_embeddings else model.vocab_size * h)
    out = []
    for s, layers in enumerate(stage_layers(model.num_layers, pp)):
        count = len(layers) * per_layer
        if s == 0:
            count += embed
        if s == pp - 1:
            count += head
        out.append(count)
    return out
