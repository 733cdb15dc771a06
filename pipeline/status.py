"""``python -m pipeline.status [--results results]``: one line per run of a results directory.

Reads only the run directories' artifacts (config.json, job.json, events.jsonl, metrics.jsonl,
checkpoints/, stopped.json, train.done, hf/, eval/) plus one ``squeue`` call for the Slurm
state of the recorded jobs, so it is cheap to run on a login node while jobs are queued.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.distenv import squeue_states

#: How many of the newest metrics records the tokens/s column averages.
RATE_WINDOW = 20


@dataclass(kw_only=True)
class RunStatus:
    """What the table shows for one run."""

    run: str
    stage: str
    job_id: str = "-"
    slurm_state: str = "-"
    step: str = "-"
    restarts: int = 0
    checkpoint: str = "-"
    tokens_per_s: str = "-"

    def row(self) -> list[str]:
        return [self.run, self.stage, self.job_id, self.slurm_state, self.step,
                str(self.restarts), self.checkpoint, self.tokens_per_s]


HEADER = ["run", "stage", "job", "slurm", "step", "restarts", "checkpoint", "tokens/s"]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _jsonl(path: Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (only the last ``tail_bytes`` when given: metrics grow)."""
    try:
        with path.open("rb") as f:
            if tail_bytes is not None:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - tail_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # the first, cut line of a tail read, or a line cut by a crash
    return out


def _stage(run_dir: Path, job: dict[str, Any] | None, metrics: list[dict[str, Any]]) -> str:
    if (run_dir / "eval" / "metrics.json").exists():
        return "evaluated"
    if (run_dir / "hf" / "config.json").exists():
        return "consolidated"
    if (run_dir / "train.done").exists():
        return "trained"
    if (run_dir / "stopped.json").exists():
        return "stopped"
    if metrics:
        return "training"
    if job is not None:
        return "submitted"
    if (run_dir / "config.json").exists():
        return "rendered"
    return "new"


def run_status(run_dir: Path) -> RunStatus:
    """Everything but the Slurm state (filled in by :func:`collect`, one squeue for all)."""
    job = _read_json(run_dir / "job.json")
    metrics = _jsonl(run_dir / "metrics.jsonl", tail_bytes=64 * 1024)
    events = _jsonl(run_dir / "events.jsonl")
    cfg = _read_json(run_dir / "config.json") or {}
    st = RunStatus(run=run_dir.name, stage=_stage(run_dir, job, metrics))
    if job is not None:
        st.job_id = str(job.get("job_id", "-"))
        if job.get("launcher") == "local":
            st.slurm_state = "local"
    max_steps = cfg.get("train", {}).get("max_steps")
    if metrics:
        last = metrics[-1]["step"]
        st.step = f"{last}/{max_steps}" if max_steps else str(last)
        rates = [m["tokens_per_s"] for m in metrics[-RATE_WINDOW:] if m.get("tokens_per_s")]
        if rates:
            st.tokens_per_s = f"{sum(rates) / len(rates):,.0f}"
    # Restarts: attempts of the training loop beyond the first ("start" events by rank 0).
    st.restarts = max(0, sum(1 for e in events if e.get("event") == "start") - 1)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")
                   if (p / "manifest.json").is_file())
    if ckpts:
        st.checkpoint = ckpts[-1]
    return st


def collect(results: Path) -> list[RunStatus]:
    runs_root = results / "runs"
    dirs = sorted(p for p in runs_root.iterdir() if p.is_dir()) if runs_root.is_dir() else []
    out = [run_status(d) for d in dirs]
    slurm_ids = [s.job_id for s in out if s.job_id != "-" and s.slurm_state == "-"]
    if slurm_ids and shutil.which("squeue"):
        states = squeue_states(slurm_ids)
        for s in out:
            if s.job_id in slurm_ids:
                if states is None:
                    s.slurm_state = "?"  # squeue failed (slurmctld unreachable)
                else:
                    js = states.get(s.job_id)
                    # Not listed: ended longer ago than MinJobAge (or another cluster's id).
                    s.slurm_state = js.state if js else "gone"
    return out


def format_table(rows: list[RunStatus]) -> str:
    table = [HEADER] + [r.row() for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.status",
        description="Print a table of every run: stage, job id, Slurm state, step, restarts, "
        "last checkpoint, tokens/s.",
    )
    p.add_argument("--results", type=Path, default=Path("results"), help="results directory")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        print(f"error: no results directory at {args.results}", file=sys.stderr)
        return 2
    rows = collect(args.results)
    if args.json:
        for r in rows:
            print(json.dumps(r.__dict__))
    elif rows:
        print(format_table(rows))
    else:
        print(f"no runs under {args.results / 'runs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
