"""The distributed environment: the one place that reads torchrun's and Slurm's variables."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

#: Environment variable naming one launch attempt (the launcher sets it for torchrun; rank 0
#: copies it into stopped.json): the launcher takes a stopped.json as its attempt's only when
#: the names match, so an attempt that fails moments after the previous one stopped is not
#: read as stopped. Every node of a Slurm attempt derives the same name (job id, restart).
ATTEMPT_ENV = "ZEROSNAKE_ATTEMPT"

#: Rendezvous ports are derived from the job id so that two jobs sharing a head node do not
#: collide; the range stays clear of the ephemeral ports Linux hands out (32768+).
PORT_BASE = 20000
PORT_SPAN = 10000


@dataclass(frozen=True, kw_only=True, slots=True)
class RankEnv:
    """What a training process knows about its place in the job (set by torchrun)."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank within this node (selects the GPU)."""
    local_world_size: int
    """Processes on this node."""
    node_rank: int
    """Index of this node."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankEnv:
        """Read torchrun's variables; a bare ``python`` process is rank 0 of 1."""
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        rank = int(env.get("RANK", "0"))
        return cls(
            rank=rank,
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=local_world,
            node_rank=int(env.get("GROUP_RANK", str(rank // max(local_world, 1)))),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeEnv:
    """What one node of a launch needs to start its ``torchrun``."""

    nnodes: int
    """Nodes in the job."""
    node_rank: int
    """This node's index (0 on the head node)."""
    head_node: str
    """Host name of the rendezvous node."""
    job_id: str
    """Scheduler job id (also the rendezvous id)."""
    port: int
    """Rendezvous port on the head node."""
    restart_count: int = 0
    """How many times the scheduler restarted this job (requeues)."""


def port_for_job(job_id: str) -> int:
    """A rendezvous port derived from the job id (stable across requeues of the same job)."""
    digits = "".join(c for c in job_id if c.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``sn[1-2]``) with ``scontrol show hostnames``.

    Slurm's own expansion is used rather than a hand-written parser: the syntax has ranges,
    zero-padding and several bracket groups.
    """
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True
    ).stdout.split()
    if not out:
        raise RuntimeError(f"scontrol expanded node list {nodelist!r} to nothing")
    return out


def node_env_from_slurm(env: Mapping[str, str] | None = None) -> NodeEnv:
    """Translate the variables Slurm sets in a job step (one task per node) into a NodeEnv."""
    env = os.environ if env is None else env
    job_id = env["SLURM_JOB_ID"]
    nodelist = env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
    nnodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES", "1"))
    head = expand_nodelist(nodelist)[0] if nnodes > 1 else env.get("SLURMD_NODENAME", "localhost")
    return NodeEnv(
        nnodes=nnodes,
        node_rank=int(env.get("SLURM_NODEID", "0")),
        head_node=head,
        job_id=job_id,
        port=port_for_job(job_id),
        restart_count=int(env.get("SLURM_RESTART_COUNT", "0")),
    )


def torchrun_argv(
    python: str,
    *,
    node: NodeEnv | None,
    nproc_per_node: int,
    module: str,
    args: list[str],
) -> list[str]:
    """The ``torchrun`` command for one node, as an argument list (never a shell string).

    ``node=None`` is a single-node standalone launch (a local run).
    """
    argv = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if node is None:
        argv += ["--standalone", "--nnodes=1"]
    else:
        argv += [
            f"--nnodes={node.nnodes}",
            f"--node-rank={node.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={node.head_node}:{node.port}",
            f"--rdzv-id={node.job_id}",
        ]
    # Restarts are the scheduler's job (requeue from the last complete checkpoint), not
    # torchrun's: an in-place restart would resume without the requeue bookkeeping.
    argv += ["--max-restarts=0", "-m", module, *args]
    return argv


# --------------------------------------------------------------------------------------------
# Reading Slurm's view of a job (squeue/scontrol, argument lists). squeue rather than sacct: it
# works without slurmdbd; finished jobs stay visible for MinJobAge seconds.

#: States in which a job may still run: waiting across requeues is not a failure.
ALIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
    "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "POWER_UP_NODE",
})


@dataclass(frozen=True, kw_only=True, slots=True)
class JobState:
    """One job as squeue shows it."""

    job_id: str
    state: str
    """Slurm's state name (``RUNNING``, ``PENDING``, ``COMPLETED``, ...)."""
    reason: str
    """Why it waits (``BeginTime``, ``Resources``, ``None``, ...)."""
    name: str
    nodes: str
    """Node list (empty while pending)."""

    @property
    def alive(self) -> bool:
        return self.state in ALIVE_STATES


def squeue_states(job_ids: list[str], timeout: float = 30.0) -> dict[str, JobState] | None:
    """The jobs squeue still knows (any state); ``None`` when squeue itself failed (slurmctld
    busy or unreachable: the caller retries instead of concluding anything)."""
    if not job_ids:
        return {}
    # Fields split on a unit separator; the job name comes last and keeps the rest of the line,
    # so a name with '|', spaces or even that separator stays whole; records end with a record
    # separator, so a name holding a newline does too.
    fmt = "%i\x1f%T\x1f%r\x1f%N\x1f%j\x1e"
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", fmt],
            capture_output=True, text=True, timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        # squeue fails outright when none of the ids is known any more (aged out after MinJobAge)
        return {} if "Invalid job id" in proc.stderr else None
    out: dict[str, JobState] = {}
    for record in proc.stdout.split("\x1e"):
        parts = record.lstrip("\n").split("\x1f", 4)
        if len(parts) == 5 and parts[0]:
            jid, state, reason, nodes, name = parts
            out[jid] = JobState(job_id=jid, state=state, reason=reason, name=name, nodes=nodes)
    return out


def scontrol_job(job_id: str, timeout: float = 30.0) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (Restarts, ExcNodeList, TimeLimit, ...); {} if unknown.

    Values with spaces (Command=, a hostile Comment=) are not split reliably by this format:
    use it only for scheduler-owned fields."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id],
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if proc.returncode != 0:
        return {}
    fields: dict[str, str] = {}
    for token in proc.stdout.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def parse_slurm_duration(text: str) -> float | None:
    """Seconds in a Slurm duration (``[days-]hours:minutes:seconds``, ``mm:ss``); None for
    ``UNLIMITED``/``INVALID``/``NOT_SET``."""
    text = text.strip()
    if not text or not (text[0].isdigit()):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(p) for p in text.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts[-3:]
    return float(((days * 24 + h) * 60 + m) * 60 + s)


def time_left_s(job_id: str) -> float | None:
    """Seconds until the job's time limit, as slurmctld sees it (None if unlimited/unknown)."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%L"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_slurm_duration(proc.stdout) if proc.returncode == 0 else None


def partition_nodes(partition: str | None) -> list[str]:
    """Node names of a partition (the default one when None): bounds the exclude list."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N"] + (["-p", partition] if partition else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted(set(proc.stdout.split())) if proc.returncode == 0 else []
