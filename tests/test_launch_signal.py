"""The head node's reaction to the time-limit warning (``NodeTask.checkpoint``) when the
trainer's rank 0 runs on another node and writes its outcome after this node's torchrun ended.

On the test cluster both Slurm nodes share a hostname, so which node holds rank 0 is down to
pids: the race is real but cannot be caused on demand. Here torchrun is a real process that
exits at once and "rank 0" is a thread that writes its file a moment later; ``squeue`` and the
process exit are the only things replaced.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import submitit

from pipeline import artifacts
from pipeline.cluster.options import LaunchOptions
from pipeline.train import node as launch


class _Exited(Exception):
    pass


@pytest.fixture()
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> launch.NodeTask:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setattr(launch, "time_left_s", lambda job_id: 30.0)  # squeue: a timeout
    (tmp_path / "checkpoints").mkdir()

    def _exit(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(launch.os, "_exit", _exit)
    t = launch.NodeTask(str(tmp_path), str(tmp_path / "data"), 1, 2,
                        LaunchOptions(signal_delay_s=60, max_requeues=3))
    t._attempt = "42.0"  # what _run_slurm names this job's first attempt
    return t


def _later(path: Path, payload: dict, delay_s: float) -> threading.Thread:
    def write() -> None:
        time.sleep(delay_s)
        path.write_text(json.dumps(payload))

    th = threading.Thread(target=write)
    th.start()
    return th


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_stop_recorded_by_a_rank_0_on_another_node_is_waited_for(task: launch.NodeTask) -> None:
    run_dir = Path(task.run_dir)
    # This node's ranks stopped (torchrun exits 1 for a rank's EXIT_REQUEUE) before rank 0,
    # elsewhere, wrote stopped.json.
    task._proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    task._proc.wait()
    th = _later(run_dir / "stopped.json", {"step": 17, "attempt": "42.0"}, 3.5)
    task.local_env = {"CUDA_VISIBLE_DEVICES": "3"}
    out = task.checkpoint()
    th.join()
    assert isinstance(out, submitit.helpers.DelayedSubmission)
    assert out.function.local_env == {"CUDA_VISIBLE_DEVICES": "3"}  # the requeued task's GPUs
    saved = [e for e in _events(run_dir) if e["event"] == "launch.saved"]
    assert saved and saved[0]["stopped_at"] == 17 and saved[0]["rc"] == 1
    assert [e["reason"] for e in _events(run_dir) if e["event"] == "launch.requeue"] == ["timeout"]
    assert not (run_dir / artifacts.STOP).exists()


def test_warning_at_the_last_step_ends_the_job_instead_of_requeueing(
        task: launch.NodeTask) -> None:
    run_dir = Path(task.run_dir)
    # The agreed stop step was the last: rank 0, elsewhere, writes train.done after this
    # node's torchrun has already exited 0.
    task._proc = subprocess.Popen([sys.executable, "-c", "pass"])
    task._proc.wait()
    th = _later(run_dir / "train.done", {"step": 900}, 3.5)
    with pytest.raises(_Exited) as exc:
        task.checkpoint()
    th.join()
    assert exc.value.args == (0,)
    names = [e["event"] for e in _events(run_dir)]
    assert "launch.finished_at_signal" in names and "launch.requeue" not in names


def test_a_crash_without_an_outcome_still_requeues_within_the_lead_time(
        task: launch.NodeTask) -> None:
    run_dir = Path(task.run_dir)
    task.policy.signal_delay_s = 12  # the wait is bounded by the warning's lead time
    task._proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    task._proc.wait()
    t0 = time.monotonic()
    out = task.checkpoint()
    assert time.monotonic() - t0 < 12
    assert isinstance(out, submitit.helpers.DelayedSubmission)
    saved = [e for e in _events(run_dir) if e["event"] == "launch.saved"]
    assert saved[0]["stopped_at"] is None and saved[0]["rc"] == 1


def _local_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str,
                *args: str) -> launch.NodeTask:
    """A local NodeTask whose "torchrun" is ``script`` with ``args`` (a real process that exits
    at once)."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    t = launch.NodeTask(str(tmp_path), str(tmp_path / "data"), 1, 1,
                        LaunchOptions(max_failures=1))
    monkeypatch.setattr(t, "_argv", lambda node: [sys.executable, "-c", script, *args])
    return t


def test_a_stop_of_the_previous_attempt_is_not_taken_for_this_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The previous attempt stopped a moment ago (its stopped.json is newer than this attempt's
    # start by any clock's reckoning); this attempt fails before training: a failure, which the
    # launcher must not report as a stop (the job would requeue as if it had saved).
    run_dir = tmp_path
    (run_dir / "stopped.json").write_text(json.dumps({"step": 5, "attempt": "local.old"}))
    task = _local_task(tmp_path, monkeypatch, "raise SystemExit(1)")
    with pytest.raises(RuntimeError, match="not retried"):
        task._run_local(None)
    ends = [e["outcome"] for e in _events(run_dir) if e["event"] == "launch.end"]
    assert ends == ["failed"]


def test_a_stop_of_this_attempt_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 names the attempt from the environment the launcher gave torchrun.
    script = ("import json, os, sys; open(sys.argv[1], 'w').write(json.dumps("
              "{'step': 9, 'attempt': os.environ['ZEROSNAKE_ATTEMPT']})); raise SystemExit(1)")
    task = _local_task(tmp_path, monkeypatch, script, str(tmp_path / "stopped.json"))
    out = task._run_local(None)
    assert out["stopped"]["step"] == 9
    ends = [e["outcome"] for e in _events(tmp_path) if e["event"] == "launch.end"]
    assert ends == ["stopped"]
