"""Device meshes from ParallelDims (pipeline.train.parallel): the layout arithmetic, and real
gloo meshes that FSDP2 shards over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.plan.topology import ParallelDims
from pipeline.train.parallel import dp_coords, dp_split, mesh_layout


def test_a_pure_data_parallel_layout_is_one_dp_shard_dimension():
    dims = ParallelDims(nodes=1, gpus_per_node=2)
    assert mesh_layout(dims) == (("dp_shard",), (2,))
    assert mesh_layout(dims, "SHARD_GRAD_OP") == (("dp_shard",), (2,))
    assert mesh_layout(dims, "NO_SHARD") == (("dp_replicate", "dp_shard"), (2, 1))
    # One node: hybrid sharding has nothing to replicate across.
    assert mesh_layout(dims, "HYBRID_SHARD") == (("dp_shard",), (2,))
    assert mesh_layout(ParallelDims(nodes=1, gpus_per_node=1)) == (("dp_shard",), (1,))


def test_hybrid_sharding_shards_inside_a_node_and_replicates_across():
    dims = ParallelDims(nodes=3, gpus_per_node=4)
    assert dp_split(dims, "HYBRID_SHARD") == (3, 4)
    assert mesh_layout(dims, "HYBRID_SHARD") == (("dp_replicate", "dp_shard"), (3, 4))


def test_tp_and_pp_take_the_innermost_and_outermost_dimensions():
    dims = ParallelDims(nodes=2, gpus_per_node=8, tp=4, pp=2)
    assert mesh_layout(dims) == (("pp", "dp_shard", "tp"), (2, 2, 4))
    assert mesh_layout(dims, "HYBRID_SHARD") == (("pp", "dp_shard", "tp"), (2, 2, 4))
    # Rank order: TP fastest, then DP, then PP; a TP group shares its data slice.
    assert [dp_coords(dims, r)[0] for r in range(16)] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    assert dp_coords(dims, 5) == (1, 2)


def test_a_tp_only_layout_keeps_a_size_one_dp_shard_dimension():
    # tp = world: FSDP2 still shards over a dp_shard dimension (of one); both ranks of the TP
    # group read data-parallel slice 0 of 1 (the whole global batch).
    dims = ParallelDims(nodes=1, gpus_per_node=2, tp=2)
    assert mesh_layout(dims) == (("dp_shard", "tp"), (1, 2))
    assert [dp_coords(dims, r) for r in range(2)] == [(0, 1), (0, 1)]
    dims = ParallelDims(nodes=1, gpus_per_node=4, tp=2)
    assert mesh_layout(dims) == (("dp_shard", "tp"), (2, 2))
    assert [dp_coords(dims, r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_a_layout_that_does_not_fill_the_world_is_refused():
    with pytest.raises(PipelineError, match="does not divide"):
        mesh_layout(ParallelDims(nodes=1, gpus_per_node=6, tp=4))


def _rank(rank: int, world: int, store: str, out: str, nodes: int, sharding: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pipeline.train.parallel import build_mesh, fsdp_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dims = ParallelDims(nodes=nodes, gpus_per_node=world // nodes)
        mesh = build_mesh(dims, "cpu", sharding)
        sub = fsdp_mesh(mesh)
        torch.manual_seed(0)
        layer = fully_shard(torch.nn.Linear(8, 4, bias=False), mesh=sub)
        w = layer.weight
        rec = {
            "names": list(mesh.mesh_dim_names), "shape": list(mesh.mesh.shape),
            "fsdp_names": list(sub.mesh_dim_names), "fsdp_shape": list(sub.mesh.shape),
            "coords": mesh.get_coordinate(),
            "global_shape": list(w.shape), "local_shape": list(w.to_local().shape),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(rec))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, world: int, nodes: int, sharding: str) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(world, str(tmp_path / "store"), str(tmp_path), nodes, sharding),
             nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_two_gloo_ranks_get_a_dp_mesh_that_fsdp2_shards_over(tmp_path):
    recs = _spawn(tmp_path, world=2, nodes=1, sharding="FULL_SHARD")
    for rank, rec in enumerate(recs):
        assert rec["names"] == ["dp_shard"] and rec["shape"] == [2]
        assert rec["fsdp_names"] == ["dp_shard"] and rec["fsdp_shape"] == [2]
        assert rec["coords"] == [rank]
        assert rec["global_shape"] == [4, 8] and rec["local_shape"] == [2, 8]


@pytest.mark.slow
def test_four_gloo_ranks_on_two_nodes_get_a_hybrid_mesh(tmp_path):
    recs = _spawn(tmp_path, world=4, nodes=2, sharding="HYBRID_SHARD")
    for rank, rec in enumerate(recs):
        assert rec["names"] == ["dp_replicate", "dp_shard"] and rec["shape"] == [2, 2]
        assert rec["fsdp_names"] == ["dp_replicate", "dp_shard"]
        assert rec["coords"] == [rank // 2, rank % 2]
        # Sharded over the node's 2 ranks only, replicated across the nodes.
        assert rec["global_shape"] == [4, 8] and rec["local_shape"] == [2, 8]


def test_the_loss_counts_once_per_data_parallel_replica_from_the_last_stage():
    from pipeline.plan.topology import ParallelDims
    from pipeline.train.parallel import reports_loss

    def ranks(tp: int, pp: int, world: int) -> list[int]:
        dims = ParallelDims(nodes=1, gpus_per_node=world, tp=tp, pp=pp, micro_batch_size=1,
                            grad_accum=2)
        return [r for r in range(world) if reports_loss(dims, r)]

    assert ranks(1, 1, 4) == [0, 1, 2, 3]
    assert ranks(2, 1, 4) == [0, 2]
    assert ranks(1, 2, 4) == [2, 3]
    assert ranks(2, 2, 8) == [4, 6]
