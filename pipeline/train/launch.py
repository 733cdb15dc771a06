"""Submit a run's training through submitit and wait for it (the train rule's entry point).

Locally, submitit's ``LocalExecutor`` runs one node task; on Slurm its ``SlurmExecutor`` runs
one task per node. Each node task starts one ``torchrun`` (an argument list, never a shell
string) that runs ``python -m pipeline.train worker`` on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from pipeline.config import load_run_config
from pipeline.distenv import node_env_from_slurm, torchrun_argv
from pipeline.errors import PipelineError
from pipeline.io import read_json, write_json_atomic
from pipeline.train.loop import STOP_FILE

log = logging.getLogger("pipeline.train.launch")


@dataclass(kw_only=True)
class SlurmOptions:
    """What the profile says about the Slurm job (resources, not experiment settings)."""

    partition: str | None = None
    """Partition (``sbatch -p``)."""
    account: str | None = None
    """Account to charge."""
    qos: str | None = None
    """Quality of service."""
    constraint: str | None = None
    """Node features (``--constraint``)."""
    exclude: str | None = None
    """Nodes not to use."""
    time_min: int = 60
    """Time limit of one job attempt, minutes."""
    cpus_per_task: int = 2
    """CPUs per node task (torchrun and its workers)."""
    mem_gb: float | None = None
    """Memory per node."""
    signal_delay_s: int = 90
    """Seconds before the time limit when USR2 asks the job to checkpoint."""
    max_requeues: int = 3
    """Requeues after a timeout or preemption before giving up."""
    job_name: str = "zerosnake"
    """Job name as Slurm shows it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Extra sbatch options (submitit's ``slurm_additional_parameters``)."""


class NodeTask(submitit.helpers.Checkpointable):
    """One node's share of a training job: run torchrun, bridge the stop signal to the ranks."""

    def __init__(self, run_dir: str, data_dir: str, nproc_per_node: int, nnodes: int) -> None:
        self.run_dir = run_dir
        self.data_dir = data_dir
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self._proc: subprocess.Popen | None = None

    def __call__(self) -> dict[str, Any]:
        node = node_env_from_slurm() if "SLURM_JOB_ID" in os.environ else None
        if node is not None and node.nnodes != self.nnodes:
            raise PipelineError(f"job has {node.nnodes} nodes, the plan {self.nnodes}")
        argv = torchrun_argv(
            sys.executable,
            node=node,
            nproc_per_node=self.nproc_per_node,
            module="pipeline.train",
            args=["worker", "--run-dir", self.run_dir, "--data-dir", self.data_dir],
        )
        run_dir = Path(self.run_dir)
        self._proc = subprocess.Popen(argv)
        rc = self._proc.wait()
        done = run_dir / "train.done"
        if rc == 0 and done.exists():
            return read_json(done)
        if (run_dir / "stopped.json").exists():
            return {"stopped": read_json(run_dir / "stopped.json")}
        raise RuntimeError(f"torchrun exited with status {rc}; see the rank logs above")

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on the time-limit/preemption signal: ask the ranks to stop at
        an agreed step and save, wait until they have, then let submitit requeue the job."""
        (Path(self.run_dir) / STOP_FILE).touch()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                self._proc.send_signal(signal.SIGTERM)
        (Path(self.run_dir) / STOP_FILE).unlink(missing_ok=True)
        fresh = NodeTask(self.run_dir, self.data_dir, self.nproc_per_node, self.nnodes)
        return submitit.helpers.DelayedSubmission(fresh)


def launch(run_dir: Path, data_dir: Path, *, launcher: str, slurm: SlurmOptions) -> dict[str, Any]:
    """Submit the run's training job and wait for it; returns ``train.done``'s content."""
    run_dir = run_dir.resolve()
    data_dir = data_dir.resolve()
    run = load_run_config(run_dir / "config.json")
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    folder = run_dir / "submitit"
    task = NodeTask(str(run_dir), str(data_dir), run.cluster.gpus_per_node, run.cluster.nodes)
    if launcher == "local":
        if run.cluster.nodes != 1:
            raise PipelineError(
                f"cluster.nodes is {run.cluster.nodes}, but the local launcher runs one node; "
                "use --profile profiles/slurm or set cluster.nodes: 1"
            )
        executor: submitit.Executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=slurm.time_min, tasks_per_node=1, nodes=1)
    elif launcher == "slurm":
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=slurm.max_requeues)
        params: dict[str, Any] = {
            "nodes": run.cluster.nodes,
            "ntasks_per_node": 1,
            "cpus_per_task": slurm.cpus_per_task,
            "time": slurm.time_min,
            "job_name": slurm.job_name,
            "signal_delay_s": slurm.signal_delay_s,
            "additional_parameters": dict(slurm.extra),
        }
        if run.cluster.device != "cpu":
            params["gpus_per_node"] = run.cluster.gpus_per_node
        for key in ("partition", "account", "qos", "constraint", "exclude"):
            if getattr(slurm, key):
                params[key] = getattr(slurm, key)
        if slurm.mem_gb:
            params["mem"] = f"{int(slurm.mem_gb * 1024)}M"
        executor.update_parameters(**params)
    else:
        raise PipelineError(f"unknown launcher {launcher!r}: use local or slurm")
    job = executor.submit(task)
    write_json_atomic(
        run_dir / "job.json",
        {"job_id": str(job.job_id), "launcher": launcher, "submitted": time.time(),
         "folder": str(folder)},
    )
    log.info("submitted training job %s (%s)", job.job_id, launcher)

    def _cancel(signum: int, frame: Any) -> None:
        # The rule was killed: take the job down with it rather than leave a second trainer
        # running when Snakemake is started again. (On Slurm, reattaching is issue #6's work.)
        if launcher == "local":
            job.cancel(check=False)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _cancel)
    signal.signal(signal.SIGINT, _cancel)
    try:
        result = job.result()
    except Exception as err:  # submitit wraps the task's exception with its traceback
        raise PipelineError(f"training job {job.job_id} failed:\n{err}") from None
    if not (run_dir / "train.done").exists():
        raise PipelineError(f"training job {job.job_id} ended without train.done: {result}")
    return read_json(run_dir / "train.done")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m pipeline.train launch",
        description="Submit a rendered run's training (submitit) and wait until it finishes.",
    )
    p.add_argument("--run-dir", type=Path, required=True, help="results/runs/<run> (rendered)")
    p.add_argument("--data-dir", type=Path, required=True, help="results/data (manifest.json)")
    p.add_argument("--launcher", choices=["local", "slurm"], default="local")
    g = p.add_argument_group("Slurm job (from the profile; empty means unset)")
    for flag in ("partition", "account", "qos", "constraint", "exclude"):
        g.add_argument(f"--{flag}", default="")
    g.add_argument("--time-min", type=int, default=60)
    g.add_argument("--cpus-per-task", type=int, default=2)
    g.add_argument("--mem-gb", type=float, default=0)
    g.add_argument("--signal-delay-s", type=int, default=90)
    g.add_argument("--max-requeues", type=int, default=3)
    g.add_argument("--job-name", default="zerosnake")
    g.add_argument(
        "--sbatch", action="append", default=[], metavar="KEY=VALUE",
        help="extra sbatch option (repeatable), e.g. --sbatch reservation=myres",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        extra = {}
        for item in args.sbatch:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise PipelineError(f"--sbatch {item!r}: expected KEY=VALUE")
            extra[key] = value
        opts = SlurmOptions(
            partition=args.partition or None,
            account=args.account or None,
            qos=args.qos or None,
            constraint=args.constraint or None,
            exclude=args.exclude or None,
            time_min=args.time_min,
            cpus_per_task=args.cpus_per_task,
            mem_gb=args.mem_gb or None,
            signal_delay_s=args.signal_delay_s,
            max_requeues=args.max_requeues,
            job_name=args.job_name,
            extra=extra,
        )
        summary = launch(args.run_dir, args.data_dir, launcher=args.launcher, slurm=opts)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0
