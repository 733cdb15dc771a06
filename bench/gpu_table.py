"""The table of ``python -m bench.gpu`` (issue 15): its rows and the markdown + JSON it writes
(``gpu.md`` and ``gpu.json`` beside it; ``--replan`` rewrites both from an earlier run's JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DRY = "dry run"
SKIPPED = "skipped: time budget spent"
GB = 1e9  # the planner's GB (pipeline.plan.spec.GB) and the trainer's peak_mem_gb unit


@dataclass
class ModelSpec:
    """One model of the table: its data (tokenizer, corpus, seq) and shape."""

    key: str
    title: str
    sources: str
    vocab_size: int
    seq_len: int
    micro_batch_size: int
    model: dict[str, Any]
    timeout_s: int


@dataclass
class Row:
    model: ModelSpec
    engine: str
    ac: bool
    name: str = ""
    run_dir: Path | None = None
    params: int | None = None
    planned_bytes: int | None = None
    measured_bytes: int | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    wall_s: float | None = None
    error: str | None = None
    argv: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # the worker's bench.json
    breakdown: dict[str, int] = field(default_factory=dict)  # plan.json per_gpu_bytes
    log_tail: str = ""
    concurrent: int = 1  # rows measured at the same time as this one (itself included)
    vocab_size: int | None = None  # the trained tokenizer's (the data manifest's)
    note: str = ""  # said in the table's note column

    def __post_init__(self) -> None:
        self.name = f"{self.model.key}-{self.engine}-{'ac' if self.ac else 'noac'}"


# --- the table --------------------------------------------------------------------------------


def gb(n: int | None) -> str:
    if not n:
        return "n/a"
    return f"{n / GB:.2f}" if n >= GB else f"{n / GB:.4f}"


def fmt(x: float | None, spec: str, *, dry: bool, row: Row | None = None) -> str:
    if dry:
        return DRY
    if row is not None and row.error:
        return "—"
    return "n/a" if x is None else format(x, spec)


def write_table(out: Path, rows: list[Row], dag: dict[str, Any] | None, *, dry: bool,
                meta: dict[str, Any], warmup: int, steps: int) -> None:
    lines = ["# GPU benchmark: planned vs measured memory, tokens/s, MFU", ""]
    if dry:
        lines += ["**DRY RUN: nothing was measured.** Only the planned column is real; this "
                  "file checks that `python -m bench.gpu` would run (every row rendered, every "
                  "command parsed). Run `python -m bench.gpu` on a GPU for the figures.", ""]
    lines += [
        f"- device: {meta['device']}",
        f"- torch {meta['torch']}, CUDA {meta['cuda']}, DeepSpeed {meta['deepspeed']}",
        f"- date: {meta['date']}",
        f"- command: `python -m bench.gpu` ({meta['wall']})",
        *([f"- planned column re-planned on {meta['replanned']} by `python -m bench.gpu --replan "
           f"{meta.get('replan_source', 'gpu.json')}` with this checkout's planner (no GPU); every "
           "measured column is the GPU run's"] if meta.get("replanned") else []),
        f"- each row: world size 1, bf16, {warmup} warm-up steps then {steps} measured steps of "
        "the project's Trainer (`bench.gpu_worker` under torchrun). planned = the planner's "
        "per-GPU total (`plan.json` `per_gpu_bytes.total`, rendered by `pipeline.render`); "
        "measured = `torch.cuda.max_memory_allocated` after the last step; GB = 10^9 bytes. "
        "tokens/s = tokens / time of the measured steps; MFU as the trainer records it.",
        "",
        "| model | params | engine | act. ckpt | micro × seq | planned GB | measured GB "
        "| measured / planned | tokens/s | MFU | note |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = (r.measured_bytes / r.planned_bytes
                 if r.measured_bytes and r.planned_bytes else None)
        note = "; ".join(x for x in (r.error, r.note) if x)
        if ratio is not None and abs(ratio - 1) > 0.10:
            note = "; ".join(x for x in (f"planner off by {100 * (ratio - 1):+.0f} %", note) if x)
        if not dry and r.wall_s is not None:
            note = (note + f"; {r.wall_s:.0f} s").lstrip("; ")
        if not dry and r.concurrent > 1:
            note += f"; {r.concurrent} rows at a time (tokens/s shared the GPU)"
        lines.append(
            f"| {r.model.key} | {'n/a' if r.params is None else f'{r.params / 1e6:.1f} M'} | {r.engine} | {'on' if r.ac else 'off'} "
            f"| {r.model.micro_batch_size} × {r.model.seq_len} "
            f"| {gb(r.planned_bytes)} "
            f"| {DRY if dry else '—' if r.error else gb(r.measured_bytes)} "
            f"| {fmt(ratio, '.3f', dry=dry, row=r)} "
            f"| {fmt(r.tokens_per_s, ',.0f', dry=dry, row=r)} "
            f"| {fmt(None if r.mfu is None else 100 * r.mfu, '.1f', dry=dry, row=r)}"
            f"{'' if dry or r.mfu is None else ' %'} | {note} |")
    if rows:
        parts = ("params", "grads", "optimizer", "activations", "buffers", "total")
        lines += ["", "## The planner's per-GPU breakdown against what was allocated (GB)", "",
                  "Measured: `torch.cuda.memory_allocated` after `build()` (the model states "
                  "the engine holds before any step) and after step 1 (gradients and optimizer "
                  "states exist), the peak (`max_memory_allocated`) and the caching allocator's "
                  "peak (`max_memory_reserved`), for comparison with the planner's parts.", "",
                  "| row | " + " | ".join(parts) + " | after build | after step 1 | peak "
                  "| reserved |", "|---|" + "---:|" * (len(parts) + 4)]
        for r in rows:
            ph = {p["phase"]: p for p in r.info.get("phases", [])}
            measured = [DRY] * 4 if dry else [
                gb(ph.get("after build", {}).get("allocated")),
                gb(ph.get("after step 1", {}).get("allocated")),
                gb(r.info.get("max_memory_allocated")), gb(r.info.get("max_memory_reserved"))]
            lines.append(f"| {r.name} | " + " | ".join(gb(r.breakdown.get(k)) for k in parts)
                         + " | " + " | ".join(measured) + " |")
    if dag is not None:
        lines += ["", "## The default DAG on CUDA", "",
                  "`config/config.yaml` + `cluster: {device: cuda, gpus_per_node: 1}`, "
                  "`snakemake --profile profiles/local` through evaluation:", ""]
        if dry:
            lines.append(f"- dry run: `snakemake -n` plans the DAG: {'ok' if dag['ok'] else dag.get('error')}")
        elif dag["ok"]:
            lines.append(f"- finished in {dag['wall_s']:.0f} s")
            for name, r in dag.get("runs", {}).items():
                lines.append(f"- run `{name}`: {r['steps']} steps, last tokens/s "
                             f"{r['tokens_per_s']}, peak {r['peak_mem_gb']} GB, eval {r['eval']}")
        else:
            lines.append(f"- FAILED after {dag['wall_s']:.0f} s: {dag.get('error')}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    # The same rows as data (what was asked, planned and measured): `--replan` re-plans them
    # with the current planner without a GPU; the measured figures stay those of this run.
    out.with_suffix(".json").write_text(json.dumps({
        "meta": meta, "warmup": warmup, "steps": steps, "dry_run": dry, "dag": dag,
        "rows": [row_record(r) for r in rows]}, indent=1, default=str) + "\n")


def row_record(r: Row) -> dict[str, Any]:
    return {"name": r.name, "model": r.model.key, "engine": r.engine, "ac": r.ac,
            "micro_batch_size": r.model.micro_batch_size, "seq_len": r.model.seq_len,
            "vocab_size": r.vocab_size, "concurrent": r.concurrent, "params": r.params, "planned_bytes": r.planned_bytes, "breakdown": r.breakdown,
            "measured_bytes": r.measured_bytes, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
            "wall_s": r.wall_s, "error": r.error, "info": r.info, "note": r.note}
