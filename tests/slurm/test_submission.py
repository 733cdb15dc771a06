"""The rendered submission (``pipeline.cluster.sbatch.render_submission``) is what Slurm gets: submitted
through the launcher's executor, a trivial job runs with the rendered options, and Slurm's own
record (``scontrol``) shows the name, time limit, requeue flag and the very script."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import slurmcluster

from pipeline.cluster.options import LaunchOptions
from pipeline.cluster.sbatch import render_submission
from pipeline.train.submit import ArgvSlurmExecutor

NAME = "zs it's \"odd\" $(touch PWNED) `touch PWNED2` \\ end"


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout


def test_rendered_submission_runs_with_its_options(slurm_cluster: slurmcluster.ClusterInfo,
                                                   slurm_workdir: Path) -> None:
    opts = LaunchOptions(launcher="slurm", job_name=NAME, partition=slurm_cluster.partition,
                         account=slurm_cluster.account or None, time_min=3, cpus_per_task=1,
                         signal_delay_s=45, sbatch={"comment": NAME})
    folder = slurm_workdir / "submitit" / "%j"
    sub = render_submission(opts, nodes=1, gpus_per_node=1, device="cpu", folder=folder)
    job = ArgvSlurmExecutor(folder, sub, max_num_timeout=1).submit(int, "42")
    deadline = time.monotonic() + 120
    while not job.done():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)
            pytest.fail(f"job {job.job_id} not done after 120 s\n{job.stderr()}")
        time.sleep(0.5)
    assert job.result() == 42
    # Slurm's record of the job (finished jobs stay visible: MinJobAge=600).
    squeue = subprocess.run(["squeue", "-h", "-t", "all", "-j", job.job_id, "-o", "%j|%l|%k"],
                            capture_output=True, text=True, timeout=30).stdout
    assert squeue == f"{NAME}|3:00|{NAME}\n"
    record = _scontrol("show", "job", job.job_id)
    assert "Requeue=1" in record and "TimeLimit=00:03:00" in record
    assert f"Partition={slurm_cluster.partition}" in record
    assert _scontrol("write", "batch_script", job.job_id, "-") == sub.script
    pwned = list(slurm_workdir.rglob("PWNED*")) + list(Path.cwd().glob("PWNED*"))
    assert not pwned, pwned
