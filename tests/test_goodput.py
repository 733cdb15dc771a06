"""Goodput's arithmetic on a run directory written by hand (one failed attempt after a hang, one
that resumed and finished), the signal lead time it derives, and how status shows both. The
end-to-end runs with real faults are in tests/test_watchdog.py and tests/slurm/."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline.observe.goodput import (
    PARTS,
    format_goodput,
    goodput,
    safe_signal_lead_s,
    save_time_warning,
)
from tests.conftest import PY, subprocess_env

EVENTS = [
    {"event": "launch.submit", "time": 100.0, "job_id": "7"},
    {"event": "launch.attempt", "time": 110.0, "job_id": "7"},
    {"event": "start", "time": 120.0, "resumed_from": 0, "attempt": 1},
    {"event": "save", "time": 125.0, "step": 2, "seconds": 2.0, "attempt": 1},
    {"event": "launch.hang", "time": 135.0, "ranks": []},
    {"event": "launch.end", "time": 137.0, "outcome": "failed"},
    {"event": "launch.attempt", "time": 140.0, "job_id": "7"},
    {"event": "load", "time": 148.0, "step": 2, "seconds": 3.0, "attempt": 2},
    {"event": "start", "time": 148.0, "resumed_from": 2, "attempt": 2},
    {"event": "save", "time": 152.0, "step": 4, "seconds": 0.5, "attempt": 2},
    {"event": "finish", "time": 153.0, "step": 4, "attempt": 2},
    {"event": "launch.end", "time": 154.0, "outcome": "done"},
]
METRICS = [
    {"step": 1, "time": 122.0, "step_time_s": 1.0, "attempt": 1},
    {"step": 2, "time": 123.0, "step_time_s": 1.0, "attempt": 1},
    {"step": 3, "time": 126.0, "step_time_s": 1.0, "attempt": 1},
    {"step": 4, "time": 127.0, "step_time_s": 1.0, "attempt": 1},
    {"step": 3, "time": 150.0, "step_time_s": 1.0, "attempt": 2},
    {"step": 4, "time": 151.0, "step_time_s": 1.0, "attempt": 2},
]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS)
                                       + '{"step": 5, "time": 1')  # a line torn by a crash
    return run


def test_every_second_is_in_one_part(run_dir: Path) -> None:
    g = goodput(run_dir)
    first, second = g["attempts"]
    assert first["outcome"] == "hang" and second["outcome"] == "done"
    # Attempt 1: 10 s queued, 11 s to its first step, steps 1-2 kept, the save of step 2,
    # steps 3-4 computed again later plus the 10 s from the last step to the kill.
    assert {k: first[k] for k in PARTS} == {
        "queue": 10.0, "startup": 11.0, "load": 0.0, "productive": 2.0, "save": 2.0,
        "lost": 12.0, "shutdown": 0.0, "unaccounted": 0.0}
    assert {k: second[k] for k in PARTS} == {
        "queue": 3.0, "startup": 6.0, "load": 3.0, "productive": 2.0, "save": 0.5,
        "lost": 0.0, "shutdown": 2.5, "unaccounted": 0.0}
    assert g["total"] == 154.0 - 100.0 == sum(g[k] for k in PARTS)
    assert g["goodput"] == round(4 / 54, 4)
    assert second["resumed_from"] == 2 and second["steps"] == (3, 4)
    table = format_goodput(g)
    assert "| 1 | hang | 1–4 |" in table and "7.4 %" in table


def test_a_run_trained_without_the_launcher_still_adds_up(run_dir: Path) -> None:
    events = [e for e in EVENTS if not e["event"].startswith("launch.")]
    g = goodput(run_dir, events=events)
    assert len(g["attempts"]) == 2
    assert abs(sum(g[k] for k in PARTS) - g["total"]) < 1e-6
    assert g["attempts"][1]["outcome"] == "done"


def test_hostile_records_are_skipped_not_fatal(run_dir: Path) -> None:
    events = [*EVENTS, {"event": "save", "time": "soon", "seconds": "x"},
              {"event": "load", "time": 149.0, "seconds": "NaN"}]
    metrics = [*METRICS, {"step": "7", "time": 130.0}, {"step": 8, "time": None}]
    assert goodput(run_dir, events=events, metrics=metrics)["total"] == 54.0


def test_lead_time_warning_from_measured_save_and_step(run_dir: Path) -> None:
    need = safe_signal_lead_s(run_dir)
    assert need == {"save_s": 2.0, "step_s": 1.0, "lead_s": 13.0}
    assert save_time_warning(run_dir, 13) is None
    warning = save_time_warning(run_dir, 12)
    assert warning and "raise signal_delay_s to at least 13" in warning
    (run_dir / "job.json").write_text(json.dumps(
        {"job_id": "7", "launcher": "local", "policy": {"signal_delay_s": 5}}))
    res = subprocess.run([PY, "-m", "pipeline.status", "--results", str(run_dir.parents[1])],
                         capture_output=True, text=True, env=subprocess_env())
    assert res.returncode == 0, res.stderr
    header, row = res.stdout.splitlines()
    assert header.split()[-1] == "goodput" and row.split()[-1] == "7%"
    assert "warning: r: signal_delay_s=5 is shorter" in res.stderr


def test_the_eval_report_has_the_goodput_section(run_dir: Path) -> None:
    from pipeline.evaluate import _report

    m = {"perplexity": 9.0, "loss": 2.2, "tokens": 10, "vocab_size": 300,
         "final_train_loss": None, "step": 4, "lm_eval": {}, "samples": []}
    text = _report("r", m, METRICS, goodput(run_dir))
    assert "## Goodput" in text and "| 2 | done | 3–4 |" in text


def test_background_saves_count_what_training_waited(tmp_path: Path) -> None:
    """With train.checkpoint_async the ``save`` events carry only the staging; the wait before
    the end is a ``save_wait``; both are the ``save`` part, and the report says what blocked."""
    run = tmp_path / "r"
    run.mkdir()
    events = [
        {"event": "start", "time": 10.0, "resumed_from": 0, "attempt": 1},
        {"event": "save", "time": 13.1, "step": 2, "seconds": 0.1, "background": True},
        {"event": "save_commit", "time": 13.9, "step": 2, "seconds": 0.9},
        {"event": "save", "time": 15.3, "step": 4, "seconds": 0.3, "background": True},
        {"event": "save_commit", "time": 16.4, "step": 4, "seconds": 1.1},
        {"event": "save_wait", "time": 16.4, "step": 4, "seconds": 1.1},
        {"event": "finish", "time": 17.0, "step": 4},
    ]
    metrics = [{"step": s, "time": 10.0 + s + (0.1 if s > 2 else 0), "step_time_s": 1.0}
               for s in range(1, 5)]
    g = goodput(run, events=events, metrics=metrics)
    assert g["save"] == pytest.approx(0.1 + 0.3 + 1.1)
    assert g["saves"] == {"count": 2, "background": 2, "blocked_median_s": pytest.approx(0.2),
                          "blocked_max_s": 0.3, "blocked_total_s": 1.5,
                          "committed_median_s": pytest.approx(1.0)}
    text = format_goodput(g)
    assert "Checkpoint saves: 2 (in the background); each blocked training 0.200 s" in text
    assert "written and committed in 1.000 s (median)" in text
