"""The in-job node supervisor: one :class:`NodeTask` per node of a training job.

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
* a hung rank (no heartbeat for ``hang_timeout_s``: :mod:`pipeline.train.watchdog`): the node
  task that runs it names it (``launch.hang``), kills its torchrun with every rank (SIGKILL),
  and the failure is handled as above. Locally the task retries within the same budget.

What happened is in ``events.jsonl`` (events named ``launch.*``) and
``nodes/r<restart>-n<node>.json`` (one file per node and attempt).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import submitit

from pipeline.artifacts import (
    EXIT_REQUEUE,
    NODES,
    STOP,
    STOPPED,
    TRAIN_DONE,
    append_event,
    latest_checkpoint_name,
    read_events,
    read_json_or_none,
    read_train_done,
)
from pipeline.cluster.env import (
    ATTEMPT_ENV,
    NodeEnv,
    node_env_from_slurm,
    partition_nodes,
    time_left_s,
    torchrun_argv,
)
from pipeline.cluster.options import LaunchOptions
from pipeline.errors import PipelineError
from pipeline.io import write_json_atomic
from pipeline.train.rank_error import rank_error
from pipeline.train.watchdog import Limits, Stale, Watch, kill_tree

log = logging.getLogger("pipeline.train.node")

#: torchrun's own messages when a node could not join the rendezvous (elastic's error classes).
RDZV_ERROR_RE = re.compile(
    rb"Rendezvous(Timeout|Closed|Connection|State)Error|DistNetworkError|"
    rb"rendezvous .*(timed out|failed)",
    re.IGNORECASE,
)
#: Seconds a signal may come before the limit and still count as the time-limit warning:
#: slurmctld checks limits about every 30 s, so the warning lands up to ~60 s early.
TIMEOUT_SLACK_S = 75
#: In a job of several nodes, the seconds a node whose stale ranks are only waiting (none
#: stopped) leaves the other nodes to name the frozen rank (:class:`Watch`'s ``defer_s``): the
#: heartbeat throttle (1 s) plus both nodes' poll intervals (1 s each), with room to spare.
HANG_DEFER_S = 5.0


def requeues_of(run_dir: Path, job_id: str, reason: str) -> int:
    """Requeues of this job for one reason (timeout, preemption, failure) so far."""
    return sum(
        1 for e in read_events(run_dir, "launch.requeue")
        if e.get("job_id") == job_id and e.get("reason") == reason
    )


def _job_id() -> str:
    """This job's id: Slurm's, or submitit's local one (the controller's pid)."""
    if "SLURM_JOB_ID" in os.environ:
        return os.environ["SLURM_JOB_ID"]
    try:
        return str(submitit.JobEnvironment().job_id)
    except RuntimeError:  # not inside a submitit job (a test calling the task directly)
        return "local"


def _retryable(run_dir: Path, since: float) -> bool:
    """Whether a local attempt that began at ``since`` is worth retrying: training had started
    (a crash before is a config or data error that a retry would repeat) and no step's loss
    was non-finite (deterministic too)."""
    new = [e for e in read_events(run_dir) if e.get("time", 0) >= since]
    return (any(e.get("event") == "start" for e in new)
            and not any(e.get("event") == "nan" for e in new))


def _ignore_usr2() -> None:
    # torchrun has no handler for USR2 and would die of it: Slurm signals every process of the
    # step, not only the task. Ignored stays ignored across exec, so torchrun survives; the
    # workers install their own handler (StopRequest) and the STOP file reaches them anyway.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class NodeTask(submitit.helpers.Checkpointable):
    """One node's share of a training job: run torchrun, bridge the stop signal to the ranks.

    ``policy``: the job's launch options (budgets, exclude list, job env; pickled with the
    task, so every attempt applies the same); None for the local executor."""

    def __init__(
        self,
        run_dir: str,
        data_dir: str,
        nproc_per_node: int,
        nnodes: int,
        policy: LaunchOptions | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.data_dir = data_dir
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self.policy = policy
        self._proc: subprocess.Popen | None = None
        self._node: NodeEnv | None = None
        self._rdzv_error = False
        self._hung: list[Stale] = []
        #: The attempt in flight (``ATTEMPT_ENV``): its stopped.json, and no other, is its stop.
        self._attempt: str | None = None
        #: Environment the local launcher restores for torchrun (see :func:`local_gpu_env`).
        self.local_env: dict[str, str | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A requeue pickles the task again: the running process is not part of its state.
        return {**self.__dict__, "_proc": None, "_node": None, "_rdzv_error": False,
                "_hung": [], "_attempt": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"_hung": [], "_attempt": None, **state})

    @property
    def opts(self) -> LaunchOptions:
        return self.policy if self.policy is not None else LaunchOptions()

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
        return self._run_local(node)

    def _local_child_env(self) -> dict[str, str] | None:
        fix = getattr(self, "local_env", None)  # None in a task pickled before it existed
        if not fix or "SLURM_JOB_ID" in os.environ:  # Slurm sets the job's GPUs itself
            return None
        env = dict(os.environ)
        for key, value in fix.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def _run_local(self, node: NodeEnv | None) -> dict[str, Any]:
        """One node on this host: torchrun under the watchdog, retried after a failure or a
        hang from the last complete checkpoint, up to ``max_failures`` times."""
        run_dir = Path(self.run_dir)
        host = socket.gethostname()
        job_id = _job_id()
        while True:
            started = time.time()
            # One name per try of this loop: a Slurm allocation's ids repeat across them.
            self._attempt = f"{job_id}.{uuid.uuid4().hex}"
            append_event(run_dir, "launch.attempt", job_id=job_id, launcher="local", host=host,
                         nnodes=1)
            env = {**(self._local_child_env() or os.environ), ATTEMPT_ENV: self._attempt}
            self._proc = subprocess.Popen(self._argv(node), env=env)
            rc = self._supervise()
            if rc == 0 and (run_dir / TRAIN_DONE).exists():
                append_event(run_dir, "launch.end", job_id=job_id, rc=rc, outcome="done")
                return read_train_done(run_dir)
            stopped = None if self._hung else self._fresh_stopped()
            if stopped is not None:
                append_event(run_dir, "launch.end", job_id=job_id, rc=rc, outcome="stopped")
                return {"stopped": stopped}
            why = self._failure_text(rc, host)
            used = requeues_of(run_dir, job_id, "failure")
            if not self._hung and not _retryable(run_dir, started):
                append_event(run_dir, "launch.failure", job_id=job_id, rc=rc,
                             failed_hosts=[host], hang=False, retry=False,
                             checkpoint=latest_checkpoint_name(run_dir))
                append_event(run_dir, "launch.end", job_id=job_id, rc=rc, outcome="failed")
                raise RuntimeError(f"{why} (not retried: it failed before training started, "
                                   "or on a non-finite loss, which a retry would repeat)")
            append_event(run_dir, "launch.failure", job_id=job_id, rc=rc, failed_hosts=[host],
                         hang=bool(self._hung), checkpoint=latest_checkpoint_name(run_dir))
            if used >= self.opts.max_failures:
                append_event(run_dir, "launch.giveup", job_id=job_id, reason="failure",
                             budget=self.opts.max_failures)
                append_event(run_dir, "launch.end", job_id=job_id, rc=rc, outcome="failed")
                raise RuntimeError(f"{why}; the failure budget (max_failures="
                                   f"{self.opts.max_failures}) is spent")
            log.error("%s; retrying from %s (failure %d of %d)", why,
                      latest_checkpoint_name(run_dir) or "the start", used + 1,
                      self.opts.max_failures)
            append_event(run_dir, "launch.requeue", job_id=job_id, reason="failure", n=used + 1,
                         checkpoint=latest_checkpoint_name(run_dir))
            append_event(run_dir, "launch.end", job_id=job_id, rc=rc, outcome="failed")
            self._hung = []

    def _failure_text(self, rc: int, host: str) -> str:
        if self._hung:
            return "hang: " + "; ".join(s.describe() for s in self._hung)
        said = rank_error(Path(self.run_dir), self._attempt or "")
        if said is not None:
            return f"{said} (torchrun exited with status {rc} on {host})"
        return f"torchrun exited with status {rc} on {host}; see the rank logs above"

    # -- the watchdog --------------------------------------------------------------------------

    def _supervise(self) -> int:
        """Wait for torchrun (poll + sleep, see :meth:`_poll`) while watching its ranks'
        heartbeats; a hung rank is named (``launch.hang``, the log) and the whole torchrun
        tree killed: the return is then torchrun's status after SIGKILL."""
        assert self._proc is not None
        o = self.opts
        watch = Watch(Path(self.run_dir), self._proc.pid,
                      Limits(train_s=o.hang_timeout_s, startup_s=o.hang_startup_s,
                             save_s=o.hang_save_s),
                      defer_s=HANG_DEFER_S if self._node and self._node.nnodes > 1 else 0.0)
        next_check = 0.0
        while (rc := self._proc.poll()) is None:
            if time.monotonic() >= next_check and not self._hung:
                next_check = time.monotonic() + 1.0
                stale = watch.poll()
                if stale:
                    self._on_hang(stale)  # kills the tree: torchrun's status follows at once
            time.sleep(0.2)
        return rc

    def _on_hang(self, stale: list[Stale]) -> None:
        assert self._proc is not None
        self._hung = stale
        run_dir = Path(self.run_dir)
        ckpt = latest_checkpoint_name(run_dir)
        for s in stale:
            log.error("hang: %s; killing torchrun and its ranks (SIGKILL); the launcher "
                      "retries from %s", s.describe(), ckpt or "the start")
        append_event(run_dir, "launch.hang", job_id=_job_id(), host=stale[0].host,
                     ranks=[s.__dict__ for s in stale], checkpoint=ckpt,
                     restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
        if self._node is not None:
            self._node_record(hang=[s.__dict__ for s in stale])
        kill_tree(self._proc.pid)

    # -- Slurm ---------------------------------------------------------------------------------

    def _node_record(self, **kw: Any) -> None:
        node = self._node
        assert node is not None
        path = Path(self.run_dir) / NODES / f"r{node.restart_count}-n{node.node_rank}.json"
        path.parent.mkdir(exist_ok=True)
        old = read_json_or_none(path) or {}
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
        self._attempt = f"{node.job_id}.{node.restart_count}"  # the same on every node
        self._node_record(host=host, node_rank=node.node_rank, restart=node.restart_count,
                          job_id=node.job_id, start=started, rc=None)
        if node.node_rank == 0:
            append_event(run_dir, "launch.attempt", job_id=node.job_id,
                         restart=node.restart_count, host=host, nnodes=node.nnodes)
        env = {**os.environ, **self.policy.job_env, ATTEMPT_ENV: self._attempt}
        self._proc = subprocess.Popen(self._argv(node), env=env, stderr=subprocess.PIPE,
                                      preexec_fn=_ignore_usr2)
        tee = threading.Thread(target=self._tee_stderr, args=(self._proc.stderr,), daemon=True)
        tee.start()
        rc = self._supervise()
        tee.join(timeout=5)
        self._node_record(rc=rc, end=time.time(), rdzv_error=self._rdzv_error)
        head = node.node_rank == 0
        if rc == 0:
            if not head:
                return {"node": node.node_rank, "host": host, "rc": 0}
            # Rank 0 writes train.done and may live on another node (the c10d rendezvous orders
            # nodes by address and pid, not by SLURM_NODEID): its torchrun can end later.
            if self._wait_done(wait_s=60):
                append_event(run_dir, "launch.end", job_id=node.job_id, rc=0, outcome="done")
                return read_train_done(run_dir)
            raise RuntimeError("torchrun exited 0 but train.done is missing")
        # torchrun reports a rank's EXIT_REQUEUE as a failure (its own exit status is 1): a
        # stop request is recognized by the stopped.json rank 0 writes after the save.
        stopped = None if self._hung else self._fresh_stopped(
            wait_s=10 if rc != EXIT_REQUEUE else 0)
        if stopped is not None:
            # With a signal, checkpoint() takes over on the head node (it runs in this
            # process); a STOP file put there by a user ends the job here.
            if head:
                append_event(run_dir, "launch.end", job_id=node.job_id, rc=rc,
                             outcome="stopped")
            return {"stopped": stopped}
        if not head:
            raise RuntimeError(self._failure_text(rc, host))
        return self._on_failure(node, rc)

    def _wait_done(self, wait_s: float) -> bool:
        """Whether train.done exists, waiting up to ``wait_s`` for rank 0 to write it."""
        done = Path(self.run_dir) / TRAIN_DONE
        deadline = time.monotonic() + wait_s
        while not done.exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
        return True

    def _fresh_stopped(self, wait_s: float = 0) -> dict[str, Any] | None:
        """stopped.json if this attempt's rank 0 wrote it (waiting up to ``wait_s``): one that
        names another attempt is a past attempt's, however recent (a time stamp cannot tell an
        attempt that failed within a second of the previous one's stop)."""
        path = Path(self.run_dir) / STOPPED
        deadline = time.monotonic() + wait_s
        while True:
            rec = read_json_or_none(path)
            if isinstance(rec, dict) and self._attempt is not None \
                    and rec.get("attempt") == self._attempt:
                return rec
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
                rec = read_json_or_none(run_dir / NODES / f"r{node.restart_count}-n{n}.json")
                if rec is not None:
                    records[n] = rec
            if len(records) == node.nnodes and all(r.get("rc") is not None
                                                   for r in records.values()):
                break
            time.sleep(1)
        trained = any(e.get("time", 0) >= records[0]["start"]
                      for e in read_events(run_dir, "start"))
        # A node "failed its rendezvous" when training never started in this attempt and its
        # torchrun reported a rendezvous error (or it never reported at all). The head hosts
        # the rendezvous store and only waits for the others: it is not blamed.
        bad = [] if trained else sorted(
            r.get("host", "?") for n, r in records.items() if n != 0 and r.get("rdzv_error")
        )
        failed = sorted(r.get("host", "?") for r in records.values() if r.get("rc") not in (0, None))
        used = requeues_of(run_dir, node.job_id, "failure")
        hung = [s for r in records.values() for s in r.get("hang") or []]
        append_event(run_dir, "launch.failure", job_id=node.job_id, restart=node.restart_count,
                     rc=rc, failed_hosts=failed, rdzv_failed=bad, trained=trained,
                     hang=bool(hung), checkpoint=latest_checkpoint_name(run_dir))
        if used >= self.policy.max_failures:
            append_event(run_dir, "launch.giveup", job_id=node.job_id, reason="failure",
                         budget=self.policy.max_failures)
            append_event(run_dir, "launch.end", job_id=node.job_id, rc=rc, outcome="failed")
            named = "; ".join(Stale(**s).describe() for s in hung)
            raise RuntimeError(
                f"torchrun exited with status {rc} (failed on {', '.join(failed) or '?'}"
                f"{'; hang: ' + named if named else ''}); "
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
                     checkpoint=latest_checkpoint_name(run_dir))
        append_event(run_dir, "launch.end", job_id=node.job_id, rc=rc, outcome="failed")
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
        out = self.policy.exclude_hosts
        for e in read_events(run_dir, "launch.requeue"):
            if e.get("job_id") == job_id:
                out += [h for h in e.get("exclude", []) if h not in out]
        return out

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission | None:
        """Called by submitit on the time-limit/preemption signal (head node only): ask the
        ranks to stop at an agreed step and save, wait until they have, then let submitit
        requeue the job, unless this kind of requeue is out of budget."""
        run_dir = Path(self.run_dir)
        policy = self.opts
        t0 = time.time()
        (run_dir / STOP).touch()  # every rank on every node reads it at its next step
        job_id = _job_id()
        # Locally the signal is submitit's time-limit warning (or a user's USR2 to the task).
        left = time_left_s(job_id) if "SLURM_JOB_ID" in os.environ else None
        cause = "timeout" if left is None or left <= (
            policy.signal_delay_s + TIMEOUT_SLACK_S) else "preemption"
        append_event(run_dir, "launch.signal", job_id=job_id, cause=cause, time_left_s=left,
                     restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
        rc = None
        stopped = None
        if self._proc is not None:
            # Wait until the ranks have saved (rank 0 writes stopped.json after the last
            # barrier of the save), not until torchrun has exited: its shutdown after a rank's
            # non-zero exit takes seconds that the requeue does not need. A save that overruns
            # the lead time (less a few seconds to requeue) is cut short.
            deadline = time.monotonic() + max(policy.signal_delay_s - 5, 10)
            while stopped is None and time.monotonic() < deadline:
                stopped = self._fresh_stopped()
                rc = self._proc.poll()
                if rc is not None:
                    # This node's torchrun ended; rank 0 (maybe on another node) writes either
                    # stopped.json (stopped at the agreed step) or, when the agreed step was
                    # the last one, train.done.
                    # NFS may show another node's new file only after its attribute cache
                    # expires: wait up to the save deadline, at least a few seconds.
                    deadline = max(deadline, time.monotonic() + 5)
                    while stopped is None and time.monotonic() < deadline:
                        stopped = self._fresh_stopped()
                        if rc == 0 and self._wait_done(wait_s=0):
                            break
                        time.sleep(0.2)
                    break
                time.sleep(0.1)
            if stopped is None and rc is None:
                self._proc.send_signal(signal.SIGTERM)
            if "SLURM_JOB_ID" not in os.environ:
                # Locally nobody else ends the ranks: the next attempt must not find rank 0
                # still holding the run's lock.
                end = time.monotonic() + 60
                while (rc := self._proc.poll()) is None and time.monotonic() < end:
                    time.sleep(0.2)
                if rc is None:
                    kill_tree(self._proc.pid)
        append_event(run_dir, "launch.saved", job_id=job_id, save_s=round(time.time() - t0, 3),
                     rc=rc, stopped_at=(stopped or {}).get("step"),
                     checkpoint=latest_checkpoint_name(run_dir))
        (run_dir / STOP).unlink(missing_ok=True)
        if rc == 0 and stopped is None and (run_dir / TRAIN_DONE).exists():
            # The warning came as training finished: end the attempt as a success instead of
            # requeueing a finished run (no result is written for the head task; the job's
            # state, COMPLETED, and train.done are what the launcher reads).
            append_event(run_dir, "launch.finished_at_signal", job_id=job_id)
            append_event(run_dir, "launch.end", job_id=job_id, rc=0, outcome="done")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        budget = policy.max_requeues if cause == "timeout" else policy.max_preemptions
        used = requeues_of(run_dir, job_id, cause)
        if used >= budget:
            append_event(run_dir, "launch.giveup", job_id=job_id, reason=cause, budget=budget)
            append_event(run_dir, "launch.end", job_id=job_id, rc=rc, outcome="stopped")
            return None  # submitit ends the job ("checkpoint function returned None")
        append_event(run_dir, "launch.requeue", job_id=job_id, reason=cause, n=used + 1,
                     checkpoint=latest_checkpoint_name(run_dir))
        append_event(run_dir, "launch.end", job_id=job_id, rc=rc, outcome="requeue")
        fresh = NodeTask(self.run_dir, self.data_dir, self.nproc_per_node, self.nnodes,
                         self.policy)
        fresh.local_env = getattr(self, "local_env", None)  # a requeued local job keeps its GPUs
        return submitit.helpers.DelayedSubmission(fresh)


def local_gpu_env(device: str, environ: Mapping[str, str]) -> dict[str, str | None]:
    """What the node task restores for a local run's torchrun. submitit's ``LocalExecutor``
    sets its job's ``CUDA_VISIBLE_DEVICES`` to its first ``gpus_per_node`` GPUs, and to none
    when that is not given: on a GPU machine the local profile trained on no GPU (found by
    bench/gpu.py on an H200). The job gets the GPUs of the shell that launched it (its
    ``CUDA_VISIBLE_DEVICES`` as set, UUIDs and MIG names included; unset: all of them), and none
    for ``cluster.device: cpu``."""
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_VISIBLE_DEVICES": environ.get("CUDA_VISIBLE_DEVICES")}
