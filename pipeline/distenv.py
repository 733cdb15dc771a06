"""The distributed environment: the one place that reads torchrun's and Slurm's variables."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

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
