"""Tensor parallelism with DTensor (Megatron's split of each decoder layer), for the fsdp engine.

:func:`tensor_parallel` shards every decoder layer over the mesh's ``tp`` dimension before
FSDP2's ``fully_shard`` shards the result over the data-parallel dimensions: q/k/v and the MLP's
gate/up projections column-wise (each TP rank owns whole attention heads and a slice of the
intermediate features), o and down row-wise (their partial sums are all-reduced over TP). The
embedding, the norms and the LM head stay replicated over TP (sharded over DP only).

No head-count change is needed for Hugging Face's Llama: its attention reshapes with
``view(..., -1, head_dim)``, so each rank runs its local ``heads / tp`` heads, and
``num_key_value_groups`` is a ratio that stays right. The pre-flight checks that ``tp`` divides
the heads, the KV heads and the intermediate size.

Parameters then live on two meshes (the TP layers' on ``dp × tp``, the rest on ``dp``), which
``torch.nn.utils.clip_grad_norm_`` refuses to stack: :func:`clip_grad_norm` takes the norm per
mesh and combines them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from pipeline.model.build import decoder_layers

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torch.distributed.device_mesh import DeviceMesh

#: Column-wise (output features split) and row-wise (input features split) projections of a
#: Llama decoder layer, by their module paths inside the layer.
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
           "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def tensor_parallel(model: Any, tp_mesh: DeviceMesh, layers: list[Any] | None = None) -> None:
    """Shard every decoder layer of ``model`` (or only ``layers``: a pipeline stage's) over the
    1-D ``tp_mesh`` in place (collective: every rank of the TP group calls it with the same,
    identically initialised model)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {name: ColwiseParallel() for name in COLWISE}
    plan.update({name: RowwiseParallel() for name in ROWWISE})
    for layer in decoder_layers(model) if layers is None else layers:
        parallelize_module(layer, tp_mesh, plan)


def _mesh_key(p: torch.Tensor) -> Any:
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return None
    return mesh.mesh_dim_names, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist())


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                   pp_group: Any = None) -> float:
    """The global 2-norm of the gradients (before clipping), and clip them to ``max_norm`` when
    it is > 0, for parameters spread over several device meshes: the norm per mesh (a DTensor
    norm made whole with ``full_tensor``), then the square root of their squares' sum. With a
    pipeline, each stage holds other parameters: the squares are summed over ``pp_group``."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(_mesh_key(p), []).append(p)
    squares = []
    for group in groups.values():
        norm = get_total_norm([p.grad for p in group], 2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total_sq = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        for group in groups.values():
            clip_grads_with_norm_(group, max_norm, total)
    return float(total)
