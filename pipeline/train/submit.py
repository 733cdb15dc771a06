"""Submit a run's training job and wait for it (login node): local or Slurm.

On Slurm the submission is exactly :func:`pipeline.cluster.sbatch.render_submission`'s (argv and
script); the launcher records the job in ``job.json``, waits across PENDING/REQUEUED cycles
(one Snakemake step), and when started again while the job still runs, reattaches to it
instead of submitting a second one. Locally, submitit's ``LocalExecutor`` runs one node task;
a trainer left over from a killed launch is waited for through the run's lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import submitit

from pipeline.artifacts import (
    LOCK,
    RUN_CONFIG,
    STOP,
    STOPPED,
    SUBMITIT,
    TRAIN_DONE,
    append_event,
    latest_checkpoint_name,
    read_events,
    read_job,
    read_train_done,
    write_job,
)
from pipeline.cluster.env import JobState, scontrol_job, squeue_states
from pipeline.cluster.options import LaunchOptions, check_options, check_text
from pipeline.cluster.sbatch import SUBMISSION_FILE, Submission, check_folder, render_submission
from pipeline.config.files import load_run_config
from pipeline.errors import PipelineError
from pipeline.observe.goodput import measured_save_seconds as measured_save_seconds  # re-exported
from pipeline.observe.goodput import save_time_warning
from pipeline.train.node import NodeTask, local_gpu_env
from pipeline.train.rank_error import rank_error

log = logging.getLogger("pipeline.train.launch")

#: How long a COMPLETED job's train.done may take to become visible here (NFS caches
#: attributes for up to 60 s by default: acregmax/acdirmax).
DONE_VISIBLE_S = 60.0


class ArgvSlurmExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor submitting exactly a rendered :class:`Submission`: its script
    as the submission file, its argv (every user-supplied string, as data) before the file."""

    def __init__(self, folder: Path, submission: Submission, max_num_timeout: int) -> None:
        super().__init__(folder=folder, max_num_timeout=max_num_timeout)
        self.submission = submission
        # The executor reads its parameters too (tasks per job, time limit of the task).
        self.update_parameters(**submission.params)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        script = self.submission.script
        if command not in script:
            raise PipelineError(
                f"the rendered submission runs another command than submitit's ({command!r})"
            )
        return script

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return self.submission.command(submission_file_path)


def launch_warnings(run_dir: Path, opts: LaunchOptions) -> list[str]:
    """What the launcher warns about before it submits: a signal lead time shorter than this
    run's measured saves need, a hang timeout that is not well under the time limit."""
    out = [w for w in (save_time_warning(run_dir, opts.signal_delay_s),) if w]
    limit_s = opts.time_min * 60
    longest = max(opts.hang_timeout_s, opts.hang_startup_s, opts.hang_save_s)
    if opts.hang_timeout_s > 0 and longest >= limit_s / 2:
        out.append(f"the hang watchdog's allowance ({longest} s: hang_timeout_s, "
                   f"hang_startup_s, hang_save_s) is not well under the time limit "
                   f"({limit_s} s): a hung rank may hold the job until the limit; lower them")
    return out


class Incidents:
    """The launcher's log of what went wrong inside the job (hangs, failures, requeues), from
    events.jsonl as they appear: the job's own logs are on the compute nodes."""

    KINDS = ("launch.hang", "launch.failure", "launch.requeue", "launch.giveup")

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen = len(read_events(run_dir))

    def log(self) -> None:
        events = read_events(self.run_dir)
        for e in events[self.seen:]:
            if e.get("event") == "launch.hang":
                for r in e.get("ranks", []):
                    log.error("hang: rank %s on %s (pid %s)%s made no progress for %.0f s "
                              "(phase %s, step %s, process %s); the ranks were killed and the "
                              "job retries from %s", r.get("rank"), r.get("host"), r.get("pid"),
                              "" if r.get("suspect", True) else " (waiting for the others)",
                              r.get("stale_s", 0), r.get("phase"), r.get("step"),
                              r.get("state"), e.get("checkpoint") or "the start")
            elif e.get("event") in self.KINDS:
                log.warning("job %s: %s", e.get("job_id"), json.dumps(
                    {k: v for k, v in e.items() if k not in ("time", "job_id")}))
        self.seen = len(events)


# --------------------------------------------------------------------------------------------
# Slurm


def _reattachable(run_dir: Path) -> tuple[dict[str, Any], JobState] | None:
    """The job recorded in job.json, if Slurm still has it queued or running."""
    rec = read_job(run_dir)
    if rec is None or rec.get("launcher") != "slurm" or not rec.get("job_id"):
        return None
    states = squeue_states([rec["job_id"]])
    st = (states or {}).get(rec["job_id"])
    # The name check guards against a reused job id (ids restart when slurmctld's state is wiped).
    if st is None or not st.alive or st.name != rec.get("job_name"):
        return None
    return rec, st


def _submit(executor: ArgvSlurmExecutor, task: NodeTask, folder: Path) -> submitit.Job:
    """``executor.submit(task)``, or a PipelineError with sbatch's own message when it fails
    (no controller, a refused option, no sbatch at all); the files submitit wrote in
    ``folder`` for the job that never was (its pickled task, its submission file) are removed
    again, and nothing else is touched."""
    existed = folder.is_dir()
    before = set(folder.iterdir()) if existed else set()
    then = "no job was submitted; check that Slurm answers here (sinfo), then run the workflow again"
    try:
        # submitit prints sbatch's complaint itself before raising: the error below carries it.
        with contextlib.redirect_stderr(io.StringIO()):
            return executor.submit(task)
    except submitit.core.utils.FailedSubmissionError as err:
        # sbatch exited 0 but named no job id: a job may exist after all (without its task).
        why = f"sbatch answered without a job id ({str(err).splitlines()[0]})"
        then = "look for the job with squeue --me and cancel it, then run the workflow again"
    except submitit.core.utils.FailedJobError as err:
        said = " | ".join(line.strip() for line in str(err).splitlines() if line.strip())
        why = f"sbatch failed ({said or 'no message'})"
    except FileNotFoundError as err:
        why = f"{err.filename or 'sbatch'} not found on PATH"
    except OSError as err:
        why = f"could not submit the job: {err}"
    for path in (set(folder.iterdir()) - before) if folder.is_dir() else set():
        if path.is_file() or path.is_symlink():
            path.unlink()
    if not existed and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
    raise PipelineError(f"{why}: {then}")


def submit_slurm(run_dir: Path, data_dir: Path, run: Any, opts: LaunchOptions) -> dict[str, Any]:
    """Submit the run's job (exactly :func:`render_submission`'s form); job.json's record."""
    folder = run_dir / SUBMITIT / "%j"
    submission = render_submission(opts, nodes=run.cluster.nodes,
                                   gpus_per_node=run.cluster.gpus_per_node,
                                   device=run.cluster.device, folder=folder)
    # submitit counts "timeouts" itself (every signal below ~50 min of limit); the options'
    # budgets decide, submitit's count is only a backstop above them.
    executor = ArgvSlurmExecutor(folder, submission,
                                 max_num_timeout=opts.max_requeues + opts.max_preemptions + 1)
    warnings = launch_warnings(run_dir, opts)
    for warning in warnings:
        log.warning("%s", warning)
    # The options travel with the task (budgets, exclude list, job env): sbatch exports the
    # submitting environment, the job env goes to the ranks through them, so that it is
    # recorded and applied on every attempt.
    task = NodeTask(str(run_dir), str(data_dir), run.cluster.gpus_per_node, run.cluster.nodes,
                    opts)
    job = _submit(executor, task, run_dir / SUBMITIT)
    old = read_job(run_dir) or {}
    history = old.get("history", [])
    if old.get("job_id"):
        history.append({k: old.get(k) for k in ("job_id", "submitted", "job_name")})
    rec = {
        "job_id": str(job.job_id),
        "launcher": "slurm",
        "job_name": opts.job_name,
        "submitted": time.time(),
        "folder": str(run_dir / SUBMITIT / str(job.job_id)),
        "sbatch_argv": submission.command(SUBMISSION_FILE),
        "submitit_parameters": submission.params,
        "policy": asdict(opts),
        "warnings": warnings,
        "history": history,
    }
    write_job(run_dir, rec)
    append_event(run_dir, "launch.submit", job_id=str(job.job_id), job_name=opts.job_name,
                 nodes=run.cluster.nodes, time_min=opts.time_min,
                 signal_delay_s=opts.signal_delay_s)
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


def _check_restarts(run_dir: Path, job_id: str, max_restarts: int) -> None:
    """Slurm also requeues by itself (node failure): cancel a job restarted past the budgets."""
    restarts = scontrol_job(job_id).get("Restarts", "0")
    log.info("job %s: restarts %s", job_id, restarts)
    if restarts.isdigit() and int(restarts) > max_restarts:
        subprocess.run(["scancel", job_id], check=False, timeout=60)
        raise PipelineError(
            f"training job {job_id} was restarted {restarts} times, more than the "
            f"budgets allow ({max_restarts}); cancelled it. Last checkpoint: "
            f"{latest_checkpoint_name(run_dir)}"
        )


def _ended(run_dir: Path, rec: dict[str, Any], state: str) -> dict[str, Any]:
    """The job left the queue in ``state``: train.done's content, or why not."""
    job_id = rec["job_id"]
    giveups = [e for e in read_events(run_dir, "launch.giveup") if e.get("job_id") == job_id]
    if state in ("COMPLETED", "UNKNOWN") and not giveups and not (run_dir / STOPPED).exists():
        # On NFS the login node may see the job end before it sees the file the job wrote
        # last (attribute caching): wait a little rather than fail a run that finished, which
        # a rerun would then train a second time.
        deadline = time.monotonic() + DONE_VISIBLE_S
        while not (run_dir / TRAIN_DONE).exists() and time.monotonic() < deadline:
            os.listdir(run_dir)  # a readdir refreshes an NFS client's view of the folder
            time.sleep(1.0)
    if state in ("COMPLETED", "UNKNOWN") and (run_dir / TRAIN_DONE).exists():
        return read_train_done(run_dir)
    ckpt = latest_checkpoint_name(run_dir)
    if giveups:
        g = giveups[-1]
        raise PipelineError(
            f"training job {job_id} gave up: {g.get('reason')} budget ({g.get('budget')}) "
            f"spent. The last complete checkpoint ({ckpt}) is kept: run the workflow again "
            "to continue from it, or raise the budget in the profile."
        )
    if state == "COMPLETED" and (run_dir / STOPPED).exists():
        raise PipelineError(
            f"training job {job_id} stopped on request (STOP file) at checkpoint {ckpt}; "
            "run the workflow again to continue"
        )
    said = rank_error(run_dir, f"{job_id}.")
    if said is not None:
        raise PipelineError(f"training job {job_id} ended {state}: {said}")
    raise PipelineError(
        f"training job {job_id} ended {state} without train.done (last checkpoint: "
        f"{ckpt}; rerun to resume from it)\n{_stderr_tail(rec)}"
    )


def wait_slurm(run_dir: Path, rec: dict[str, Any], opts: LaunchOptions) -> dict[str, Any]:
    """Wait until the job ends, across PENDING/REQUEUED cycles; train.done's content, or a
    PipelineError saying why not."""
    job_id = rec["job_id"]
    policy = rec.get("policy", {})
    max_restarts = (policy.get("max_requeues", 0) + policy.get("max_preemptions", 0)
                    + policy.get("max_failures", 0) + 1)
    last: tuple[str, str] | None = None
    missing = 0
    news = Incidents(run_dir)
    while True:
        news.log()
        states = squeue_states([job_id])
        if states is None:  # squeue failed: slurmctld busy; try again
            time.sleep(opts.poll_s)
            continue
        st = states.get(job_id)
        if st is None:
            missing += 1
            if missing < 3:  # right after sbatch a job can be briefly invisible
                time.sleep(opts.poll_s)
                continue
            return _ended(run_dir, rec, "UNKNOWN")
        if (st.state, st.reason) != last:
            log.info("job %s: %s (%s)", job_id, st.state, st.reason)
            last = (st.state, st.reason)
            _check_restarts(run_dir, job_id, max_restarts)
        if not st.alive:
            return _ended(run_dir, rec, st.state)
        time.sleep(opts.poll_s)


def launch_slurm(run_dir: Path, data_dir: Path, run: Any, opts: LaunchOptions) -> dict[str, Any]:
    """Reattach to the run's job if Slurm still has it, else submit one; wait for it."""
    found = _reattachable(run_dir)
    if found is not None:
        rec, st = found
        # The login-node process died (or Snakemake was restarted) while the job went on:
        # wait for that job; a second one would train the same run twice.
        log.info("reattaching to training job %s (%s) recorded in job.json", rec["job_id"],
                 st.state)
        rec.setdefault("reattached", []).append(time.time())
        write_job(run_dir, rec)
        append_event(run_dir, "launch.reattach", job_id=rec["job_id"], state=st.state)
    else:
        (run_dir / STOP).unlink(missing_ok=True)
        (run_dir / STOPPED).unlink(missing_ok=True)
        rec = submit_slurm(run_dir, data_dir, run, opts)

    def _leave(signum: int, frame: Any) -> None:
        # The login-node side was killed: the job keeps running on its own (it checkpoints and
        # requeues itself); the next launch reattaches to it through job.json.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _leave)
    signal.signal(signal.SIGINT, _leave)
    signal.signal(signal.SIGHUP, _leave)
    return wait_slurm(run_dir, rec, opts)


# --------------------------------------------------------------------------------------------
# local


def wait_for_running_trainer(run_dir: Path) -> bool:
    """Local reattach: if a trainer from an earlier (killed) launch still holds the run's lock,
    wait for it instead of starting a second one. True if there was one."""
    with (run_dir / LOCK).open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("a training process from an earlier launch is still running: waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
            return True
    return False


def launch_local(run_dir: Path, data_dir: Path, run: Any, opts: LaunchOptions) -> dict[str, Any]:
    """Run the one node task on this host (submitit's local executor) and wait for it."""
    if wait_for_running_trainer(run_dir) and (run_dir / TRAIN_DONE).exists():
        return read_train_done(run_dir)
    (run_dir / STOP).unlink(missing_ok=True)
    folder = run_dir / SUBMITIT
    # The options travel with the task: the failure budget and the watchdog's limits.
    task = NodeTask(str(run_dir), str(data_dir), run.cluster.gpus_per_node, run.cluster.nodes,
                    opts)
    task.local_env = local_gpu_env(run.cluster.device, os.environ)
    if run.cluster.nodes != 1:
        raise PipelineError(
            f"cluster.nodes is {run.cluster.nodes}, but the local launcher runs one node; "
            "use --profile profiles/slurm or set cluster.nodes: 1"
        )
    executor = submitit.LocalExecutor(folder=folder,
                                      max_num_timeout=opts.max_requeues + opts.max_preemptions)
    executor.update_parameters(timeout_min=opts.time_min, tasks_per_node=1, nodes=1,
                               signal_delay_s=opts.signal_delay_s)
    for warning in launch_warnings(run_dir, opts):
        log.warning("%s", warning)
    job = executor.submit(task)
    write_job(run_dir, {"job_id": str(job.job_id), "launcher": "local",
                        "submitted": time.time(), "folder": str(folder), "policy": asdict(opts)})
    append_event(run_dir, "launch.submit", job_id=str(job.job_id), launcher="local",
                 nodes=1, time_min=opts.time_min, signal_delay_s=opts.signal_delay_s)
    log.info("submitted training job %s (local)", job.job_id)

    def _cancel(signum: int, frame: Any) -> None:
        # The rule was killed: take the job down with it rather than leave a second trainer
        # running when Snakemake is started again.
        job.cancel(check=False)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _cancel)
    signal.signal(signal.SIGINT, _cancel)
    news = Incidents(run_dir)
    while not job.done():
        news.log()
        time.sleep(1)
    news.log()
    try:
        result = job.result()
    except Exception as err:  # submitit wraps the task's exception with its traceback
        if (run_dir / TRAIN_DONE).exists():  # the time-limit warning came at the last step
            return read_train_done(run_dir)
        said = rank_error(run_dir, f"{job.job_id}.")
        if said is not None:  # a rank refused something: its one line, not the traceback
            raise PipelineError(f"training job {job.job_id} failed: {said}") from None
        raise PipelineError(f"training job {job.job_id} failed:\n{err}") from None
    if not (run_dir / TRAIN_DONE).exists():
        raise PipelineError(f"training job {job.job_id} ended without train.done: {result}")
    return read_train_done(run_dir)


def launch(run_dir: Path, data_dir: Path, opts: LaunchOptions) -> dict[str, Any]:
    """Submit the run's training job and wait for it; returns ``train.done``'s content."""
    # Everything is checked before anything is written or submitted: a refused launch leaves
    # the run directory as it was (its STOP file included).
    check_options(opts)
    for flag, path in (("--run-dir", run_dir), ("--data-dir", data_dir)):
        check_text(str(path), flag)
    run_dir = run_dir.resolve()
    data_dir = data_dir.resolve()
    run = load_run_config(run_dir / RUN_CONFIG)
    if opts.launcher == "slurm":
        check_folder(run_dir / SUBMITIT / "%j")
        missing = [cmd for cmd in ("sbatch", "srun", "squeue") if shutil.which(cmd) is None]
        if missing:
            raise PipelineError(f"--launcher slurm: {', '.join(missing)} not found on PATH; "
                                "run on a Slurm login node, or use --launcher local")
        return launch_slurm(run_dir, data_dir, run, opts)
    if opts.launcher != "local":
        raise PipelineError(f"unknown launcher {opts.launcher!r}: use local or slurm")
    return launch_local(run_dir, data_dir, run, opts)
