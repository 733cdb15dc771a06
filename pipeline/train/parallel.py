"""Device meshes from :class:`~pipeline.plan.topology.ParallelDims`: the one place that lays
the ranks out, so that engines take a mesh instead of building their own.

The world mesh has torchtitan's dimension order ``("pp", "dp_replicate", "dp_shard", "tp")``,
the rank order of ``topology.json`` (TP fastest, then DP, then PP). Data parallelism is two
dimensions because FSDP2 needs them apart: ``fully_shard`` takes a 1-D mesh (shard over it) or
a 2-D ``(replicate, shard)`` mesh (HSDP), so ``dp_replicate × dp_shard = dp`` is split by the
sharding strategy exactly as the render stage's ``fsdp.json`` does. Dimensions of size 1 are
left out, ``dp_shard`` excepted (FSDP2 always has a shard dimension): a pure data-parallel
job's mesh is 1-D over the world and uses the default process group, no extra groups.

Only :func:`build_mesh` needs torch (imported when called); the layout arithmetic is pure.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipeline.errors import PipelineError
from pipeline.plan.topology import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipeline.config.schema import RunConfig

#: Every dimension a mesh may have, outermost first.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
#: The data-parallel dimensions (what FSDP2 shards and replicates over).
DP_DIMS = ("dp_replicate", "dp_shard")


def parallel_dims(run: RunConfig) -> ParallelDims:
    """The rendered run's layout (``cluster`` × ``train.tp``/``train.pp``, batch split)."""
    t = run.train
    return ParallelDims(nodes=run.cluster.nodes, gpus_per_node=run.cluster.gpus_per_node,
                        tp=t.tp, pp=t.pp, micro_batch_size=t.micro_batch_size,
                        grad_accum=t.grad_accum)


def dp_split(dims: ParallelDims, sharding: str = "FULL_SHARD") -> tuple[int, int]:
    """``(dp_replicate, dp_shard)`` for an FSDP sharding strategy (``render_fsdp_config``'s
    rule): HYBRID_SHARD shards inside a node and replicates across nodes, NO_SHARD replicates
    only, FULL_SHARD / SHARD_GRAD_OP (and DeepSpeed's ZeRO) shard over all of DP."""
    if sharding == "HYBRID_SHARD":
        shard = math.gcd(dims.dp, max(1, dims.gpus_per_node // dims.tp))
        return dims.dp // shard, shard
    if sharding == "NO_SHARD":
        return dims.dp, 1
    return 1, dims.dp


def mesh_layout(dims: ParallelDims, sharding: str = "FULL_SHARD") -> tuple[tuple[str, ...],
                                                                           tuple[int, ...]]:
    """The mesh's dimension names and sizes, outermost first (size-1 dimensions left out,
    ``dp_shard`` kept). Raises when the layout does not fill the world."""
    errors = dims.problems()
    if errors:
        raise PipelineError("\n".join(str(e) for e in errors))
    replicate, shard = dp_split(dims, sharding)
    sizes = {"pp": dims.pp, "dp_replicate": replicate, "dp_shard": shard, "tp": dims.tp}
    names = tuple(n for n in MESH_DIMS if sizes[n] > 1 or n == "dp_shard")
    shape = tuple(sizes[n] for n in names)
    assert math.prod(shape) == dims.world, (names, shape, dims)
    return names, shape


def dp_coords(dims: ParallelDims, rank: int) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of global ``rank`` (TP fastest, then DP, then PP): which slice of
    each global batch the rank's data loader reads. Ranks of one TP group share it."""
    return (rank // dims.tp) % dims.dp, dims.dp


def reports_loss(dims: ParallelDims, rank: int) -> bool:
    """Whether ``rank`` holds a loss that counts once in the data-parallel mean: the first rank
    of its TP group (the others computed the same) on the last pipeline stage (the only one
    that computes it). Same rank order as :func:`dp_coords`."""
    return rank % dims.tp == 0 and rank // (dims.tp * dims.dp) == dims.pp - 1


def build_mesh(dims: ParallelDims, device_type: str, sharding: str = "FULL_SHARD") -> DeviceMesh:
    """The world's :class:`DeviceMesh` (collective: every rank calls it after the process group
    is up). Slice it by name: ``mesh["tp"]``, ``mesh["pp"]``, :func:`fsdp_mesh`."""
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = mesh_layout(dims, sharding)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh FSDP2's ``fully_shard`` takes: 2-D ``(dp_replicate, dp_shard)`` for HSDP /
    replication, else the 1-D ``dp_shard`` mesh."""
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
