"""``python -m pipeline.status [--results results]``: one line per run of a results directory.

Reads only the run directories' artifacts (config.json, job.json, events.jsonl, metrics.jsonl,
checkpoints/, stopped.json, train.done, hf/, eval/) plus one ``squeue`` call for the Slurm
state of the recorded jobs, so it is cheap to run on a login node while jobs are queued.
The goodput column is :func:`pipeline.observe.goodput.goodput` (``--json``: its whole breakdown); a
time-limit signal lead shorter than the run's measured steps and saves need is a warning.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import artifacts as af
from pipeline.cluster.env import squeue_states
from pipeline.errors import PipelineError
from pipeline.io import printable
from pipeline.observe.goodput import goodput, save_time_warning

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
    goodput: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)

    def row(self) -> list[str]:
        """The table's cells, each with its control characters shown escaped (every string
        here comes from a run's files or a folder's name)."""
        g = self.goodput
        share = "-" if not g or g["goodput"] is None else f"{100 * g['goodput']:.0f}%"
        return [printable(str(c)) for c in (
            self.run, self.stage, self.job_id, self.slurm_state, self.step, self.restarts,
            self.checkpoint, self.tokens_per_s, share)]


HEADER = ["run", "stage", "job", "slurm", "step", "restarts", "checkpoint", "tokens/s",
          "goodput"]


def _stage(run_dir: Path, job: dict[str, Any] | None, metrics: list[dict[str, Any]]) -> str:
    if (run_dir / af.EVAL_DIR / af.EVAL_METRICS).exists():
        return "evaluated"
    if (run_dir / af.HF_DIR / af.RUN_CONFIG).exists():
        return "consolidated"
    if (run_dir / af.TRAIN_DONE).exists():
        return "trained"
    if (run_dir / af.STOPPED).exists():
        return "stopped"
    if metrics:
        return "training"
    if job is not None:
        return "submitted"
    if (run_dir / af.RUN_CONFIG).exists():
        return "rendered"
    return "new"


def run_status(run_dir: Path) -> RunStatus:
    """Everything but the Slurm state (filled in by :func:`collect`, one squeue for all)."""
    job = af.read_job(run_dir)
    metrics = af.read_metrics(run_dir, tail_bytes=64 * 1024)
    st = RunStatus(run=run_dir.name, stage=_stage(run_dir, job, metrics))
    try:
        cfg = af.read_run_config_view(run_dir) or {}
    except PipelineError as err:  # shown without it, and said so
        cfg = {}
        st.warnings.append(str(err))
    if job is not None:
        st.job_id = str(job.get("job_id", "-"))
        if job.get("launcher") == "local":
            st.slurm_state = "local"
    train = cfg.get("train")
    max_steps = train.get("max_steps") if isinstance(train, dict) else None
    if metrics:
        last = metrics[-1]["step"]
        st.step = f"{last}/{max_steps}" if max_steps else str(last)
        rates = [m["tokens_per_s"] for m in metrics[-RATE_WINDOW:]
                 if isinstance(m.get("tokens_per_s"), (int, float))]
        if rates:
            st.tokens_per_s = f"{sum(rates) / len(rates):,.0f}"
    # Restarts: attempts of the training loop beyond the first.
    st.restarts = max(0, af.attempts(run_dir) - 1)
    st.checkpoint = af.latest_checkpoint_name(run_dir) or "-"
    st.goodput = goodput(run_dir)
    policy = job.get("policy") if job is not None else None
    delay = policy.get("signal_delay_s") if isinstance(policy, dict) else None
    if isinstance(delay, int) and st.stage not in ("trained", "consolidated", "evaluated"):
        warning = save_time_warning(run_dir, delay)
        if warning:
            st.warnings.append(warning)
    return st


#: A Slurm job id (array tasks and het-job parts included); anything else read from a
#: job.json is not passed to squeue (one bad id would fail the query for every run).
_JOB_ID = re.compile(r"^\d+([_+]\d+)?$")


def collect(results: Path, problems: list[str] | None = None) -> list[RunStatus]:
    """One status per run folder. A run whose files cannot be read shows as ``unreadable``
    (the reason is appended to ``problems``); it never hides the other runs."""
    runs_root = results / "runs"
    try:
        dirs = sorted(p for p in runs_root.iterdir() if p.is_dir()) if runs_root.is_dir() else []
    except OSError as err:
        raise PipelineError(f"{runs_root} cannot be listed ({err}): check its permissions") from err
    out = []
    for d in dirs:
        try:
            st = run_status(d)
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as err:
            st = RunStatus(run=d.name, stage="unreadable")
            if problems is not None:
                problems.append(f"{d}: cannot be read ({type(err).__name__}: {err}); check or "
                                "remove its files (the other runs are shown)")
        out.append(st)
    for s in out:
        if s.job_id != "-" and s.slurm_state == "-" and not _JOB_ID.match(s.job_id):
            s.job_id, s.slurm_state = printable(s.job_id)[:40], "?"
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
        "last checkpoint, tokens/s, goodput (productive share of the wall time; --json: "
        "its breakdown per attempt).",
    )
    p.add_argument("--results", type=Path, default=Path("results"), help="results directory")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        print(f"error: no results directory at {args.results}", file=sys.stderr)
        return af.EXIT_USAGE
    problems: list[str] = []
    try:
        rows = collect(args.results, problems)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return af.EXIT_USAGE
    if args.json:
        for r in rows:
            print(json.dumps(r.__dict__))
    elif rows:
        print(format_table(rows))
    else:
        print(f"no runs under {args.results / 'runs'}")
    for r in rows:
        for line in r.warnings:
            print(f"warning: {printable(r.run)}: {printable(line)}", file=sys.stderr)
    for line in problems:
        print(f"error: {printable(line)}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
