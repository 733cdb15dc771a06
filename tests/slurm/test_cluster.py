"""The test Slurm cluster itself: multi-node steps, torchrun across nodes, submitit results,
signal -> checkpoint -> requeue, and hostile strings reaching sbatch as data.

Each test asserts on artifacts the jobs wrote (files, results, Slurm's own record), not on logs.
Job payloads run under this interpreter (sys.executable: the project's virtualenv).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import slurmcluster
import submitit
from submitit.slurm.slurm import SlurmExecutor

# submitit pickles the payload with cloudpickle. This module is not importable inside the job
# (tests/slurm is not on the job's sys.path), so ship its functions and classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PYTHON = sys.executable


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _squeue_field(job_id: str, fmt: str) -> str:
    """One field of a job as Slurm records it (finished jobs stay visible: MinJobAge=600)."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", fmt],
                         capture_output=True, text=True, timeout=30)
    return out.stdout


def _wait_done(job: submitit.Job, timeout: float) -> None:
    """job.wait() without an end; bounded here, with the job's logs when it runs over."""
    deadline = time.monotonic() + timeout
    while not job.done():
        if time.monotonic() > deadline:
            state = _squeue_field(job.job_id, "%T %r").strip()
            subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)
            pytest.fail(f"job {job.job_id} not done after {timeout:.0f} s (state {state!r})\n"
                        f"stdout:\n{job.stdout()}\nstderr:\n{job.stderr()}")
        time.sleep(0.5)


def _executor(cluster: slurmcluster.ClusterInfo, folder: Path, **params) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
    executor.update_parameters(**cluster.submitit_parameters(), **params)
    return executor


# --------------------------------------------------------------------------------------------
# 1. one step on two nodes


def test_srun_two_nodes_distinct_hostnames(slurm_cluster: slurmcluster.ClusterInfo) -> None:
    if len(slurm_cluster.nodes) < 2:
        pytest.skip("the partition has fewer than two nodes")
    proc = _run(["srun", *slurm_cluster.sbatch_args(), "-N2", "--ntasks-per-node=1",
                 "--time=1", "hostname"], timeout=60)
    names = proc.stdout.split()
    assert len(names) == 2 and len(set(names)) == 2, proc.stdout
    if slurm_cluster.managed:
        assert set(names) == set(slurm_cluster.nodes[:2])


# --------------------------------------------------------------------------------------------
# 2. torchrun across two nodes, gloo all_reduce

ALLREDUCE = """\
import json, os, socket, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
out = {"rank": rank, "world": world, "sum": value.item(), "host": socket.gethostname(),
       "job": os.environ.get("SLURM_JOB_ID"), "node_id": os.environ.get("SLURM_NODEID")}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""

# One task per node runs this: it finds the head node (first of the allocation) and a port
# derived from the job id, then execs torchrun with an argument list (no shell).
LAUNCH = """\
import os, subprocess, sys
nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                       capture_output=True, text=True, check=True).stdout.split()
port = 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000
cmd = [sys.executable, "-m", "torch.distributed.run",
       "--nnodes", os.environ["SLURM_NNODES"], "--nproc_per_node", "1",
       "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{nodes[0]}:{port}",
       "--rdzv_id", os.environ["SLURM_JOB_ID"], *sys.argv[1:]]
os.execv(sys.executable, cmd)
"""


def test_torchrun_two_nodes_gloo_allreduce(slurm_cluster: slurmcluster.ClusterInfo,
                                           slurm_workdir: Path) -> None:
    if len(slurm_cluster.nodes) < 2:
        pytest.skip("the partition has fewer than two nodes")
    (slurm_workdir / "allreduce.py").write_text(ALLREDUCE)
    (slurm_workdir / "launch.py").write_text(LAUNCH)
    out = slurm_workdir / "out"
    out.mkdir()
    env = {**slurm_cluster.job_env(), "OMP_NUM_THREADS": "1"}
    _run(["srun", *slurm_cluster.sbatch_args(), "--nodes=2", "--ntasks-per-node=1", "--time=5",
          PYTHON, str(slurm_workdir / "launch.py"), str(slurm_workdir / "allreduce.py"), str(out)],
         timeout=240, env=env)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in ranks), ranks
    assert len({r["host"] for r in ranks}) == 2, ranks  # both nodes took part
    assert {r["node_id"] for r in ranks} == {"0", "1"}
    assert len({r["job"] for r in ranks}) == 1


# --------------------------------------------------------------------------------------------
# 3. submitit returns a result


def where_am_i(x: int) -> dict:
    return {"answer": x * 7, "host": socket.gethostname(), "job": os.environ.get("SLURM_JOB_ID"),
            "python": sys.executable}


def test_submitit_result(slurm_cluster: slurmcluster.ClusterInfo, slurm_workdir: Path) -> None:
    executor = _executor(slurm_cluster, slurm_workdir / "submitit", timeout_min=5)
    job = executor.submit(where_am_i, 6)
    _wait_done(job, timeout=120)
    result = job.result()
    assert result["answer"] == 42
    assert result["job"] == job.job_id
    assert result["python"] == PYTHON
    if slurm_cluster.managed:
        assert result["host"] in slurm_cluster.nodes
        assert result["host"] != socket.gethostname()  # ran on a node, not on the submit host


def test_submitit_two_nodes(slurm_cluster: slurmcluster.ClusterInfo, slurm_workdir: Path) -> None:
    # submitit's batch script runs `srun` from the first node: the step must reach the second.
    if len(slurm_cluster.nodes) < 2:
        pytest.skip("the partition has fewer than two nodes")
    executor = _executor(slurm_cluster, slurm_workdir / "submitit", timeout_min=5, nodes=2,
                         tasks_per_node=1)
    job = executor.submit(where_am_i, 1)
    _wait_done(job, timeout=120)
    results = job.results()
    assert len(results) == 2
    assert len({r["host"] for r in results}) == 2, results
    assert {r["job"] for r in results} == {job.job_id}


def test_config_found_without_slurm_conf(slurm_cluster: slurmcluster.ClusterInfo) -> None:
    # Snakemake's jobstep plugin strips SLURM_CONF before its inner srun: clients inside a job
    # must find the configuration at the default path (/etc/slurm/slurm.conf on the node).
    proc = _run(["srun", *slurm_cluster.sbatch_args(), "-N1", "--time=1",
                 "env", "-u", "SLURM_CONF", "sinfo", "-h", "-o", "%R"], timeout=60)
    assert slurm_cluster.partition in proc.stdout.split(), proc.stdout


# --------------------------------------------------------------------------------------------
# 4. time-limit warning (USR2) -> checkpoint -> requeue (same job id) -> resume


class SleepUntilRequeued(submitit.helpers.Checkpointable):
    """First run: sleeps past the warning. After a requeue: returns at once."""

    def __call__(self, marker_dir: str, seconds: float) -> dict:
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        Path(marker_dir, f"start-{restarts}").write_text(os.environ.get("SLURM_JOB_ID", ""))
        if restarts == 0:
            time.sleep(seconds)  # interrupted by USR2 -> checkpoint() -> requeue
        return {"restarts": restarts, "job": os.environ.get("SLURM_JOB_ID"),
                "host": socket.gethostname()}

    def checkpoint(self, marker_dir: str, seconds: float) -> submitit.helpers.DelayedSubmission:
        Path(marker_dir, "checkpoint").write_text(f"{time.time()}\n")
        return super().checkpoint(marker_dir, seconds)


def test_signal_checkpoint_requeue(slurm_cluster: slurmcluster.ClusterInfo,
                                   slurm_workdir: Path) -> None:
    # Limit 1 min, warning 15 s before it. slurmctld checks limits every ~30 s and signals at
    # the first check within 30 s + 15 s of the end ("up to 60 seconds earlier than specified",
    # sbatch(1)): 15-45 s after the start, once the job's handler is in place. (A warning of
    # 40 s was due at once: one run in a dozen got USR2 before Python had installed it, and
    # the signal's default action killed the task.) The requeued job starts again within ~6 s
    # (cred_expire=5, sched_interval=2) and returns at once, well before its own warning.
    # Bounded at 150 s; without the signal the job would hit its limit.
    markers = slurm_workdir / "markers"
    markers.mkdir()
    executor = _executor(slurm_cluster, slurm_workdir / "submitit", timeout_min=1,
                         slurm_signal_delay_s=15)
    t0 = time.monotonic()
    job = executor.submit(SleepUntilRequeued(), str(markers), 120.0)
    _wait_done(job, timeout=150)
    result = job.result()
    elapsed = time.monotonic() - t0
    assert (markers / "checkpoint").exists(), "checkpoint() was not called (no USR2?)"
    assert (markers / "start-0").read_text() == job.job_id
    assert result["restarts"] >= 1, result
    assert result["job"] == job.job_id  # requeued, not resubmitted under a new id
    assert (markers / f"start-{result['restarts']}").read_text() == job.job_id
    assert elapsed < 150
    print(f"requeue test: {elapsed:.1f} s, restarts={result['restarts']}")


# --------------------------------------------------------------------------------------------
# 5. hostile strings reach sbatch as data

# Shell metacharacters that would run a command if anything on the way used a shell.
HOSTILE = "evil; touch PWNED1 \"dq\" 'sq' $(touch PWNED2) `touch PWNED3` && touch PWNED4 # %j"
# Newline and backslash: plain text too, but they do not survive #SBATCH directive lines.
HOSTILE_NL = "evil\\n \\ back\ntouch PWNED5 # $(touch PWNED6)"


def _assert_nothing_ran(*folders: Path) -> None:
    for folder in folders:
        pwned = sorted(p.name for p in folder.rglob("PWNED*"))
        assert not pwned, f"a hostile string ran as a command: {pwned} in {folder}"


def test_hostile_strings_via_submitit(slurm_cluster: slurmcluster.ClusterInfo,
                                      slurm_workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The submitting process and the job both start in slurm_workdir: a command that ran would
    # leave PWNED* files there.
    monkeypatch.chdir(slurm_workdir)
    executor = _executor(slurm_cluster, slurm_workdir / "submitit", timeout_min=5, name=HOSTILE,
                         slurm_additional_parameters={"comment": HOSTILE})
    job = executor.submit(os.getcwd)
    _wait_done(job, timeout=120)
    assert job.result() == str(slurm_workdir)
    assert _squeue_field(job.job_id, "%j") == HOSTILE + "\n"
    assert _squeue_field(job.job_id, "%k") == HOSTILE + "\n"
    _assert_nothing_ran(slurm_workdir, Path.cwd())


def test_hostile_newline_via_submitit_fails_closed(slurm_cluster: slurmcluster.ClusterInfo,
                                                   slurm_workdir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # submitit 1.5 writes the name into a `#SBATCH --job-name='...'` line; a newline splits that
    # line and sbatch refuses the script ("Unmatched '"). Safe (nothing runs), but the name does
    # not reach Slurm: carry such values on sbatch's argv (next test).
    monkeypatch.chdir(slurm_workdir)
    executor = _executor(slurm_cluster, slurm_workdir / "submitit", timeout_min=5, name=HOSTILE_NL)
    with pytest.raises(submitit.core.utils.FailedJobError, match="Unmatched"):
        executor.submit(os.getcwd)
    time.sleep(2)
    _assert_nothing_ran(slurm_workdir)


class ArgvNameSlurmExecutor(SlurmExecutor):
    """Passes the job name on sbatch's argv (overrides the script's #SBATCH line), so any
    string, newline and backslash included, reaches Slurm unchanged."""

    def __init__(self, folder: Path, job_name: str) -> None:
        super().__init__(folder=folder)
        self.job_name = job_name

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return ["sbatch", f"--job-name={self.job_name}", str(submission_file_path)]


def test_hostile_newline_via_sbatch_argv(slurm_cluster: slurmcluster.ClusterInfo,
                                         slurm_workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(slurm_workdir)
    executor = ArgvNameSlurmExecutor(slurm_workdir / "submitit" / "%j", HOSTILE_NL + " " + HOSTILE)
    executor.update_parameters(time=5, partition=slurm_cluster.partition,
                               **({"account": slurm_cluster.account} if slurm_cluster.account else {}))
    job = executor.submit(os.getcwd)
    _wait_done(job, timeout=120)
    assert job.result() == str(slurm_workdir)
    assert _squeue_field(job.job_id, "%j") == HOSTILE_NL + " " + HOSTILE + "\n"
    _assert_nothing_ran(slurm_workdir)
