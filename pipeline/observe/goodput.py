"""Goodput: where a run's wall time went, from its events and metrics (pure, torch-free).

:func:`goodput` splits every attempt of a run (one torchrun from the node task's
``launch.attempt`` to its ``launch.end``) and the waits between them into parts that add up to
the whole:

* ``queue``: from the submission (``launch.submit``) to the first attempt, and between an
  attempt's end and the next one's start (Slurm's requeue and pending time, the job's start-up
  on the node; locally the retry's own gap). Time between two launches (a person starting the
  workflow again) is not the run's and is not counted;
* ``startup``: the attempt's start to its first step's start, less the checkpoint load
  (torchrun, imports, process group, model and engine build);
* ``load``: checkpoint load (rank 0's ``load`` events);
* ``productive``: steps whose result was kept (from the end of the previous step or save to the
  end of this step: the per-step bookkeeping counts with its step);
* ``save``: what training waited for checkpoints (rank 0's ``save`` and ``save_wait`` events);
* ``lost``: steps computed again later because the attempt failed after its last checkpoint,
  plus a failed attempt's time from its last step to its end (a hang's wait, the kill);
* ``shutdown``: a finished or stopped attempt's time after its last step and save (the probe,
  ``train.done``, process exit);
* ``unaccounted``: what the records leave unexplained (records out of order); ~0.

``goodput = productive / total``. Also here: the smallest safe lead time of the time-limit
signal derived from the measured saves and steps (:func:`safe_signal_lead_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import (
    CHECKPOINTS,
    CKPT_MANIFEST,
    checkpoint_steps,
    read_events,
    read_json_or_none,
    read_metrics,
)

PARTS = ("productive", "startup", "load", "save", "lost", "shutdown", "queue", "unaccounted")
#: Seconds the stop needs besides the step in flight and the save: the agreement, stopped.json,
#: the node task's requeue (it keeps 5 s for it) and a shared file system's delay.
HANDOFF_S = 10.0
FAILED = ("failed", "hang")


@dataclass
class Attempt:
    """One attempt's window and its parts (seconds)."""

    n: int
    begin: float
    end: float | None = None
    outcome: str = "running"
    job_id: str | None = None
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    steps: tuple[int, int] | None = None
    resumed_from: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"attempt": self.n, "job_id": self.job_id, "begin": self.begin, "end": self.end,
                "outcome": self.outcome, "steps": self.steps, "resumed_from": self.resumed_from,
                **{k: round(v, 3) for k, v in self.parts.items()}}


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _clean(events: list[dict[str, Any]], metrics: list[dict[str, Any]]
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Only records whose fields used here are numbers (a hand-edited or foreign line is
    skipped, as a torn one is by the reader); numeric fields that are not are dropped."""
    def fix(r: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k not in keys or _num(v)}

    ev = [fix(e, ("seconds", "resumed_from")) for e in events if _num(e.get("time"))]
    ms = [fix(m, ("step_time_s",)) for m in metrics
          if _num(m.get("time")) and isinstance(m.get("step"), int)]
    return ev, ms


def _windows(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> list[Attempt]:
    """The attempts, from the node task's launch.attempt/launch.end events, with their queue
    time; without any (a run trained by torchrun directly): one per trainer ``start``."""
    out: list[Attempt] = []
    mark: float | None = None  # the submission or the previous attempt's end
    for e in events:
        kind, t = e.get("event"), float(e.get("time", 0))
        if kind == "launch.submit":
            mark = t
        elif kind == "launch.attempt":
            if out and out[-1].end is None:  # ended without a record (killed): last sign of life
                out[-1].end = _last_time(events, metrics, out[-1].begin, t)
                out[-1].outcome = "failed"
                mark = out[-1].end
            a = Attempt(n=len(out) + 1, begin=t, job_id=e.get("job_id"))
            a.parts["queue"] = max(0.0, t - mark) if mark is not None else 0.0
            out.append(a)
        elif kind == "launch.end" and out and out[-1].end is None:
            out[-1].end = t
            if out[-1].outcome != "hang":  # a hang ends as a failure: keep the finer word
                out[-1].outcome = str(e.get("outcome", "done"))
            mark = t
        elif kind == "launch.hang" and out and out[-1].end is None:
            out[-1].outcome = "hang"
    if not out:
        for e in events:
            if e.get("event") == "start":
                load = [x for x in events if x.get("event") == "load"
                        and x.get("attempt") == e.get("attempt")]
                begin = float(e["time"]) - sum(float(x.get("seconds", 0)) for x in load)
                if out and out[-1].end is None:
                    out[-1].end = _last_time(events, metrics, out[-1].begin, begin)
                out.append(Attempt(n=len(out) + 1, begin=begin))
    if out and out[-1].end is None:
        out[-1].end = _last_time(events, metrics, out[-1].begin, math.inf)
        if any(e.get("event") == "finish" and float(e["time"]) >= out[-1].begin for e in events):
            out[-1].outcome = "done"
    return out


def _last_time(events: list[dict[str, Any]], metrics: list[dict[str, Any]], lo: float,
               hi: float) -> float:
    times = [float(r["time"]) for r in [*events, *metrics]
             if isinstance(r.get("time"), (int, float)) and lo <= r["time"] < hi]
    return max(times, default=lo)


def _split(a: Attempt, events: list[dict[str, Any]], metrics: list[dict[str, Any]],
           lost_after: int | None) -> None:
    """Fill an attempt's parts; steps above ``lost_after`` were computed again later."""
    assert a.end is not None
    inside = [e for e in events if a.begin <= float(e.get("time", 0)) <= a.end]
    steps = sorted((m for m in metrics if isinstance(m.get("time"), (int, float))
                    and a.begin <= m["time"] <= a.end), key=lambda m: m["time"])
    # What training waited for checkpoints: each save (with checkpoint_async, its staging and
    # any wait for the previous one) and the wait for the last one before a stop or the end.
    saves = [(float(e["time"]), float(e.get("seconds", 0))) for e in inside
             if e.get("event") in ("save", "save_wait")]
    p = a.parts
    p["load"] = sum(float(e.get("seconds", 0)) for e in inside if e.get("event") == "load")
    start = next((e for e in inside if e.get("event") == "start"), None)
    a.resumed_from = None if start is None else start.get("resumed_from")
    prev = a.begin
    if steps:
        a.steps = (steps[0]["step"], steps[-1]["step"])
        prev = steps[0]["time"] - float(steps[0].get("step_time_s") or 0)
        p["startup"] = prev - a.begin - p["load"]
    for m in steps:
        saved = sum(s for t, s in saves if prev < t <= m["time"])
        part = "lost" if lost_after is not None and m["step"] > lost_after else "productive"
        p[part] += m["time"] - prev - saved
        p["save"] += saved
        prev = m["time"]
    tail_saves = sum(s for t, s in saves if t > prev)
    p["save"] += tail_saves
    tail = a.end - prev - tail_saves
    if not steps:
        p["startup"] = a.end - a.begin - p["load"] - tail_saves
        tail = 0.0
    p["lost" if a.outcome in FAILED else "shutdown"] += tail
    wall = p["queue"] + (a.end - a.begin)
    p["unaccounted"] = wall - sum(v for k, v in p.items() if k != "unaccounted")


def goodput(run_dir: Path, events: list[dict[str, Any]] | None = None,
            metrics: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The run's time split into :data:`PARTS`, per attempt and in total, and
    ``goodput`` = productive / total (None before any attempt). Reads ``events.jsonl`` and
    ``metrics.jsonl`` unless given."""
    events, metrics = _clean(read_events(run_dir) if events is None else events,
                             read_metrics(run_dir) if metrics is None else metrics)
    attempts = _windows(events, metrics)
    for i, a in enumerate(attempts):
        later = [b for b in attempts[i + 1:] if any(
            e.get("event") == "start" and b.begin <= float(e.get("time", 0)) <= (b.end or 0)
            for e in events)]
        lost_after = None
        if later:
            start = next(e for e in events if e.get("event") == "start"
                         and later[0].begin <= float(e.get("time", 0)))
            lost_after = int(start.get("resumed_from") or 0)
        _split(a, events, metrics, lost_after)
    totals = {k: round(sum(a.parts[k] for a in attempts), 3) for k in PARTS}
    total = round(sum(a.parts["queue"] + (a.end or a.begin) - a.begin for a in attempts), 3)
    return {
        "total": total,
        **totals,
        "goodput": round(totals["productive"] / total, 4) if total > 0 else None,
        "attempts": [a.as_dict() for a in attempts],
        "saves": save_summary(events),
    }


def save_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Checkpoint saves from rank 0's events: how many, whether in the background, what each
    blocked training (``save`` seconds, the median and the longest; ``save_wait`` added to the
    total) and how long each took until committed (``save_commit``)."""
    import statistics

    def secs(name: str) -> list[float]:
        return [float(e["seconds"]) for e in events
                if e.get("event") == name and _num(e.get("seconds"))]

    blocked, commits, waits = secs("save"), secs("save_commit"), secs("save_wait")
    saves = [e for e in events if e.get("event") == "save"]
    return {
        "count": len(blocked),
        "background": sum(bool(e.get("background")) for e in saves),
        "blocked_median_s": statistics.median(blocked) if blocked else None,
        "blocked_max_s": max(blocked, default=None),
        "blocked_total_s": round(sum(blocked) + sum(waits), 3),
        "committed_median_s": statistics.median(commits) if commits else None,
    }


def format_saves(s: dict[str, Any]) -> str:
    """One sentence on the checkpoint saves (the report's goodput section)."""
    if not s["count"]:
        return "No checkpoint saved yet."
    how = ("in the background" if s["background"] == s["count"]
           else "synchronously" if not s["background"] else f"{s['background']} in the background")
    text = (f"Checkpoint saves: {s['count']} ({how}); each blocked training "
            f"{s['blocked_median_s']:.3f} s (median; longest {s['blocked_max_s']:.3f} s; "
            f"{s['blocked_total_s']:.2f} s in all, waits before a stop or the end included)")
    if s["committed_median_s"] is not None:
        text += f"; written and committed in {s['committed_median_s']:.3f} s (median)"
    return text + "."


def format_goodput(g: dict[str, Any]) -> str:
    """A markdown table of :func:`goodput`'s result (the run report's section)."""
    if not g["attempts"]:
        return "No attempt recorded yet."
    head = ["attempt", "outcome", "steps", *PARTS[:-1], "wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in g["attempts"]:
        steps = "-" if not a["steps"] else f"{a['steps'][0]}–{a['steps'][1]}"
        wall = a["queue"] + (a["end"] or a["begin"]) - a["begin"]
        lines.append("| " + " | ".join([str(a["attempt"]), a["outcome"], steps]
                                       + [f"{a[k]:.1f}" for k in PARTS[:-1]]
                                       + [f"{wall:.1f}"]) + " |")
    lines.append("| **total** | | | " + " | ".join(f"{g[k]:.1f}" for k in PARTS[:-1])
                 + f" | {g['total']:.1f} |")
    share = "-" if g["goodput"] is None else f"{100 * g['goodput']:.1f} %"
    lines += ["", f"Goodput (productive / total): **{share}**; seconds, queue = waits before "
              "and between attempts; unaccounted "
              f"{g['unaccounted']:.1f} s."]
    if "saves" in g:
        lines += ["", format_saves(g["saves"])]
    return "\n".join(lines)


# --- the time-limit signal's lead time --------------------------------------------------------


def measured_save_seconds(run_dir: Path) -> float | None:
    """The longest checkpoint save seen for this run, from the ranks' ``save`` events and from
    the checkpoint folders themselves (first file written → manifest time). None when nothing
    was saved yet."""
    # (launch.saved's save_s also counts the wait for the current step and for start-up when
    # the signal came early: it is reported, not used here.)
    found = [float(e["seconds"]) for e in read_events(run_dir, "save")
             if isinstance(e.get("seconds"), (int, float))]
    for _, ck in checkpoint_steps(run_dir / CHECKPOINTS):
        manifest = read_json_or_none(ck / CKPT_MANIFEST)
        try:
            end = float(manifest["time"])
            first = min(f.stat().st_mtime for f in ck.rglob("*") if f.is_file())
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append(max(0.0, end - first))
    return max(found) if found else None


def safe_signal_lead_s(run_dir: Path) -> dict[str, float] | None:
    """The smallest lead time of the time-limit signal that lets a stop finish: the step in
    flight (the longest measured) + the longest save + :data:`HANDOFF_S`. None before a save."""
    save_s = measured_save_seconds(run_dir)
    if save_s is None:
        return None
    step_s = max((float(m["step_time_s"]) for m in read_metrics(run_dir)
                  if isinstance(m.get("step_time_s"), (int, float))), default=0.0)
    return {"save_s": save_s, "step_s": step_s,
            "lead_s": float(math.ceil(save_s + step_s + HANDOFF_S))}


def save_time_warning(run_dir: Path, signal_delay_s: int) -> str | None:
    """A warning when the configured lead time of the time-limit signal is shorter than
    :func:`safe_signal_lead_s`."""
    need = safe_signal_lead_s(run_dir)
    if need is None or signal_delay_s >= need["lead_s"]:
        return None
    return (
        f"signal_delay_s={signal_delay_s} is shorter than the measured checkpoint time needs "
        f"({need['save_s']:.1f} s save + {need['step_s']:.1f} s step in flight + "
        f"{HANDOFF_S:.0f} s hand-off = {need['lead_s']:.0f} s): the time-limit warning may "
        f"come too late to save; raise signal_delay_s to at least {need['lead_s']:.0f} in the "
        "profile"
    )
