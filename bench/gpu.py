"""GPU benchmark (issue 15): the planner's per-GPU memory against ``max_memory_allocated``,
tokens/s and MFU of the real trainer, and the default DAG on CUDA.

    python -m bench.gpu [--out docs/benchmarks/gpu.md] [--dry-run] [--only rows|dag]

1. Rows: the tiny default model (``config/config.yaml``'s data and model) and a ~1.1 B Llama
   (TinyLlama-1.1B's shape, random weights, seq 2048, a 32000-token BPE) × the engines fsdp,
   deepspeed ZeRO-2, deepspeed ZeRO-3 and ddp × activation checkpointing off/on, each at world
   size 1 in bf16. Per row: a config with one run, rendered by the render stage itself
   (``pipeline.render.main``: the planner's ``preflight``, ``plan.json``'s
   ``per_gpu_bytes.total``), then ``torchrun --standalone --nproc-per-node=1 -m bench.gpu
   worker`` runs the project's :class:`pipeline.train.trainer.Trainer` (``build()``, then
   ``train_step()`` ``--warmup + --steps`` times; no checkpoint save, no probe: a 1 B checkpoint
   per row would cost minutes and tens of GB of disk). Measured: ``torch.cuda.max_memory_allocated``
   after the last step (the trainer's ``peak_mem_gb``); tokens/s and MFU from the trainer's
   ``metrics.jsonl`` over the steps after the warm-up (total tokens / total step time; MFU as the
   trainer computes it: 6N + 12·L·H·T FLOPs per token over the device's bf16 peak).
2. The default DAG (``config/config.yaml`` with ``cluster.device: cuda``, ``gpus_per_node: 1``)
   through evaluation: ``snakemake --profile profiles/local`` in a temporary work directory.
3. Writes the table (device, torch, CUDA, date, each row's planned and measured memory, ratio,
   tokens/s, MFU) to ``--out``, after every row, so a run cut short still leaves its rows.

``--dry-run`` does everything but the CUDA work: builds and renders every row's config (the
planned figures are real), parses every command it would run with that command's own argument
parser (argv lists, never a shell string), runs ``snakemake -n`` on the DAG's config, and
writes the table with "dry run" in the measured columns. It starts no training and needs no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.gpu_table import GB, SKIPPED, ModelSpec, Row, gb, write_table
from bench.gpu_worker import worker_parser

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "benchmarks" / "gpu.md"

#: ~1.1 B parameters: TinyLlama-1.1B's shape (Zhang et al. 2024), GQA 32/4, seq 2048.
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22, "num_heads": 32,
            "num_kv_heads": 4, "max_position_embeddings": 2048}

#: engine label → the run's ``train`` overrides (strategy: manual, so the planner keeps them).
ENGINES: dict[str, dict[str, Any]] = {
    "fsdp": {"backend": "fsdp", "fsdp_sharding": "FULL_SHARD"},
    "ds-zero2": {"backend": "deepspeed", "zero_stage": 2},
    "ds-zero3": {"backend": "deepspeed", "zero_stage": 3},
    "ddp": {"backend": "ddp"},
}
#: One extra row, run last (after the DAG, when the budget allows): fsdp with ``train.compile``
#: (each decoder layer compiled), to show what compilation changes on the GPU.
COMPILE_ENGINE = "fsdp-compile"
ENGINES_EXTRA: dict[str, dict[str, Any]] = {
    COMPILE_ENGINE: {"backend": "fsdp", "fsdp_sharding": "FULL_SHARD", "compile": True},
}
ALL_ENGINES = {**ENGINES, **ENGINES_EXTRA}


def models(default_cfg: dict[str, Any], micro_1b: int) -> list[ModelSpec]:
    d = default_cfg["data"]
    return [
        ModelSpec(key="tiny", title="tiny (config/config.yaml)",
                  sources=d["sources"][0]["path"], vocab_size=d["tokenizer"]["vocab_size"],
                  seq_len=d["seq_len"], micro_batch_size=default_cfg["train"]["micro_batch_size"],
                  model=dict(default_cfg["model"]), timeout_s=90),
        ModelSpec(key="llama1b", title="Llama 1.1B (random weights)", sources="<stdlib>/*.py",
                  vocab_size=32000, seq_len=2048, micro_batch_size=micro_1b,
                  model=dict(LLAMA_1B), timeout_s=180),
    ]


def env(dry: bool) -> dict[str, str]:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""))
    e["DS_ACCELERATOR"] = "cpu" if dry else "cuda"
    return e


# --- commands -------------------------------------------------------------------------------


def data_argvs(spec: ModelSpec, data: Path) -> list[list[str]]:
    """The tokenize stage's commands for one model's data (as bench/trainer.py runs them)."""
    tok = str(data / "tokenizer")
    return [
        [sys.executable, "-m", "pipeline.tokenize", "tokenizer", "train", "--input", spec.sources,
         "--vocab-size", str(spec.vocab_size), "--out", tok],
        [sys.executable, "-m", "pipeline.tokenize", "shard", "--input", spec.sources,
         "--tokenizer", tok, "--seq-len", str(spec.seq_len), "--shards", "1", "--shard", "0",
         "--out", str(data), "--val-fraction", "0.02", "--no-progress"],
        [sys.executable, "-m", "pipeline.tokenize", "gather", "--out", str(data), "--shards", "1",
         "--tokenizer", tok],
    ]


def worker_argv(run_dir: Path, data: Path, steps: int, profile: Path | None = None) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            "-m", "bench.gpu_worker", "--run-dir", str(run_dir), "--data-dir", str(data),
            "--steps", str(steps)]
    return argv + (["--profile", str(profile)] if profile is not None else [])


def dag_argv(workdir: Path) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--profile",
            str(REPO / "profiles" / "local"), "--configfile", str(REPO / "config" / "config.yaml"),
            str(workdir / "gpu.yaml")]


def check_argv(argv: list[str]) -> None:
    """Parse a command with its own program's argument parser (raises ValueError if it would
    not parse): the dry run's check of what the real run executes."""
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise ValueError(f"not an argv list of strings: {argv!r}")
    if argv[:2] != [sys.executable, "-m"]:
        raise ValueError(f"does not run this interpreter's module: {argv!r}")
    module, rest = argv[2], argv[3:]
    if module == "torch.distributed.run":
        from torch.distributed.run import get_args_parser

        ns = _parse(get_args_parser(), rest, argv)
        if not ns.module or ns.training_script != "bench.gpu_worker" \
                or ns.nproc_per_node != "1":
            raise ValueError(f"torchrun does not start one bench.gpu_worker: {argv!r}")
        _parse(worker_parser(), ns.training_script_args, argv)
    elif module == "pipeline.tokenize" and rest[:1] == ["tokenizer"]:
        from pipeline.text.tokenizer import _parser

        _parse(_parser(), rest[1:], argv)
    elif module == "pipeline.tokenize":
        from pipeline.tokenize.__main__ import _parser as tparser

        _parse(tparser(), rest, argv)
    elif module == "snakemake":
        pass  # checked by running it: `snakemake -n` on the same argv (dry_dag)
    else:
        raise ValueError(f"unexpected command {argv!r}")


def _parse(parser: argparse.ArgumentParser, args: list[str], argv: list[str]) -> Any:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit:
        raise ValueError(f"{argv!r} does not parse: {err.getvalue().strip()}") from None


# --- rows -------------------------------------------------------------------------------------


def row_config(row: Row, default_cfg: dict[str, Any], *, steps_total: int,
               gpu_mem_gb: float) -> dict[str, Any]:
    spec = row.model
    return {
        "data": {"sources": [{"path": spec.sources, "format": "txt"}],
                 "tokenizer": {"vocab_size": spec.vocab_size}, "seq_len": spec.seq_len,
                 "shards": 1},
        "model": spec.model,
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cuda", "gpu_mem_gb": gpu_mem_gb},
        "train": {**ALL_ENGINES[row.engine], "precision": "bf16",
                  "activation_checkpointing": row.ac,
                  "micro_batch_size": spec.micro_batch_size, "grad_accum": 1,
                  "max_steps": steps_total, "warmup_steps": min(5, steps_total - 1),
                  "checkpoint_every": steps_total, "lr": default_cfg["train"]["lr"]},
        "runs": {row.name: {}},
    }


def render_row(row: Row, cfg: dict[str, Any], work: Path, data: Path | None) -> None:
    """Render the row's run with the render stage's own entry point; fills planned_bytes."""
    import yaml

    from pipeline.render import main as render_main

    cfg_path = work / "configs" / f"{row.name}.yaml"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    row.run_dir = work / "runs" / row.name
    argv = ["--config", str(cfg_path), "--run", row.name, "--out", str(row.run_dir)]
    if data is not None:
        argv += ["--data-manifest", str(data / "manifest.json")]
        row.vocab_size = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    elif row.vocab_size is not None:  # --replan: the vocabulary the measured run trained
        argv += ["--vocab-size", str(row.vocab_size)]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = render_main(argv)
    if rc != 0:
        raise ValueError(f"render of {row.name} failed (rc {rc}): {err.getvalue().strip()}")
    plan = json.loads((row.run_dir / "plan.json").read_text())
    config = json.loads((row.run_dir / "config.json").read_text())
    t = config["train"]
    want = ALL_ENGINES[row.engine]
    if any(t[k] != v for k, v in want.items()) or t["precision"] != "bf16" \
            or t["activation_checkpointing"] != row.ac or plan["engine"] != want["backend"] \
            or config["cluster"]["gpus_per_node"] * config["cluster"]["nodes"] != 1:
        raise ValueError(f"{row.name}: the rendered run is not the row asked for: train {t}, "
                         f"plan engine {plan['engine']}")
    if want.get("zero_stage") is not None and plan.get("zero_stage") != want["zero_stage"]:
        raise ValueError(f"{row.name}: planned ZeRO stage {plan.get('zero_stage')}")
    row.breakdown = {k: int(v) for k, v in plan["per_gpu_bytes"].items()}
    row.planned_bytes = row.breakdown["total"]
    row.params = int(plan["num_params"])
    if row.planned_bytes <= 0:
        raise ValueError(f"{row.name}: planned per-GPU total {row.planned_bytes}")


def measure_row(row: Row, data: Path, *, warmup: int, steps: int, timeout_s: float) -> None:
    """Run the worker for one row and read back what the trainer recorded."""
    assert row.run_dir is not None
    t0 = time.perf_counter()
    try:
        res = subprocess.run(row.argv, cwd=REPO, env=env(False), capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        row.wall_s = time.perf_counter() - t0
        row.error = f"timed out after {timeout_s:.0f} s"
        return
    row.wall_s = time.perf_counter() - t0
    (row.run_dir / "worker.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
        row.log_tail = "\n".join(lines[-20:])
        row.error = f"rc {res.returncode}: " + " / ".join(lines[-3:])[-300:]
        return
    from pipeline.artifacts import read_metrics

    recs = {r["step"]: r for r in read_metrics(row.run_dir)}  # the last record of each step
    measured = [recs[s] for s in range(warmup + 1, warmup + steps + 1) if s in recs]
    if len(measured) != steps:
        row.error = f"metrics.jsonl has {len(measured)} of the {steps} measured steps"
        return
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in measured)
    seconds = sum(r["step_time_s"] for r in measured)
    row.tokens_per_s = tokens / seconds
    if all(r.get("mfu") is not None for r in measured):
        row.mfu = sum(r["mfu"] * r["step_time_s"] for r in measured) / seconds
    info = json.loads((row.run_dir / "bench.json").read_text())
    row.measured_bytes = int(info["max_memory_allocated"])
    row.info = info


# --- the DAG ----------------------------------------------------------------------------------


def dag_config(gpu_mem_gb: float) -> dict[str, Any]:
    return {"cluster": {"device": "cuda", "gpus_per_node": 1, "gpu_mem_gb": gpu_mem_gb}}


def run_dag(workdir: Path, *, dry: bool, gpu_mem_gb: float, timeout_s: float) -> dict[str, Any]:
    import yaml

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "gpu.yaml").write_text(yaml.safe_dump(dag_config(gpu_mem_gb)))
    argv = dag_argv(workdir)
    check_argv(argv)
    if dry:
        argv = [*argv, "-n", "--quiet", "rules"]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(argv, cwd=workdir, env=env(dry), capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "wall_s": time.perf_counter() - t0,
                "error": f"timed out after {timeout_s:.0f} s", "argv": argv}
    out: dict[str, Any] = {"ok": res.returncode == 0, "wall_s": time.perf_counter() - t0,
                           "argv": argv, "runs": {}}
    if res.returncode != 0:
        out["error"] = f"rc {res.returncode}: {res.stderr.strip()[-600:]}"
        return out
    if dry:
        jobs = res.stdout + res.stderr
        missing = [r for r in ("train", "consolidate", "evaluate") if f"\n{r} " not in jobs]
        if missing:
            out.update(ok=False, error=f"snakemake -n plans no {missing} jobs")
        return out
    from pipeline.artifacts import read_metrics

    for run_dir in sorted((workdir / "results" / "runs").iterdir()):
        m = run_dir / "eval" / "metrics.json"
        recs = read_metrics(run_dir)
        ev = json.loads(m.read_text()) if m.exists() else {}
        out["runs"][run_dir.name] = {
            "steps": len(recs),
            "tokens_per_s": recs[-1].get("tokens_per_s") if recs else None,
            "peak_mem_gb": recs[-1].get("peak_mem_gb") if recs else None,
            "eval": {k: v for k, v in ev.items() if isinstance(v, (int, float))},
        }
    return out


def versions() -> dict[str, Any]:
    import torch

    try:
        from importlib.metadata import version

        ds = version("deepspeed")
    except Exception:
        ds = "not installed"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "deepspeed": ds}


def query_gpu() -> tuple[str, float]:
    """Name and memory (GB) of GPU 0, asked in a child so this process holds no CUDA context."""
    res = subprocess.run([sys.executable, "-c",
                          "import torch; p = torch.cuda.get_device_properties(0); "
                          "print(p.total_memory); print(p.name)"],
                         capture_output=True, text=True, timeout=120, env=env(False))
    if res.returncode != 0:
        raise SystemExit(f"no usable GPU (use --dry-run without one):\n{res.stderr[-2000:]}")
    mem, name = res.stdout.strip().splitlines()[:2]
    return name, int(mem) / GB


# --- main -------------------------------------------------------------------------------------


def replan(src: Path, out: Path, work: Path) -> int:
    """Re-plan the rows of a GPU run's ``gpu.json`` with this checkout's planner (render only,
    no GPU) and rewrite the table: how a planner fix is checked against figures already
    measured. The measured columns are copied, never recomputed."""
    import yaml

    rec = json.loads(src.read_text())
    default_cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    meta = dict(rec["meta"])
    gpu_mem_gb = float(meta.get("gpu_mem_gb", 80.0))  # only the fit check reads it
    steps_total = rec["warmup"] + rec["steps"]
    by_key = {spec.key: spec for spec in models(default_cfg, 8)}
    rows: list[Row] = []
    for r in rec["rows"]:
        spec = replace(by_key[r["model"]], micro_batch_size=r["micro_batch_size"],
                       seq_len=r["seq_len"])
        row = Row(spec, r["engine"], r["ac"])
        for key in ("measured_bytes", "tokens_per_s", "mfu", "wall_s", "error", "info",
                    "vocab_size", "concurrent", "note"):
            setattr(row, key, r.get(key, getattr(row, key)))
        render_row(row, row_config(row, default_cfg, steps_total=steps_total,
                                   gpu_mem_gb=gpu_mem_gb), work, None)
        rows.append(row)
        if row.measured_bytes and row.planned_bytes and r["planned_bytes"]:
            print(f"{row.name:26s} planned {row.planned_bytes / GB:7.3f} GB (was "
                  f"{r['planned_bytes'] / GB:.3f})  measured {row.measured_bytes / GB:7.3f} GB  "
                  f"ratio {row.measured_bytes / row.planned_bytes:.3f} (was "
                  f"{row.measured_bytes / r['planned_bytes']:.3f})")
    meta["replanned"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta["replan_source"] = str(src.relative_to(REPO)) if src.is_relative_to(REPO) else str(src)
    write_table(out, rows, rec.get("dag"), dry=False, meta=meta, warmup=rec["warmup"],
                steps=rec["steps"])
    print(f"wrote {out}")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description="Planner vs torch.cuda.max_memory_allocated, tokens/s and MFU per engine, "
                    "model and activation checkpointing at world size 1 in bf16, then the "
                    "default DAG on CUDA; writes a markdown table (issue 15).")
    ap.add_argument("--dry-run", action="store_true", help="no CUDA, no training: check it all")
    ap.add_argument("--replan", type=Path, default=None, metavar="GPU_JSON",
                    help="re-plan the rows of an earlier run's gpu.json with this checkout's "
                         "planner and rewrite --out (no GPU; the measured figures are kept)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the markdown table")
    ap.add_argument("--work", type=Path, default=None,
                    help="work directory (default: a temporary one, removed at the end)")
    ap.add_argument("--only", choices=("rows", "dag"), default=None,
                    help="only the table's rows, or only the DAG (the table then has no rows)")
    ap.add_argument("--models", default="llama1b,tiny",
                    help="comma-separated, in the order run: llama1b, tiny")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help=f"comma-separated: {', '.join(ENGINES)}")
    ap.add_argument("--compile-row", action=argparse.BooleanOptionalAction, default=True,
                    help=f"one more row after the DAG if the budget allows: llama1b "
                         f"{COMPILE_ENGINE} (train.compile)")
    ap.add_argument("--profile-row", default="llama1b-fsdp-noac",
                    help="the row whose 2 extra steps are profiled (kernel table beside --out); "
                         "'' for none")
    ap.add_argument("--tiny-at-once", type=int, default=4,
                    help="tiny rows run this many at a time (start-up bound; memory is per "
                         "process, tokens/s is then marked as measured side by side)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="measured steps after the warm-up")
    ap.add_argument("--micro-1b", type=int, default=8, help="micro batch of the 1B rows")
    ap.add_argument("--gpu-mem-gb", type=float, default=None,
                    help="for the plan (default: GPU 0's memory; 80 in a dry run)")
    ap.add_argument("--budget-s", type=float, default=470,
                    help="the whole run's time budget (the issue: under 8 minutes)")
    ap.add_argument("--dag-reserve-s", type=float, default=150,
                    help="kept for the DAG: rows not started by budget - reserve are skipped")
    args = ap.parse_args(argv)
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        ap.error(f"--engines: unknown {sorted(unknown)}; known: {', '.join(ENGINES)}")
    known = {"tiny", "llama1b"}
    if not set(args.models.split(",")) <= known:
        ap.error(f"--models: unknown {sorted(set(args.models.split(',')) - known)}")
    return args


def prepare_data(spec: ModelSpec, work: Path, *, dry: bool, steps_total: int) -> Path:
    """Tokenize one model's corpus with the tokenize stage's commands (checked in a dry run)."""
    data = work / "data" / spec.key
    data_cmds = data_argvs(spec, data)
    for cmd in data_cmds:
        check_argv(cmd)
    if dry:
        return data
    t0 = time.perf_counter()
    for cmd in data_cmds:
        res = subprocess.run(cmd, cwd=work, env=env(False), capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"{cmd} failed:\n{res.stderr[-3000:]}")
    man = json.loads((data / "manifest.json").read_text())
    seqs = man["splits"]["train"]["sequences"]
    need = steps_total * spec.micro_batch_size
    print(f"data {spec.key}: vocab {man['tokenizer']['vocab_size']}, {seqs} sequences of "
          f"{spec.seq_len} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if seqs < need:
        raise SystemExit(f"{spec.key}: {seqs} sequences, {need} needed")
    return data


def print_row(row: Row) -> None:
    if row.error is not None:
        print(f"{row.name:26s} FAILED: {row.error}\n{row.log_tail}", flush=True)
        return
    assert row.measured_bytes is not None and row.planned_bytes and row.tokens_per_s
    parts = ", ".join(f"{k} {gb(v)}" for k, v in row.breakdown.items() if k != "total")
    phases = ", ".join(f"{p['phase']} {gb(p['allocated'])}" for p in row.info.get("phases", []))
    print(f"{row.name:26s} plan: {parts}; measured: {phases}; reserved "
          f"{gb(row.info.get('max_memory_reserved'))} GB", flush=True)
    print(f"{row.name:26s} planned {row.planned_bytes / GB:7.2f} GB  measured "
          f"{row.measured_bytes / GB:7.2f} GB  ratio {row.measured_bytes / row.planned_bytes:.3f}"
          f"  {row.tokens_per_s:,.0f} tokens/s  MFU "
          f"{'n/a' if row.mfu is None else f'{100 * row.mfu:.1f} %'}  ({row.wall_s:.0f} s)",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replan is not None:
        with tempfile.TemporaryDirectory(prefix="zs-bench-gpu-replan-") as tmp:
            return replan(args.replan, args.out, Path(tmp))
    import yaml

    t_start = time.perf_counter()
    dry = args.dry_run
    if dry:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the render's DeepSpeed-key check
    default_cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    if dry:
        device, gpu_mem_gb = "none (dry run)", args.gpu_mem_gb or 80.0
    else:
        device, gpu_mem = query_gpu()
        gpu_mem_gb = args.gpu_mem_gb or round(gpu_mem, 1)
        device = f"{device} ({gpu_mem:.1f} GB)"
    meta = {**versions(), "device": device, "gpu_mem_gb": gpu_mem_gb,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "wall": ""}
    by_key = {m.key: m for m in models(default_cfg, args.micro_1b)}
    specs = [by_key[k] for k in args.models.split(",")]
    rows = [Row(m, e, ac) for m in specs for e in args.engines.split(",") for ac in (False, True)]
    extra = [Row(by_key["llama1b"], COMPILE_ENGINE, False)] \
        if args.compile_row and "llama1b" in args.models.split(",") else []
    steps_total = args.warmup + args.steps
    work = args.work or Path(tempfile.mkdtemp(prefix="zs-bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    dag: dict[str, Any] | None = None
    problems: list[str] = []
    datas: dict[str, Path] = {}

    def table() -> None:
        meta["wall"] = f"{time.perf_counter() - t_start:.0f} s" + (", dry run" if dry else "")
        shown = rows + [r for r in extra if dry or r.wall_s is not None]
        write_table(args.out, shown if args.only != "dag" else [], dag, dry=dry, meta=meta,
                    warmup=args.warmup, steps=args.steps)

    def ready(row: Row) -> bool:
        """Data, render and the parsed worker command of one row; False if it cannot run."""
        spec = row.model
        if spec.key not in datas:
            datas[spec.key] = prepare_data(spec, work, dry=dry, steps_total=steps_total)
        cfg = row_config(row, default_cfg, steps_total=steps_total, gpu_mem_gb=gpu_mem_gb)
        profile = args.out.parent / f"gpu-profile-{row.name}.txt" \
            if row.name == args.profile_row else None
        try:
            render_row(row, cfg, work, None if dry else datas[spec.key])
            row.argv = worker_argv(row.run_dir, datas[spec.key], steps_total, profile)  # type: ignore[arg-type]
            check_argv(row.argv)
        except (ValueError, KeyError) as err:
            row.error = str(err)
            problems.append(str(err))
            print(f"{row.name}: {err}", file=sys.stderr, flush=True)
            return False
        if dry:
            print(f"{row.name:26s} planned {row.planned_bytes / GB:7.2f} GB  "  # type: ignore[operator]
                  f"({row.params / 1e6:.1f} M params)  would run: "  # type: ignore[operator]
                  f"{' '.join(row.argv[1:])}", flush=True)
            return False
        if args.budget_s - reserve_now[0] - (time.perf_counter() - t_start) < 20:
            row.error = SKIPPED
            print(f"{row.name:26s} {SKIPPED}", flush=True)
            return False
        return True

    def measure(row: Row) -> None:
        measure_row(row, datas[row.model.key], warmup=args.warmup, steps=args.steps,
                    timeout_s=row.model.timeout_s + (120 if row.engine == COMPILE_ENGINE else 0))
        print_row(row)
        if row.error is None:
            meta["cuda"] = row.info.get("cuda", meta["cuda"])

    reserve_now = [0.0]

    def run_rows(todo: list[Row], reserve: float) -> None:
        reserve_now[0] = reserve
        for key in dict.fromkeys(r.model.key for r in todo):
            group = [r for r in todo if r.model.key == key]
            at_once = args.tiny_at_once if key == "tiny" else 1
            if at_once <= 1:
                for row in group:
                    if ready(row):
                        measure(row)
                        table()
                continue
            # Tiny rows are start-up bound (seconds of imports, a few ms of GPU work): several
            # at once keep the script inside its 8 minutes. Memory is per process, so the
            # measured peaks are unaffected; their tokens/s is noted as measured side by side.
            runnable = [r for r in group if ready(r)]
            for r in runnable:
                r.concurrent = at_once
            with ThreadPoolExecutor(max_workers=at_once) as pool:
                list(pool.map(measure, runnable))
            table()

    try:
        if args.only != "dag":
            run_rows(rows, 0 if args.only == "rows" else args.dag_reserve_s)
        if args.only != "rows":
            left = max(args.dag_reserve_s, args.budget_s - (time.perf_counter() - t_start))
            dag = run_dag(work / "dag", dry=dry, gpu_mem_gb=gpu_mem_gb, timeout_s=left)
            print(f"DAG on CUDA: {'ok' if dag['ok'] else 'FAILED: ' + str(dag.get('error'))} "
                  f"({dag['wall_s']:.0f} s{', snakemake -n' if dry else ''})", flush=True)
            if not dag["ok"]:
                problems.append(f"DAG: {dag.get('error')}")
        if args.only != "dag" and extra:
            run_rows(extra, 0)
        table()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out} ({time.perf_counter() - t_start:.0f} s)")
    failed = [r.name for r in rows + extra if r.error and r.error != SKIPPED]
    if problems or failed:
        print(f"{'dry run' if dry else 'bench'} found {len(problems)} problem(s); rows failed: "
              f"{', '.join(failed) or 'none'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
