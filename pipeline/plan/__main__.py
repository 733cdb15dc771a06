"""``python -m pipeline.plan``: run the planner alone. Invalid input: exit 2, message on stderr."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from pipeline.config.files import field_default, field_help, in_range, mirror_argument
from pipeline.config.presets import PRESETS, ModelShape, resolve_model
from pipeline.config.schema import MAX_PARAMS, ClusterConfig, DataConfig, PlanConfig, TrainConfig
from pipeline.errors import PipelineError
from pipeline.plan.preflight import check
from pipeline.plan.report import render_plan_md
from pipeline.plan.spec import ENGINES, FSDP_SHARDINGS, BatchSpec, Cluster, Strategy

_AUTO = "default: auto (the planner chooses)"


def _parser() -> argparse.ArgumentParser:
    """Options that mirror a config key take its default and its description from
    ``pipeline.config.schema``; strategy options left out are chosen by the planner."""
    p = argparse.ArgumentParser(prog="python -m pipeline.plan", description=__doc__)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", help=f"preset ({', '.join(PRESETS)}) or a HF config.json")
    model.add_argument("--params", type=float, help="parameter count only, e.g. 7.5e9",
                       **in_range(1, MAX_PARAMS, "a parameter count"))

    mirror_argument(p, "--nodes", ClusterConfig, "nodes")
    mirror_argument(p, "--gpus-per-node", ClusterConfig, "gpus_per_node")
    mirror_argument(p, "--gpu-mem-gb", ClusterConfig, "gpu_mem_gb", type=float)
    mirror_argument(p, "--host-mem-gb", ClusterConfig, "host_mem_gb", type=float)
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help=field_help(TrainConfig, "backend", default=False)
                   + "; default: deepspeed with --zero-stage, fsdp with an FSDP --strategy, else "
                   + str(field_default(TrainConfig, "backend")))
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3),
                   help=field_help(TrainConfig, "zero_stage", default=False) + "; " + _AUTO)
    p.add_argument("--strategy", choices=("auto", *FSDP_SHARDINGS), default="auto",
                   help=field_help(TrainConfig, "fsdp_sharding", default=False)
                   + "; or auto (the planner chooses)")
    p.add_argument("--offload-optimizer", action="store_true", default=None,
                   help=field_help(TrainConfig, "offload_optimizer", default=False) + "; " + _AUTO)
    p.add_argument("--offload-params", action="store_true", default=None,
                   help=field_help(TrainConfig, "offload_params", default=False) + "; " + _AUTO)
    for flag in ("tp", "pp"):
        mirror_argument(p, f"--{flag}", TrainConfig, flag, default=None,
                        help=field_help(TrainConfig, flag, default=False) + "; " + _AUTO)
    mirror_argument(p, "--micro-batch", TrainConfig, "micro_batch_size")
    mirror_argument(p, "--grad-accum", TrainConfig, "grad_accum", default=None,
                    help=field_help(TrainConfig, "grad_accum", default=False)
                    + "; default: from --global-batch, else 1")
    mirror_argument(p, "--global-batch", TrainConfig, "global_batch_size")
    mirror_argument(p, "--seq-len", DataConfig, "seq_len")
    mirror_argument(p, "--precision", TrainConfig, "precision")
    mirror_argument(p, "--activation-checkpointing", TrainConfig, "activation_checkpointing",
                    help=field_help(TrainConfig, "activation_checkpointing", default=False)
                    + "; default: auto (the planner turns it on when no rung fits without it, "
                    "before trying TP and PP)")
    p.add_argument("--no-activation-checkpointing", action="store_true",
                   help="never recompute activations (the planner may not turn it on)")
    mirror_argument(p, "--pp-schedule", TrainConfig, "pp_schedule")
    mirror_argument(p, "--accounting", PlanConfig, "accounting")
    mirror_argument(p, "--headroom", PlanConfig, "headroom")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _checkpointing(args: argparse.Namespace) -> bool | None:
    # Neither flag: the planner decides (None), as it does for the strategy options.
    if args.activation_checkpointing and args.no_activation_checkpointing:
        raise PipelineError("--activation-checkpointing and --no-activation-checkpointing: "
                            "give one of them")
    if args.activation_checkpointing:
        return True
    return False if args.no_activation_checkpointing else None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 does not pass pre-flight, 2 bad input)."""
    args = _parser().parse_args(argv)
    try:
        if args.params is not None:
            model = ModelShape.synthetic(int(args.params))
        else:
            model = resolve_model(args.model or "tiny")
        fsdp = args.strategy != "auto"
        engine = args.engine or (
            "fsdp" if fsdp else "deepspeed" if args.zero_stage is not None
            else field_default(TrainConfig, "backend"))
        strategy = Strategy(
            engine=engine, zero_stage=args.zero_stage,
            fsdp_sharding=args.strategy if fsdp else None,
            offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
            tp=args.tp, pp=args.pp, pp_schedule=args.pp_schedule)
        cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                          gpu_mem_gb=args.gpu_mem_gb, host_mem_gb=args.host_mem_gb)
        batch = BatchSpec(seq_len=args.seq_len, micro_batch_size=args.micro_batch,
                          grad_accum=args.grad_accum, global_batch_size=args.global_batch,
                          precision=args.precision,
                          activation_checkpointing=_checkpointing(args))
        # DeepSpeed logs to stdout (bound when it is first imported, inside check): keep stdout
        # for the plan / --json alone.
        with contextlib.redirect_stdout(sys.stderr):
            the_plan, errors = check(model=model, cluster=cluster, batch=batch,
                                     strategy=strategy, accounting=args.accounting,
                                     headroom=args.headroom)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = the_plan.as_dict()
        out["preflight_errors"] = [str(e) for e in errors]
        print(json.dumps(out, indent=2))
    else:
        print(render_plan_md(the_plan))
    for err in errors:
        print(f"pre-flight: {err}", file=sys.stderr)
    # Errors in the user's own choices are bad input (2), like argparse's.
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
