"""Submit a run's training through submitit and wait for it (the train rule's entry point).

Locally, submitit's ``LocalExecutor`` runs one node task; on Slurm its ``SlurmExecutor`` runs
one task per node. Each node task starts one ``torchrun`` (an argument list, never a shell
string) that runs ``python -m pipeline.train worker`` on every rank.

On Slurm the job looks after itself, so that it keeps going while nobody watches it:

* time-limit/preemption warning (``--signal=USR2@signal_delay_s``): submitit calls
  ``NodeTask.checkpoint()`` on the head node's task; it writes the run dir's ``STOP`` file, which
  every rank on every node sees (the ranks agree on a step through an all-reduce, save one
  complete checkpoint and exit ``EXIT_REQUEUE``), waits for the save, and submitit requeues the
  job (same job id). Timeouts and preemptions are told apart (the time left when the signal
  came) and each has its own bound.
* rank or node failure (torchrun exits with anything else): the head node's task requeues the
  job itself, which resumes from the last complete checkpoint, up to ``max_failures`` times; a
  node that failed its rendezvous is added to the job's exclude list.

The launcher on the login node records the job in ``job.json``, waits across PENDING/REQUEUED
cycles (one Snakemake step), and when started again while the job still runs, reattaches to it
instead of submitting a second one. What happened is in ``events.jsonl`` (events named
``launch.*``) and ``nodes/r<restart>-n<node>.json`` (one file per node and attempt).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import submitit

from pipeline.config import load_run_config
from pipeline.distenv import (
    JobState,
    NodeEnv,
    node_env_from_slurm,
    partition_nodes,
    scontrol_job,
    squeue_states,
    time_left_s,
    torchrun_argv,
)
from pipeline.errors import PipelineError
from pipeline.io import read_json, write_json_atomic
from pipeline.train.loop import EXIT_REQUEUE, STOP_FILE

log = logging.getLogger("pipeline.train.launch")

#: torchrun's own messages when a node could not join the rendezvous (elastic's error classes).
RDZV_ERROR_RE = re.compile(
    rb"Rendezvous(Timeout|Closed|Connection|State)Error|DistNetworkError|"
    rb"rendezvous .*(timed out|failed)",
    re.IGNORECASE,
)
#: Seconds a signal may come before the limit and still count as the time-limit warning:
#: slurmctld checks limits about every 30 s, so the warning lands up to ~60 s early.
TIMEOUT_SLACK_S = 75
SBATCH_KEY_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


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
    """Requeues after a time-limit warning before giving up."""
    max_preemptions: int = 10
    """Requeues after a preemption before giving up."""
    max_failures: int = 2
    """Requeues after a rank or node failure (from the last complete checkpoint)."""
    job_name: str = "zerosnake"
    """Job name as Slurm shows it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Extra sbatch options as ``{key: value}`` (``--key=value``; ``True`` for a bare flag)."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra sbatch options as ready arguments (``--reservation=x``)."""
    job_env: dict[str, str] = field(default_factory=dict)
    """Environment of the node tasks and ranks (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, ...)."""
    poll_s: float = 5.0
    """Seconds between two squeue polls of the waiting launcher."""


@dataclass(kw_only=True)
class JobPolicy:
    """What a node task needs to know about its job: budgets and environment (pickled with it)."""

    max_requeues: int = 3
    max_preemptions: int = 10
    max_failures: int = 2
    signal_delay_s: int = 90
    partition: str | None = None
    exclude: list[str] = field(default_factory=list)
    job_env: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# run-dir records


def append_event(run_dir: Path, name: str, **kw: Any) -> None:
    """One line in events.jsonl, from the head node's task. The trainer's rank 0 appends too: the
    c10d rendezvous orders nodes by hostname (then pid), which on a cluster puts it on the
    head node (SLURM_NODEID 0, first in sorted order); appends from one host stay whole, from
    several hosts over NFS they may not. Readers skip a cut line."""
    rec = {"event": name, "time": time.time(), **kw}
    with (run_dir / "events.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash: skip, the rest still counts
    return out


def requeues_of(run_dir: Path, job_id: str, reason: str) -> int:
    """Requeues of this job for one reason (timeout, preemption, failure) so far."""
    return sum(
        1 for e in read_events(run_dir)
        if e.get("event") == "launch.requeue" and e.get("job_id") == job_id
        and e.get("reason") == reason
    )


def measured_save_seconds(run_dir: Path) -> float | None:
    """The longest checkpoint save seen for this run, from the ranks' ``save`` events and from
    the checkpoint folders themselves (first file written → manifest time). None when nothing
    was saved yet."""
    found: list[float] = []
    for e in read_events(run_dir):
        if e.get("event") == "save" and e.get("seconds") is not None:  # the ranks' own timing
            found.append(float(e["seconds"]))
    # (launch.saved's save_s also counts the wait for the current step and for start-up when
    # the signal came early: it is reported, not used here.)
    root = run_dir / "checkpoints"
    if root.is_dir():
        for ck in root.glob("step-*"):
            try:
                end = float(read_json(ck / "manifest.json")["time"])
                first = min(f.stat().st_mtime for f in ck.rglob("*") if f.is_file())
            except (OSError, ValueError, KeyError):
                continue
            found.append(max(0.0, end - first))
    return max(found) if found else None


def save_time_warning(run_dir: Path, signal_delay_s: int) -> str | None:
    """A warning when the lead time of the time-limit signal is shorter than a measured save."""
    save_s = measured_save_seconds(run_dir)
    if save_s is None or signal_delay_s >= save_s:
        return None
    return (
        f"signal_delay_s={signal_delay_s} is shorter than the measured checkpoint time "
        f"({save_s:.1f} s): the time-limit warning may come too late to save; raise "
        "signal_delay_s in the profile"
    )


def latest_checkpoint(run_dir: Path) -> str | None:
    """Name of the newest checkpoint folder with a manifest (cheap: no checksums)."""
    done = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")
                  if (p / "manifest.json").is_file())
    return done[-1] if done else None


# --------------------------------------------------------------------------------------------
# node task (runs inside the job, one per node)


def _ignore_usr2() -> None:
    # torchrun has no handler for USR2 and would die of it: Slurm signals every process of the
    # step, not only the task. Ignored stays ignored across exec, so torchrun survives; the
    # workers install their own handler (StopRequest) and the STOP file reaches them anyway.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class NodeTask(submitit.helpers.Checkpointable):
    """One node's share of a training job: run torchrun, bridge the stop signal to the ranks."""

    def __init__(
        self,
        run_dir: str,
        data_dir: str,
        nproc_per_node: int,
        nnodes: int,
        policy: JobPolicy | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.data_dir = data_dir
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self.policy = policy
        self._proc: subprocess.Popen | None = None
        self._node: NodeEnv | None = None
        self._rdzv_error = False

    def __getstate__(self) -> dict[str, Any]:
        # A requeue pickles the task again: the running process is not part of its state.
        return {**self.__dict__, "_proc": None, "_node": None, "_rdzv_error": False}

    def _argv(self, node: NodeEnv | None) -> list[str]:
        return torchrun_argv(
            sys.executable,
            node=node,
            nproc_per_node=self.nproc_per_node,
            module="pipeline.train",
            args=["worker", "--run-dir", self.run_dir, "--data-dir", self.data_dir],
        )

    def __call__(self) -> dict[str, Any]:
        if self.policy is not None and "SLURM_JOB_ID" in os.environ:
            return self._run_slurm()
        node = node_env_from_slurm() if "SLURM_JOB_ID" in os.environ else None
        if node is not None and node.nnodes != self.nnodes:
            raise PipelineError(f"job has {node.nnodes} nodes, the plan {self.nnodes}")
        run_dir = Path(self.run_dir)
        self._proc = subprocess.Popen(self._argv(node))
        rc = self._proc.wait()
        done = run_dir / "train.done"
        if rc == 0 and done.exists():
            return read_json(done)
        if (run_dir / "stopped.json").exists():
            return {"stopped": read_json(run_dir / "stopped.json")}
        raise RuntimeError(f"torchrun exited with status {rc}; see the rank logs above")

    # -- Slurm ---------------------------------------------------------------------------------

    def _node_record(self, **kw: Any) -> None:
        node = self._node
        assert node is not None
        path = Path(self.run_dir) / "nodes" / f"r{node.restart_count}-n{node.node_rank}.json"
        path.parent.mkdir(exist_ok=True)
        old = read_json(path) if path.exists() else {}
        write_json_atomic(path, {**old, **kw})

    def _tee_stderr(self, stream: Any) -> None:
        # Pass torchrun's stderr through to the job's log, noting rendezvous failures.
        for line in iter(stream.readline, b""):
            if RDZV_ERROR_RE.search(line):
                self._rdzv_error = True
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()

    def _poll(self, timeout: float | None = None) -> int | None:
        """Wait for torchrun with poll + sleep. Not Popen.wait(): the USR2 handler runs while
        the main thread is inside wait() holding the Popen's lock, and a wait() in the handler
        could then never take it."""
        assert self._proc is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self._proc.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.2)
        return rc

    def _run_slurm(self) -> dict[str, Any]:
        assert self.policy is not None
        node = node_env_from_slurm()
        self._node = node
        if node.nnodes != self.nnodes:
            raise PipelineError(f"job has {node.nnodes} nodes, the plan {self.nnodes}")
        run_dir = Path(self.run_dir)
        host = socket.gethostname()
        started = time.time()
        self._node_record(host=host, node_rank=node.node_rank, restart=node.restart_count,
                          job_id=node.job_id, start=started, rc=None)
        if node.node_rank == 0:
            append_event(run_dir, "launch.attempt", job_id=node.job_id,
                         restart=node.restart_count, host=host, nnodes=node.nnodes)
        env = {**os.environ, **self.policy.job_env}
        self._proc = subprocess.Popen(self._argv(node), env=env, stderr=subprocess.PIPE,
                                      preexec_fn=_ignore_usr2)
        tee = threading.Thread(target=self._tee_stderr, args=(self._proc.stderr,), daemon=True)
        tee.start()
        rc = self._poll()
        assert rc is not None
        tee.join(timeout=5)
        self._node_record(rc=rc, end=time.time(), rdzv_error=self._rdzv_error)
        if rc == 0:
            if node.node_rank != 0:
                return {"node": node.node_rank, "host": host, "rc": 0}
            # Rank 0 writes train.done and may live on another node (the c10d rendezvous orders
            # nodes by address and pid, not by SLURM_NODEID): its torchrun can end later.
            if self._wait_done(wait_s=60):
                return read_json(run_dir / "train.done")
            raise RuntimeError("torchrun exited 0 but train.done is missing")
        # torchrun reports a rank's EXIT_REQUEUE as a failure (its own exit status is 1): a
        # stop request is recognized by the stopped.json rank 0 writes after the save.
        stopped = self._fresh_stopped(started, wait_s=10 if rc != EXIT_REQUEUE else 0)
        if stopped is not None:
            # With a signal, checkpoint() takes over on the head node (it runs in this
            # process); a STOP file put there by a user ends the job here.
            return {"stopped": stopped}
        if node.node_rank != 0:
            raise RuntimeError(f"torchrun exited with status {rc} on {host}")
        return self._on_failure(node, rc)

    def _wait_done(self, wait_s: float) -> bool:
        """Whether train.done exists, waiting up to ``wait_s`` for rank 0 to write it."""
        done = Path(self.run_dir) / "train.done"
        deadline = time.monotonic() + wait_s
        while not done.exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
        return True

    def _fresh_stopped(self, since: float, wait_s: float = 0) -> dict[str, Any] | None:
        """stopped.json if rank 0 wrote it after ``since`` (an older one is a past attempt's)."""
        path = Path(self.run_dir) / "stopped.json"
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if path.stat().st_mtime >= since - 1:
                    return read_json(path)
            except (OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def _on_failure(self, node: NodeEnv, rc: int) -> dict[str, Any]:
        """Head node, torchrun failed: requeue from the last complete checkpoint (bounded)."""
        assert self.policy is not None
        run_dir = Path(self.run_dir)
        # Give the other nodes' tasks a moment to record how their torchrun ended.
        records: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            records = {}
            for n in range(node.nnodes):
                p = run_dir / "nodes" / f"r{node.restart_count}-n{n}.json"
                if p.exists():
                    records[n] = read_json(p)
            if len(records) == node.nnodes and all(r.get("rc") is not None
                                                   for r in records.values()):
                break
            time.sleep(1)
        trained = any(e.get("event") == "start" and e.get("time", 0) >= records[0]["start"]
                      for e in read_events(run_dir))
        # A node "failed its rendezvous" when training never started in this attempt and its
        # torchrun reported a rendezvous error (or it never reported at all). The head hosts
        # the rendezvous store and only waits for the others: it is not blamed.
        bad = [] if trained else sorted(
            r.get("host", "?") for n, r in records.items() if n != 0 and r.get("rdzv_error")
        )
        failed = sorted(r.get("host", "?") for r in records.values() if r.get("rc") not in (0, None))
        used = requeues_of(run_dir, node.job_id, "failure")
        append_event(run_dir, "launch.failure", job_id=node.job_id, restart=node.restart_count,
                     rc=rc, failed_hosts=failed, rdzv_failed=bad, trained=trained,
                     checkpoint=latest_checkpoint(run_dir))
        if used >= self.policy.max_failures:
            append_event(run_dir, "launch.giveup", job_id=node.job_id, reason="failure",
                         budget=self.policy.max_failures)
            raise RuntimeError(
                f"torchrun exited with status {rc} (failed on {', '.join(failed) or '?'}); "
                f"the failure budget (max_failures={self.policy.max_failures}) is spent"
            )
        exclude = self._excluded(run_dir, node.job_id)
        new = [h for h in bad if h not in exclude]
        if new:
            # Never exclude so many nodes that the job can no longer be scheduled.
            left = [n for n in partition_nodes(self.policy.partition) if n not in exclude + new]
            if len(left) < node.nnodes:
                log.warning("not excluding %s: only %d nodes would be left", new, len(left))
                new = []
        append_event(run_dir, "launch.requeue", job_id=node.job_id, reason="failure",
                     restart=node.restart_count, exclude=new, n=used + 1,
                     checkpoint=latest_checkpoint(run_dir))
        subprocess.run(["scontrol", "requeue", node.job_id], check=True, timeout=60)
        if new:
            # Only a pending job's exclude list can change: right after the requeue it is one.
            # submitit ignores the SIGTERM of the requeue, so this process lives until SIGKILL.
            subprocess.run(["scontrol", "update", f"JobId={node.job_id}",
                            f"ExcNodeList={','.join(exclude + new)}"], check=False, timeout=60)
        # Leave at once, without a result: returning or raising would write one for an attempt
        # that is being replaced, and waiting for Slurm's kill costs KillWait (submitit ignores
        # the requeue's SIGTERM) before the job can start again.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_REQUEUE)

    def _excluded(self, run_dir: Path, job_id: str) -> list[str]:
        assert self.policy is not None
        out = list(self.policy.exclude)
        for e in read_events(run_dir):
            if e.get("event") == "launch.requeue" and e.get("job_id") == job_id:
                out += [h for h in e.get("exclude", []) if h not in out]
        return out

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission | None:
        """Called by submitit on the time-limit/preemption signal (head node only): ask the
        ranks to stop at an agreed step and save, wait until they have, then let submitit
        requeue the job, unless this kind of requeue is out of budget."""
        run_dir = Path(self.run_dir)
        if self.policy is None:  # local executor: as before
            (run_dir / STOP_FILE).touch()
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    self._proc.send_signal(signal.SIGTERM)
            (run_dir / STOP_FILE).unlink(missing_ok=True)
            fresh = NodeTask(self.run_dir, self.data_dir, self.nproc_per_node, self.nnodes)
            return submitit.helpers.DelayedSubmission(fresh)
        t0 = time.time()
        (run_dir / STOP_FILE).touch()  # every rank on every node reads it at its next step
        job_id = os.environ.get("SLURM_JOB_ID", "?")
        left = time_left_s(job_id)
        cause = "timeout" if left is not None and left <= (
            self.policy.signal_delay_s + TIMEOUT_SLACK_S) else "preemption"
        append_event(run_dir, "launch.signal", job_id=job_id, cause=cause, time_left_s=left,
                     restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
        rc = None
        stopped = None
        if self._proc is not None:
            # Wait until the ranks have saved (rank 0 writes stopped.json after the last
            # barrier of the save), not until torchrun has exited: its shutdown after a rank's
            # non-zero exit takes seconds that the requeue does not need. A save that overruns
            # the lead time (less a few seconds to requeue) is cut short.
            deadline = time.monotonic() + max(self.policy.signal_delay_s - 5, 10)
            while stopped is None and time.monotonic() < deadline:
                stopped = self._fresh_stopped(t0)
                rc = self._proc.poll()
                if rc is not None:
                    # This node's torchrun ended; rank 0 (maybe on another node) writes either
                    # stopped.json (stopped at the agreed step) or, when the agreed step was
                    # the last one, train.done.
                    # NFS may show another node's new file only after its attribute cache
                    # expires: wait up to the save deadline, at least a few seconds.
                    deadline = max(deadline, time.monotonic() + 5)
                    while stopped is None and time.monotonic() < deadline:
                        stopped = self._fresh_stopped(t0)
                        if rc == 0 and self._wait_done(wait_s=0):
                            break
                        time.sleep(0.2)
                    break
                time.sleep(0.1)
            if stopped is None and rc is None:
                self._proc.send_signal(signal.SIGTERM)
        append_event(run_dir, "launch.saved", job_id=job_id, save_s=round(time.time() - t0, 3),
                     rc=rc, stopped_at=(stopped or {}).get("step"),
                     checkpoint=latest_checkpoint(run_dir))
        (run_dir / STOP_FILE).unlink(missing_ok=True)
        if rc == 0 and stopped is None and (run_dir / "train.done").exists():
            # The warning came as training finished: end the attempt as a success instead of
            # requeueing a finished run (no result is written for the head task; the job's
            # state, COMPLETED, and train.done are what the launcher reads).
            append_event(run_dir, "launch.finished_at_signal", job_id=job_id)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        budget = self.policy.max_requeues if cause == "timeout" else self.policy.max_preemptions
        used = requeues_of(run_dir, job_id, cause)
        if used >= budget:
            append_event(run_dir, "launch.giveup", job_id=job_id, reason=cause, budget=budget)
            return None  # submitit ends the job ("checkpoint function returned None")
        append_event(run_dir, "launch.requeue", job_id=job_id, reason=cause, n=used + 1,
                     checkpoint=latest_checkpoint(run_dir))
        fresh = NodeTask(self.run_dir, self.data_dir, self.nproc_per_node, self.nnodes,
                         self.policy)
        return submitit.helpers.DelayedSubmission(fresh)


# --------------------------------------------------------------------------------------------
# submission (login node)


class ArgvSlurmExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor, with every user-supplied string on sbatch's argv.

    submitit writes options as ``#SBATCH --key='value'`` lines: a newline or backslash in a
    value breaks the script or is lost. Options on the command line override the script's
    lines and reach sbatch as data, whatever they contain."""

    def __init__(self, folder: Path, argv_options: list[str], max_num_timeout: int) -> None:
        super().__init__(folder=folder, max_num_timeout=max_num_timeout)
        self.argv_options = argv_options

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return ["sbatch", *self.argv_options, str(submission_file_path)]


def sbatch_argv_options(slurm: SlurmOptions) -> list[str]:
    """Options passed on sbatch's argv (every one a single argument: no shell, no quoting)."""
    out = [f"--job-name={slurm.job_name}", "--requeue"]
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        value = getattr(slurm, key)
        if value:
            out.append(f"--{key}={value}")
    for key, value in slurm.extra.items():
        if not SBATCH_KEY_RE.match(key):
            raise PipelineError(f"extra sbatch option {key!r}: not an option name")
        flag = "--" + key.replace("_", "-")
        out.append(flag if value is True else f"{flag}={value}")
    for arg in slurm.sbatch_args:
        if not arg.startswith("--"):
            raise PipelineError(f"extra sbatch argument {arg!r} must start with --")
        out.append(arg)
    return out


def _reattachable(run_dir: Path) -> tuple[dict[str, Any], JobState] | None:
    """The job recorded in job.json, if Slurm still has it queued or running."""
    path = run_dir / "job.json"
    if not path.exists():
        return None
    try:
        rec = read_json(path)
    except ValueError:
        return None
    if rec.get("launcher") != "slurm" or not rec.get("job_id"):
        return None
    states = squeue_states([rec["job_id"]])
    st = (states or {}).get(rec["job_id"])
    # The name check guards against a reused job id (ids restart when slurmctld's state is wiped).
    if st is None or not st.alive or st.name != rec.get("job_name"):
        return None
    return rec, st


def _submit_slurm(run_dir: Path, data_dir: Path, run: Any, slurm: SlurmOptions) -> dict[str, Any]:
    folder = run_dir / "submitit" / "%j"
    policy = JobPolicy(
        max_requeues=slurm.max_requeues,
        max_preemptions=slurm.max_preemptions,
        max_failures=slurm.max_failures,
        signal_delay_s=slurm.signal_delay_s,
        partition=slurm.partition,
        exclude=[h for h in (slurm.exclude or "").split(",") if h],
        job_env=dict(slurm.job_env),
    )
    argv_options = sbatch_argv_options(slurm)
    # submitit counts "timeouts" itself (every signal below ~50 min of limit); the policy's
    # budgets decide, submitit's count is only a backstop above them.
    executor = ArgvSlurmExecutor(folder, argv_options,
                                 max_num_timeout=slurm.max_requeues + slurm.max_preemptions + 1)
    params: dict[str, Any] = {
        "nodes": run.cluster.nodes,
        "ntasks_per_node": 1,
        "cpus_per_task": slurm.cpus_per_task,
        "time": slurm.time_min,
        "signal_delay_s": slurm.signal_delay_s,
    }
    if run.cluster.device != "cpu":
        params["gpus_per_node"] = run.cluster.gpus_per_node
    if slurm.mem_gb:
        params["mem"] = f"{int(slurm.mem_gb * 1024)}M"
    executor.update_parameters(**params)
    warning = save_time_warning(run_dir, slurm.signal_delay_s)
    if warning:
        log.warning("%s", warning)
    task = NodeTask(str(run_dir), str(data_dir), run.cluster.gpus_per_node, run.cluster.nodes,
                    policy)
    # sbatch exports the submitting environment: the job env goes to the ranks through the
    # policy, so that it is recorded and applied on every attempt.
    job = executor.submit(task)
    old = read_json(run_dir / "job.json") if (run_dir / "job.json").exists() else {}
    history = old.get("history", [])
    if old.get("job_id"):
        history.append({k: old.get(k) for k in ("job_id", "submitted", "job_name")})
    rec = {
        "job_id": str(job.job_id),
        "launcher": "slurm",
        "job_name": slurm.job_name,
        "submitted": time.time(),
        "folder": str(run_dir / "submitit" / str(job.job_id)),
        "sbatch_argv": ["sbatch", *argv_options, "<submission file>"],
        "submitit_parameters": params,
        "policy": asdict(policy),
        "warnings": [warning] if warning else [],
        "history": history,
    }
    write_json_atomic(run_dir / "job.json", rec)
    append_event(run_dir, "launch.submit", job_id=str(job.job_id), job_name=slurm.job_name,
                 nodes=run.cluster.nodes, time_min=slurm.time_min,
                 signal_delay_s=slurm.signal_delay_s)
    log.info("submitted training job %s (%d node(s)): %s", job.job_id, run.cluster.nodes,
             shlex.join(rec["sbatch_argv"]))
    return rec


def _stderr_tail(rec: dict[str, Any], lines: int = 40) -> str:
    folder = Path(rec.get("folder", ""))
    out = []
    for f in sorted(folder.glob("*_0_log.err")) + sorted(folder.glob("*_0_log.out")):
        text = f.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {f}\n" + "\n".join(text))
    return "\n".join(out)


def wait_slurm(run_dir: Path, rec: dict[str, Any], slurm: SlurmOptions) -> dict[str, Any]:
    """Wait until the job ends, across PENDING/REQUEUED cycles; train.done's content, or a
    PipelineError saying why not."""
    job_id = rec["job_id"]
    policy = rec.get("policy", {})
    # Slurm also requeues by itself (node failure): bound the restarts the launcher sees too.
    max_restarts = (policy.get("max_requeues", 0) + policy.get("max_preemptions", 0)
                    + policy.get("max_failures", 0) + 1)
    last: tuple[str, str] | None = None
    missing = 0
    while True:
        states = squeue_states([job_id])
        st = None if states is None else states.get(job_id)
        if states is None:  # squeue failed: slurmctld busy; try again
            time.sleep(slurm.poll_s)
            continue
        if st is None:
            missing += 1
            if missing < 3:  # right after sbatch a job can be briefly invisible
                time.sleep(slurm.poll_s)
                continue
            state = "UNKNOWN"
        else:
            state = st.state
            if (state, st.reason) != last:
                restarts = scontrol_job(job_id).get("Restarts", "0")
                log.info("job %s: %s (%s), restarts %s", job_id, state, st.reason, restarts)
                last = (state, st.reason)
                if restarts.isdigit() and int(restarts) > max_restarts:
                    subprocess.run(["scancel", job_id], check=False, timeout=60)
                    raise PipelineError(
                        f"training job {job_id} was restarted {restarts} times, more than the "
                        f"budgets allow ({max_restarts}); cancelled it. Last checkpoint: "
                        f"{latest_checkpoint(run_dir)}"
                    )
            if st.alive:
                time.sleep(slurm.poll_s)
                continue
        done = run_dir / "train.done"
        if state in ("COMPLETED", "UNKNOWN") and done.exists():
            return read_json(done)
        giveups = [e for e in read_events(run_dir)
                   if e.get("event") == "launch.giveup" and e.get("job_id") == job_id]
        ckpt = latest_checkpoint(run_dir)
        if giveups:
            g = giveups[-1]
            raise PipelineError(
                f"training job {job_id} gave up: {g.get('reason')} budget ({g.get('budget')}) "
                f"spent. The last complete checkpoint ({ckpt}) is kept: run the workflow again "
                "to continue from it, or raise the budget in the profile."
            )
        if state == "COMPLETED" and (run_dir / "stopped.json").exists():
            raise PipelineError(
                f"training job {job_id} stopped on request (STOP file) at checkpoint {ckpt}; "
                "run the workflow again to continue"
            )
        raise PipelineError(
            f"training job {job_id} ended {state} without train.done (last checkpoint: "
            f"{ckpt}; rerun to resume from it)\n{_stderr_tail(rec)}"
        )


def _wait_for_running_trainer(run_dir: Path) -> bool:
    """Local reattach: if a trainer from an earlier (killed) launch still holds the run's lock,
    wait for it instead of starting a second one. True if there was one."""
    import fcntl

    from pipeline.train.loop import LOCK_FILE

    with (run_dir / LOCK_FILE).open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("a training process from an earlier launch is still running: waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
            return True
    return False


def launch(run_dir: Path, data_dir: Path, *, launcher: str, slurm: SlurmOptions) -> dict[str, Any]:
    """Submit the run's training job and wait for it; returns ``train.done``'s content."""
    run_dir = run_dir.resolve()
    data_dir = data_dir.resolve()
    run = load_run_config(run_dir / "config.json")
    if launcher == "slurm":
        return _launch_slurm(run_dir, data_dir, run, slurm)
    if launcher != "local":
        raise PipelineError(f"unknown launcher {launcher!r}: use local or slurm")
    if _wait_for_running_trainer(run_dir) and (run_dir / "train.done").exists():
        return read_json(run_dir / "train.done")
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    folder = run_dir / "submitit"
    task = NodeTask(str(run_dir), str(data_dir), run.cluster.gpus_per_node, run.cluster.nodes)
    if run.cluster.nodes != 1:
        raise PipelineError(
            f"cluster.nodes is {run.cluster.nodes}, but the local launcher runs one node; "
            "use --profile profiles/slurm or set cluster.nodes: 1"
        )
    executor = submitit.LocalExecutor(folder=folder)
    executor.update_parameters(timeout_min=slurm.time_min, tasks_per_node=1, nodes=1)
    job = executor.submit(task)
    write_json_atomic(
        run_dir / "job.json",
        {"job_id": str(job.job_id), "launcher": launcher, "submitted": time.time(),
         "folder": str(folder)},
    )
    log.info("submitted training job %s (%s)", job.job_id, launcher)

    def _cancel(signum: int, frame: Any) -> None:
        # The rule was killed: take the job down with it rather than leave a second trainer
        # running when Snakemake is started again.
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


def _launch_slurm(run_dir: Path, data_dir: Path, run: Any, slurm: SlurmOptions) -> dict[str, Any]:
    found = _reattachable(run_dir)
    if found is not None:
        rec, st = found
        # The login-node process died (or Snakemake was restarted) while the job went on:
        # wait for that job; a second one would train the same run twice.
        log.info("reattaching to training job %s (%s) recorded in job.json", rec["job_id"],
                 st.state)
        rec.setdefault("reattached", []).append(time.time())
        write_json_atomic(run_dir / "job.json", rec)
        append_event(run_dir, "launch.reattach", job_id=rec["job_id"], state=st.state)
    else:
        (run_dir / STOP_FILE).unlink(missing_ok=True)
        (run_dir / "stopped.json").unlink(missing_ok=True)
        rec = _submit_slurm(run_dir, data_dir, run, slurm)

    def _leave(signum: int, frame: Any) -> None:
        # The login-node side was killed: the job keeps running on its own (it checkpoints and
        # requeues itself); the next launch reattaches to it through job.json.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _leave)
    signal.signal(signal.SIGINT, _leave)
    signal.signal(signal.SIGHUP, _leave)
    return wait_slurm(run_dir, rec, slurm)


def _parse_env(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise PipelineError(f"--job-env {part!r}: expected NAME=VALUE")
            out[key] = value
    return out


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
    g.add_argument("--max-requeues", type=int, default=3, help="time-limit requeues")
    g.add_argument("--max-preemptions", type=int, default=10, help="preemption requeues")
    g.add_argument("--max-failures", type=int, default=2, help="requeues after a failure")
    g.add_argument("--job-name", default="zerosnake")
    g.add_argument("--poll-s", type=float, default=5.0, help="seconds between squeue polls")
    g.add_argument(
        "--sbatch", action="append", default=[], metavar="KEY=VALUE",
        help="extra sbatch option (repeatable), e.g. --sbatch reservation=myres",
    )
    g.add_argument(
        "--sbatch-extra", default="", metavar="ARGS",
        help="extra sbatch arguments as one string, split like a shell would (never run by one)",
    )
    g.add_argument(
        "--job-env", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
        help="environment of the ranks, e.g. GLOO_SOCKET_IFNAME=eth0 (repeatable)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        extra: dict[str, Any] = {}
        for item in args.sbatch:
            key, sep, value = item.partition("=")
            if not key:
                raise PipelineError(f"--sbatch {item!r}: expected KEY=VALUE or KEY")
            extra[key] = value if sep else True
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
            max_preemptions=args.max_preemptions,
            max_failures=args.max_failures,
            job_name=args.job_name,
            extra=extra,
            sbatch_args=shlex.split(args.sbatch_extra),
            job_env=_parse_env(args.job_env),
            poll_s=args.poll_s,
        )
        summary = launch(args.run_dir, args.data_dir, launcher=args.launcher, slurm=opts)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0
