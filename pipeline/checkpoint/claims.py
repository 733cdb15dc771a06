"""Which rank reads which file of a checkpoint at a resume, decided from the file names alone
(the checkpoint manager does not know the engine's layout: a wrong guess costs a read more,
never correctness); used by :mod:`pipeline.checkpoint.read`."""

from __future__ import annotations

import re
from typing import Any

#: Files up to this size are verified in memory and served from there; larger ones are read by
#: the engine through reused buffers (block-checked, or hashed whole beforehand).
KEEP_BYTES = 1 << 20

#: Per-rank files by name: DCP shards, RNG states, DeepSpeed's ZeRO partitions, model states.
DCP_SHARD = re.compile(r"^dcp/__(\d+)_\d+\.distcp$")
RNG = re.compile(r"^rng/rank-(\d+)\.pt$")
DS_ZERO = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt$")
DS_MODEL = re.compile(r"(?:^|/)mp_rank_(\d+)_model_states\.pt$")


def is_partition(rel: str) -> bool:
    """Whether ``rel`` is a DeepSpeed ZeRO optimizer partition (one rank's)."""
    m = DS_ZERO.search(rel)
    return m is not None and m.group(3) == "optim"


#: Small files every rank reads itself (DCP's index; the trainer state).
EVERY_RANK = frozenset({"dcp/.metadata", "trainer.json"})


def claims(files: dict[str, dict[str, Any]], world: int, saved_world: Any) -> dict[str, list[int]]:
    """Which ranks will read each file, as far as the names tell: ``{rel: [rank, ...]}``.

    Per-rank files (DCP shards ``__<rank>_<n>.distcp``, RNG states, DeepSpeed's
    ``zero_pp_rank_<dp>_mp_rank_<mp>`` partitions in rank order) belong to their rank only when
    the checkpoint was saved by this many ranks; DeepSpeed's ``mp_rank_<m>_model_states.pt`` is
    read by every rank of tensor-parallel rank ``m``."""
    same = saved_world == world
    out: dict[str, list[int]] = {}
    zero: dict[str, list[tuple[int, int, str]]] = {}
    model: list[tuple[int, str]] = []
    for rel in files:
        if rel in EVERY_RANK:
            out[rel] = list(range(world))
        elif m := DCP_SHARD.match(rel) or RNG.match(rel):
            if same and int(m.group(1)) < world:
                out[rel] = [int(m.group(1))]
        elif m := DS_ZERO.search(rel):
            zero.setdefault(m.group(3), []).append((int(m.group(1)), int(m.group(2)), rel))
        elif m := DS_MODEL.search(rel):
            model.append((int(m.group(1)), rel))
    for group in zero.values():
        # AutoTP numbers ranks dp × tp + tp_rank: (dp, mp) order is rank order.
        if same and len(group) == world:
            for rank, (_, _, rel) in enumerate(sorted(group)):
                out[rel] = [rank]
    if model and world % len(model) == 0:
        for m_rank, rel in model:
            out[rel] = [r for r in range(world) if r % len(model) == m_rank]
    return out


def assign(files: dict[str, dict[str, Any]], world: int, saved_world: Any) -> dict[int, list[str]]:
    """The files each rank verifies: those it claims (:func:`claims`; a large file that
    several ranks claim by the one of them with the fewest bytes so far), and the unclaimed rest
    shared out largest first to the rank with the fewest bytes so far (so that every file is
    verified by at least one rank)."""
    who = claims(files, world, saved_world)
    out: dict[int, list[str]] = {r: [] for r in range(world)}
    load = [0] * world
    for rel, ranks in sorted(who.items(), key=lambda kv: (len(kv[1]), kv[0])):
        if len(ranks) > 1 and files[rel]["bytes"] > KEEP_BYTES:
            ranks = [min(ranks, key=lambda i: (load[i], i))]
        for r in ranks:
            out[r].append(rel)
            load[r] += files[rel]["bytes"]
    for rel in sorted(set(files) - set(who), key=lambda k: (-files[k]["bytes"], k)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(rel)
        load[r] += files[rel]["bytes"]
    return out
