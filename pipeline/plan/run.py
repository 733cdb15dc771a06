"""A run's rendered files, as a pure function: one typed run config → ``config.json``,
``ds_config.json`` (deepspeed runs), ``fsdp.json`` (fsdp runs), ``topology.json``, ``plan.md`` and
``launch.json`` contents (:func:`render_run`, golden-tested). The render stage
(:mod:`pipeline.render`) writes them; the workflow's start-up pre-flight
(:mod:`pipeline.plan.preflight_cache`) and ``python -m pipeline.config check`` run it to check
every run before anything is queued.
"""

from __future__ import annotations

from typing import Any

from pipeline.artifacts import SUBMITIT
from pipeline.cluster.env import torchrun_argv
from pipeline.cluster.options import LaunchOptions
from pipeline.cluster.sbatch import render_submission
from pipeline.config.files import parse_run_config
from pipeline.config.schema import RunConfig
from pipeline.data.mixture import mixture_plan_line
from pipeline.errors import PipelineError
from pipeline.io import deep_merge
from pipeline.plan import (
    BatchSpec,
    Cluster,
    ModelShape,
    Plan,
    Strategy,
    check,
    preflight,
    render_ds_config,
    render_fsdp_config,
    render_plan_md,
    render_topology,
)

#: Where launch.json's submission preview places the results tree (an absolute placeholder).
PREVIEW_RESULTS = "/path/to/results"

#: DeepSpeed's own progress prints would duplicate the loop's metrics.jsonl.
_QUIET_STEPS = 10**9


def planner_inputs(run: RunConfig, *, vocab_size: int) -> dict[str, Any]:
    """The planner's typed inputs for a run (``strategy: auto`` leaves the sharding open)."""
    m, c, t = run.model, run.cluster, run.train
    model = ModelShape(
        name=f"run {run.name}",
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads or m.num_heads,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
        rope_theta=m.rope_theta,
    )
    cluster = Cluster(
        nodes=c.nodes,
        gpus_per_node=c.gpus_per_node,
        gpu_mem_gb=c.gpu_mem_gb,
        host_mem_gb=c.host_mem_gb,
    )
    batch = BatchSpec(
        seq_len=run.data.seq_len,
        micro_batch_size=t.micro_batch_size,
        grad_accum=t.grad_accum,
        global_batch_size=t.global_batch_size,
        precision=t.precision,
        # auto may turn recomputation on (the planner's "time for memory" rung, tried before
        # offload); a run that sets it keeps it.
        activation_checkpointing=(None if t.strategy == "auto" and not t.activation_checkpointing
                                  else t.activation_checkpointing),
    )
    auto = t.strategy == "auto"
    deepspeed, fsdp = t.backend == "deepspeed", t.backend == "fsdp"
    strategy = Strategy(
        engine=t.backend,
        zero_stage=None if auto or not deepspeed else t.zero_stage,
        fsdp_sharding=None if auto or not fsdp else t.fsdp_sharding,
        offload_optimizer=None if auto else t.offload_optimizer,
        offload_params=None if auto else t.offload_params,
        tp=t.tp,
        pp=t.pp,
        pp_schedule=t.pp_schedule,
    )
    return {"model": model, "cluster": cluster, "batch": batch, "strategy": strategy}


def resolve_strategy(run: RunConfig, plan: Plan) -> RunConfig:
    """The run with the planner's choice written in (what the trainer will read)."""
    data = run.model_dump(mode="json")
    data["train"].update(plan.train_settings())
    return parse_run_config(data)


def submission_preview(run: RunConfig) -> dict[str, Any]:
    """What the Slurm launcher submits for this run with the default launch options (the
    profile's resources change them): sbatch's argv and the submission script, from the
    function the launcher submits with. Placeholders: the results folder, the interpreter."""
    sub = render_submission(
        LaunchOptions(job_name=f"zs-{run.name}"),
        nodes=run.cluster.nodes, gpus_per_node=run.cluster.gpus_per_node,
        device=run.cluster.device,
        folder=f"{PREVIEW_RESULTS}/runs/{run.name}/{SUBMITIT}/%j", python="python",
    )
    return {"sbatch_argv": sub.command(), "sbatch_script": sub.script}


def render_run(run: RunConfig, *, vocab_size: int,
               manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the render stage writes for one run, as a dict of file name → content.

    ``manifest``: the data manifest, when tokenized (plan.md's mixture line then counts the
    passes over each source, or the step a source runs out at; without it, only the setting).
    Pure: the same run, vocabulary and manifest give the same files (golden-tested). Raises
    ``PipelineError`` listing every pre-flight problem (batch arithmetic, divisibility, memory,
    DeepSpeed keys the installed engine does not know).
    """
    t = run.train
    inputs = planner_inputs(run, vocab_size=vocab_size)
    ds_kwargs = {
        "lr": t.lr,
        "betas": t.betas,
        "eps": t.eps,
        "weight_decay": t.weight_decay,
        "warmup_steps": t.warmup_steps,
        "total_steps": t.max_steps,
        "gradient_clipping": t.grad_clip,
        "torch_adam": t.torch_adam,
        "steps_per_print": _QUIET_STEPS,
    }
    if run.plan.enforce_memory:
        plan = preflight(
            **inputs,
            accounting=run.plan.accounting,
            headroom=run.plan.headroom,
            ds_overrides=t.deepspeed or None,
            ds_render_kwargs=ds_kwargs,
        )
    else:
        plan, errors = check(
            **inputs,
            accounting=run.plan.accounting,
            headroom=run.plan.headroom,
            ds_overrides=t.deepspeed or None,
            ds_render_kwargs=ds_kwargs,
        )
        errors = [e for e in errors if "does not fit" not in str(e)]
        if errors:
            raise PipelineError(
                f"pre-flight found {len(errors)} problem(s):\n"
                + "\n".join(f"- {e}" for e in errors)
            )
    run = resolve_strategy(run, plan)
    files: dict[str, Any] = {
        "config.json": run.model_dump(mode="json"),
        "topology.json": render_topology(plan.dims, seq_len=run.data.seq_len),
        "plan.md": render_plan_md(plan, mixture_plan_line(
            manifest, run.train, plan.dims.global_batch_size)),
        "plan.json": plan.as_dict(),
        "launch.json": {
            "per_node_argv": torchrun_argv(
                "python",
                node=None,
                nproc_per_node=run.cluster.gpus_per_node,
                module="pipeline.train",
                args=["worker", "--run-dir", f"results/runs/{run.name}", "--data-dir",
                      "results/data"],
            ),
            **submission_preview(run),
        },
    }
    if t.backend == "deepspeed":
        files["ds_config.json"] = deep_merge(render_ds_config(plan, **ds_kwargs), t.deepspeed)
    elif t.backend == "fsdp":
        files["fsdp.json"] = render_fsdp_config(plan)
    # ddp: no engine config file; the engine reads config.json (train.precision, loss_scale_*).
    return files
