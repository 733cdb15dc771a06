"""The render stage: one run's typed config → everything the train stage reads.

``python -m pipeline.render --config-json JSON --run NAME --out results/runs/NAME`` writes
``config.json``, ``ds_config.json`` (deepspeed runs), ``fsdp.json`` (fsdp runs),
``topology.json``, ``plan.md`` and ``launch.json``. ``render_run`` is a pure function (typed config in, file contents out) so it is
tested against golden files; the CLI only writes what it returns.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline import artifacts as af
from pipeline.artifacts import SUBMITIT
from pipeline.config import RunConfig
from pipeline.config_files import load_config, parse_run_config
from pipeline.distenv import torchrun_argv
from pipeline.errors import PipelineError
from pipeline.io import deep_merge, write_json_atomic, write_text_atomic
from pipeline.launchopts import LaunchOptions
from pipeline.mixture import mixture_plan_line
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
from pipeline.sbatch import render_submission

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


def check_run_out(out: Path, run: str) -> None:
    """Refuse an ``--out`` that is not this run's directory: a file, a folder holding anything a
    run directory does not (``.``, ``/``, the data directory), or another run's rendered
    config. Absent and empty folders are fine; nothing is written when refused."""
    if not out.exists():
        if out.is_symlink():
            raise PipelineError(f"--out {out} is a dangling symbolic link: choose another folder")
        return
    if not out.is_dir():
        raise PipelineError(f"--out {out} is not a folder: name a run directory "
                            "(results/runs/NAME)")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in af.RUN_DIR_NAMES
                     and not p.name.startswith((".", f"{af.CHECKPOINTS}.old-", "samples-rank")))
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise PipelineError(
            f"--out {out} is not a run directory (it holds {shown}): nothing was written; "
            f"render into results/runs/{run} or a new, empty folder"
        )
    cfg = out / af.RUN_CONFIG
    if cfg.exists():
        old = af.read_json_or_none(cfg)
        name = old.get("name") if isinstance(old, dict) else None
        if name != run:
            raise PipelineError(
                f"--out {out} holds the rendered config of "
                + (f"run {name!r}" if isinstance(name, str) else "another run (unreadable)")
                + f", not of run {run!r}: nothing was written; render each run into its own "
                "folder (results/runs/NAME)"
            )


def write_rendered(files: dict[str, Any], out: Path) -> None:
    """Write what ``render_run`` returned, each file atomically."""
    for name, content in files.items():
        if isinstance(content, str):
            write_text_atomic(out / name, content)
        else:
            write_json_atomic(out / name, content)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.render",
        description="Render one run's engine configs, topology and plan from the config.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help="a config YAML file (with --run)")
    src.add_argument(
        "--run-config-json", help="one run's effective config as JSON (what Snakemake passes)"
    )
    p.add_argument("--run", help="run name (a key of runs:), with --config")
    p.add_argument("--out", type=Path, required=True, help="output dir, e.g. results/runs/NAME")
    vocab = p.add_mutually_exclusive_group()
    vocab.add_argument("--data-manifest", type=Path,
                       help="results/data/manifest.json (vocab size, per-source counts)")
    vocab.add_argument("--vocab-size", type=int, help="vocabulary size, without a manifest")
    args = p.parse_args(argv)
    try:
        if args.config is not None:
            if not args.run:
                raise PipelineError("--config needs --run NAME (one of the config's runs:)")
            run = load_config(args.config).run(args.run)
        else:
            try:
                data = json.loads(args.run_config_json)
            except (ValueError, RecursionError) as err:
                raise PipelineError(f"--run-config-json is not valid JSON ({err})") from None
            run = parse_run_config(data)
        if args.data_manifest is not None:
            manifest = af.read_artifact(args.data_manifest, "data manifest",
                                        hint="run the tokenize stage first")
            af.check_data_manifest(manifest, args.data_manifest)
            vocab_size = manifest["tokenizer"]["vocab_size"]
        else:
            manifest = None
            vocab_size = args.vocab_size or run.data.tokenizer.vocab_size
            if vocab_size < 1:
                raise PipelineError(f"--vocab-size {vocab_size} must be at least 1")
        files = render_run(run, vocab_size=vocab_size, manifest=manifest)
        check_run_out(args.out, run.name)
        try:
            write_rendered(files, args.out)
        except OSError as err:
            raise PipelineError(f"--out {args.out}: cannot write the rendered files ({err})") from err
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(files["plan.md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
