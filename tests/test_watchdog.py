"""The hang watchdog and goodput with the real local launcher: 2 fsdp ranks under torchrun under
submitit's local executor, faults caused for real (SIGSTOP, SIGUSR2, SIGKILL).

1. A rank frozen with SIGSTOP mid-run is named (rank, host, process state) in events.jsonl and
   in the launcher's log within the hang timeout; its torchrun is killed, the launcher retries
   from the last checkpoint and the run finishes.
2. A run with one time-limit requeue (USR2 to the job) and one failure (SIGKILL of a rank):
   its goodput parts add up to its total, each attempt's too, and the lost work is the steps
   computed twice.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from pipeline.artifacts import heartbeat_path
from pipeline.observe.goodput import PARTS, goodput
from pipeline.train.watchdog import Limits, Watch, kill_tree
from tests.conftest import PY, subprocess_env
from tests.test_resume import CONFIG, run_cli, tokenize_for_tests

pytestmark = pytest.mark.slow

STEPS = 150
HANG_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenize_for_tests(tmp_path_factory.mktemp("watchdog-data"), CONFIG)


def _render(data_dir: Path, run_dir: Path) -> Path:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(yaml.safe_dump(CONFIG))
    cfg["train"].update(max_steps=STEPS, checkpoint_every=10, record_samples=False)
    cfg["runs"] = {"w": {}}
    path = run_dir.parent / "watchdog.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_cli("pipeline.render", "--config", str(path), "--run", "w", "--out", str(run_dir),
            "--data-manifest", str(data_dir / "manifest.json"))
    return run_dir


#: The launching shell's GPU list: the local launcher must hand it to torchrun unchanged
#: (submitit's local executor would set it to none). No such GPU here: the run is on CPU.
VISIBLE = "7"


def _launch(run_dir: Path, data_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "pipeline.train", "launch", "--run-dir", str(run_dir), "--data-dir",
         str(data_dir), "--launcher", "local", f"--hang-timeout-s={HANG_TIMEOUT_S}",
         "--hang-startup-s=300", "--hang-save-s=120", "--max-failures=1"],
        env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": VISIBLE}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _events(run_dir: Path, name: str | None = None) -> list[dict]:
    path = run_dir / "events.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [e for e in recs if name is None or e["event"] == name]


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of this run's worker with RANK=rank (its environment, as torchrun set it)."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if "worker" in cmd and str(run_dir) in cmd and p.environ().get("RANK") == str(rank):
                return p.pid
        except psutil.Error:
            continue
    return None


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, attempt: int) -> None:
    deadline = time.monotonic() + 300
    while not any(m["step"] >= step and m["attempt"] == attempt for m in _steps(run_dir)):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, f"no step {step} in attempt {attempt}"
        time.sleep(0.02)


def _finish(proc: subprocess.Popen) -> str:
    try:
        _, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the launcher did not finish")
    assert proc.returncode == 0, err[-6000:]
    return err


def test_a_frozen_rank_is_named_killed_and_the_run_retried(data_dir: Path, tmp_path: Path):
    run_dir = _render(data_dir, tmp_path / "runs" / "w")
    proc = _launch(run_dir, data_dir)
    try:
        _wait_for_step(run_dir, proc, 15, attempt=1)  # past the checkpoint of step 10
        pid = _rank_pid(run_dir, 1)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()
        err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    hangs = _events(run_dir, "launch.hang")
    assert len(hangs) == 1, hangs
    named = {r["rank"]: r for r in hangs[0]["ranks"]}
    assert named[1]["pid"] == pid and named[1]["host"] == socket.gethostname()
    assert named[1]["state"].startswith("stopped") and named[1]["phase"] == "train"
    assert named[1]["suspect"] and hangs[0]["ranks"][0]["rank"] == 1  # the culprit first
    # Detected after the timeout, not at the time limit: within the timeout plus the
    # heartbeat's and the poll's one-second granularity (and a loaded CI machine's slack).
    # (The frozen rank is named even if the rank blocked on it went stale first: heartbeats
    # are throttled to one a second, so either may look older.)
    assert max(r["stale_s"] for r in hangs[0]["ranks"]) >= HANG_TIMEOUT_S
    assert named[1]["stale_s"] >= HANG_TIMEOUT_S - 1.5
    assert hangs[0]["time"] - frozen_at < HANG_TIMEOUT_S + 10
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert f"hang: rank 1 on {socket.gethostname()} (pid {pid})" in err
    failures = _events(run_dir, "launch.failure")
    assert len(failures) == 1 and failures[0]["hang"] is True
    assert [e["reason"] for e in _events(run_dir, "launch.requeue")] == ["failure"]
    starts = _events(run_dir, "start")
    assert len(starts) == 2 and starts[1]["resumed_from"] >= 10, starts
    # Both attempts saw the launching shell's GPUs (the retry included).
    assert [s["cuda_visible_devices"] for s in starts] == [VISIBLE, VISIBLE], starts
    assert starts[1]["resumed_from"] == int(hangs[0]["checkpoint"].split("-")[1])
    assert json.loads((run_dir / "train.done").read_text())["step"] == STEPS
    g = goodput(run_dir)
    assert [a["outcome"] for a in g["attempts"]] == ["hang", "done"]
    assert g["lost"] >= HANG_TIMEOUT_S  # the wait for the frozen rank is lost time


def _task_pid(run_dir: Path) -> int:
    """The node task's pid (submitit's job process): torchrun's parent, rank 0's grandparent."""
    pid = _rank_pid(run_dir, 0)
    assert pid is not None
    return psutil.Process(pid).parent().parent().pid


def test_goodput_of_a_run_with_a_requeue_and_a_failure_adds_up(data_dir: Path, tmp_path: Path):
    run_dir = _render(data_dir, tmp_path / "runs" / "w")
    proc = _launch(run_dir, data_dir)
    try:
        _wait_for_step(run_dir, proc, 12, attempt=1)
        os.kill(_task_pid(run_dir), signal.SIGUSR2)  # the time-limit warning, as submitit's
        _wait_for_step(run_dir, proc, 45, attempt=2)
        victim = _rank_pid(run_dir, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = _events(run_dir)
    assert [e["reason"] for e in events if e["event"] == "launch.requeue"] == ["timeout",
                                                                                "failure"]
    g = goodput(run_dir)
    assert [a["outcome"] for a in g["attempts"]] == ["requeue", "failed", "done"]
    # The whole: from the submission to the last attempt's end, every second in one part.
    submit = next(e["time"] for e in events if e["event"] == "launch.submit")
    end = [e["time"] for e in events if e["event"] == "launch.end"][-1]
    assert abs(g["total"] - (end - submit)) < 1
    assert abs(sum(g[k] for k in PARTS) - g["total"]) < 1
    for a in g["attempts"]:
        wall = a["queue"] + a["end"] - a["begin"]
        assert abs(sum(a[k] for k in PARTS) - wall) < 1, a
        assert min(a[k] for k in PARTS if k != "unaccounted") >= 0, a
        assert abs(a["unaccounted"]) < 1, a
    first, failed, last = g["attempts"]
    assert first["lost"] == 0 and first["save"] > 0  # stopped at a saved step: nothing lost
    assert last["load"] > 0 and failed["load"] > 0
    assert failed["queue"] > 0  # submitit's restart of the job after the requeue
    # Lost: the failed attempt's steps after the checkpoint the last attempt resumed from.
    resumed = last["resumed_from"]
    redo = [m for m in _steps(run_dir) if m["attempt"] == 2 and m["step"] > resumed]
    assert redo, "the kill came right after a checkpoint: nothing was computed twice"
    assert failed["lost"] >= sum(m["step_time_s"] for m in redo)
    assert 0 < g["goodput"] < 1
    # status shows it; its --json carries the breakdown.
    res = subprocess.run([PY, "-m", "pipeline.status", "--results", str(tmp_path), "--json"],
                         capture_output=True, text=True, env=subprocess_env())
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout.splitlines()[0])
    assert shown["goodput"]["total"] == g["total"]


def test_local_gpu_env_keeps_the_shells_gpus():
    from pipeline.train.node import local_gpu_env

    assert local_gpu_env("cuda", {"CUDA_VISIBLE_DEVICES": "2,3"}) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert local_gpu_env("auto", {"CUDA_VISIBLE_DEVICES": "GPU-1f2e"}) == {
        "CUDA_VISIBLE_DEVICES": "GPU-1f2e"}
    assert local_gpu_env("auto", {}) == {"CUDA_VISIBLE_DEVICES": None}  # unset: all GPUs
    assert local_gpu_env("cpu", {"CUDA_VISIBLE_DEVICES": "0"}) == {"CUDA_VISIBLE_DEVICES": ""}


def _fake_torchrun(ranks: int) -> tuple[subprocess.Popen, list[int]]:
    """A parent with ``ranks`` sleeping children that carry RANK in their environment (as
    torchrun's workers do); returns it and the children's pids, in rank order."""
    code = ("import os, subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
            "                         env={**os.environ, 'RANK': str(r)}) for r in range(RANKS)]\n"
            "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
            "time.sleep(60)\n").replace("RANKS", str(ranks))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    return parent, [int(p) for p in parent.stdout.readline().split()]


def _beat(run_dir: Path, rank: int, pid: int, step: int) -> None:
    path = heartbeat_path(run_dir, rank)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "step": step, "phase": "train", "host": "h",
                                "pid": pid, "time": time.time()}))


def test_a_waiting_node_defers_to_the_node_of_the_frozen_rank(tmp_path: Path):
    """Several nodes: stale ranks that are only waiting (blocked in a collective) are reported
    ``defer_s`` after their limit, a stopped rank at its limit (the race of the Slurm test:
    throttled heartbeats let the blocked node see its limit pass first)."""
    parent, pids = _fake_torchrun(2)
    try:
        for rank, pid in enumerate(pids):
            _beat(tmp_path, rank, pid, 7)
        limits = Limits(train_s=0.5, startup_s=0.5, save_s=0.5)
        waiting = Watch(tmp_path, parent.pid, limits, defer_s=1.5)
        alone = Watch(tmp_path, parent.pid, limits)
        assert waiting.poll() == [] and alone.poll() == []
        time.sleep(1.0)
        assert waiting.poll() == []  # past the limit, within the deferral
        assert [s.rank for s in alone.poll()] == [0, 1]  # one node: nobody else to wait for
        time.sleep(1.2)
        assert [s.rank for s in waiting.poll()] == [0, 1]  # past limit + defer_s
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(0.1)
        frozen = Watch(tmp_path, parent.pid, limits, defer_s=30)
        frozen.poll()
        time.sleep(0.8)
        stale = frozen.poll()  # a stopped rank: named at its limit, deferral or not
        assert [(s.rank, s.suspect) for s in stale] == [(1, True), (0, False)]
        assert stale[0].state.startswith("stopped")
    finally:
        kill_tree(parent.pid)
        parent.wait()
