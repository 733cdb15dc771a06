"""Human-readable ``plan.md`` (pure text). The sbatch submission is ``pipeline.cluster.sbatch``'s."""

from __future__ import annotations

from pipeline.plan.deepspeed_config import SEED_KEY_MAPPING
from pipeline.plan.spec import GB
from pipeline.plan.strategy import Plan, Rung


def _gb(n: int) -> str:
    return f"{n / GB:.2f}"


def _row(r: Rung, verdict: str) -> str:
    m = r.memory
    return (f"| {r.label()} | {_gb(m.params)} | {_gb(m.grads)} | {_gb(m.optimizer)} | "
            f"{_gb(m.model_states)} | {_gb(m.activations)} | {_gb(m.buffers)} | "
            f"**{_gb(m.total)}** | {_gb(m.host_per_node)} | {verdict} |")


def render_plan_md(plan: Plan, data_line: str | None = None) -> str:
    """The plan as Markdown: inputs, chosen strategy, per-GPU breakdown, rejected rungs, notes.

    ``data_line``: a bullet on the training data placed after the training line (render's
    mixture line, :func:`pipeline.data.mixture.mixture_plan_line`; the planner alone has none)."""
    m, d, c, b = plan.model, plan.dims, plan.cluster, plan.batch
    # "model states" = params + grads + optimizer, the ZeRO paper's Table 1 figure.
    head = ("| strategy | params | grads | optimizer | model states | activations | buffers | "
            "total GB/GPU | host GB/node | verdict |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [
        f"# Plan: {m.name} on {c.nodes} × {c.gpus_per_node} GPUs",
        "",
        f"- Model: {m.name}, {m.num_params():,} parameters ({m.num_layers} layers, hidden "
        f"{m.hidden_size}, {m.num_heads} heads / {m.num_kv_heads} KV heads, vocab "
        f"{m.vocab_size}, tied embeddings: {m.tie_word_embeddings})",
        f"- Cluster: {c.nodes} node(s) × {c.gpus_per_node} GPUs of {c.gpu_mem_gb:g} GB, "
        f"{c.host_mem_gb:g} GB host RAM per node",
        f"- Training: seq {b.seq_len}, micro batch {d.micro_batch_size}, accumulation "
        f"{d.grad_accum}, global batch {d.global_batch_size} sequences "
        f"({d.global_batch_size * b.seq_len:,} tokens) per step, {b.precision}, activation "
        f"checkpointing {_checkpointing(plan)}",
        *([data_line] if data_line else []),
        f"- Accounting: `{plan.accounting}`; budget {_gb(plan.gpu_budget)} GB/GPU "
        f"({c.gpu_mem_gb:g} − {c.gpu_reserved_gb:g} reserved, {plan.headroom:.0%} headroom), "
        f"{_gb(plan.host_budget)} GB host/node",
        "",
        f"## Chosen: {plan.chosen.label()} ({_verdict(plan)})",
        "",
        f"Layout: world {d.world} = TP {d.tp} × PP {d.pp} × DP {d.dp} (TP inside a node). "
        f"Communication ≈ {plan.chosen.comm_bytes / GB:.1f} GB per GPU per step.",
        "",
        head,
        _row(plan.chosen, "chosen" if plan.fits else plan.chosen.reason),
        "",
    ]
    if plan.rejected:
        lines += ["## Rejected rungs (in ladder order)", "", head]
        lines += [_row(r, r.reason) for r in plan.rejected]
        lines.append("")
    if plan.suggestion is not None:
        lines += [f"Would fit: **{plan.suggestion.label()}** "
                  f"({_gb(plan.suggestion.memory.total)} GB/GPU).", ""]
    if plan.notes or plan.memory.notes:
        lines += ["## Notes", ""]
        lines += [f"- {n}" for n in (*plan.notes, *plan.memory.notes)]
        lines.append("")
    if plan.strategy.engine == "deepspeed" and (d.tp > 1 or d.pp > 1):
        lines += ["## DeepSpeed keys (seed guide → what the engine reads)", ""]
        lines += [f"- `{k}` → {v}" for k, v in SEED_KEY_MAPPING.items()]
        lines.append("")
    return "\n".join(lines)


def _checkpointing(plan: Plan) -> str:
    if not plan.batch.activation_checkpointing:
        return "off"
    return "on (chosen by the planner)" if plan.chosen.checkpointing_chosen else "on"


def _verdict(plan: Plan) -> str:
    if plan.unsupported:
        return f"NOT TRAINABLE with train.backend={plan.strategy.engine}"
    return "fits" if plan.fits else "DOES NOT FIT"

