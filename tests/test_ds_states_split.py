"""A two-rank DeepSpeed resume reads its model states split (pipeline.checkpoint.read
``split_states``): each rank reads, block-checked, the weights of the other rank's partition
straight into its module's flat buffer and copies its own from the master partition it loads.

Real DeepSpeed (ZeRO-2, gloo, two processes), the real checkpoint manager: the resumed engine
holds exactly the saved weights, masters and moments; a byte damaged in one rank's own half is
found by the other rank (every block is checked by someone) and both fall back together; with
no checkpoint left, the engine's start-up weights are back (the halves read are gathered
again)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, REPO, subprocess_env

_WORKER = r"""
import json, logging, os, sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.train.extensions import import_deepspeed

deepspeed = import_deepspeed()  # as the pipeline does: op loads safe from a stale lock

from pipeline.checkpoint import format as ck
from pipeline.checkpoint import fastio
from pipeline.checkpoint.manager import CheckpointManager
from pipeline.errors import PipelineError
from pipeline.train.engines import DeepSpeedEngine

rank, root, out = int(os.environ["RANK"]), Path(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
       "bf16": {"enabled": sys.argv[4] == "bf16"}}
dtype = torch.bfloat16 if sys.argv[4] == "bf16" else torch.float32
log = []
logging.getLogger("pipeline.checkpoint").addHandler(
    type("Keep", (logging.Handler,), {"emit": lambda self, r: log.append(r.getMessage())})())


def engine(seed):
    torch.manual_seed(seed)
    # 21 MB of model states: 5.2 M fp32 or 10.5 M bf16 parameters (in each rank's half at
    # least one block, pipeline.checkpoint.fastio.BLOCK_BYTES, wholly).
    layers = 10 if dtype == torch.bfloat16 else 5
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    e = DeepSpeedEngine.__new__(DeepSpeedEngine)
    e.engine = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]
    e.pp = e.tp = 1
    return e


def state(e):
    opt = e.engine.optimizer
    moments = [v.clone() for s in opt.optimizer.state.values()
               for k, v in sorted(s.items()) if k != "step"]
    return ([p.detach().clone() for p in e.engine.module.parameters()],
            [t.detach().clone() for t in opt.single_partition_of_fp32_groups], moments)


def same(a, b):
    return all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))
               for x, y in zip(a, b))


def manager(name):
    return CheckpointManager(root / name, config_hash="cfg", data_hash="data", keep_last=5,
                             backend="deepspeed", zero_stage=2, rank=rank, world_size=2)


class NoLoader:
    def load_state_dict(self, state):
        pass


saved, saved_at, own_bytes = engine(0), {}, {}
for name, steps in (("good", 2), ("damaged", 2), ("alone", 1)):
    m = manager(name)
    for s in range(1, steps + 1):
        x = torch.full((1, 1024), 0.01 * (rank + 1), dtype=dtype)
        loss = saved.engine(x).square().mean()
        saved.engine.backward(loss)
        saved.engine.step()
        m.save(saved, ck.TrainerState(step=s, tokens_seen=0, loader={}))
        saved_at[name, s] = state(saved)
        part = saved.engine.optimizer.parallel_partitioned_bit16_groups[0][rank]
        own_bytes[name, s] = (part[:64].detach().view(torch.uint8).numpy().tobytes(),
                              part.numel() * part.element_size())
if rank == 0:
    # A byte in a block wholly inside rank 0's half of the weights: rank 0 skips it (its
    # masters hold those weights), so rank 1 alone can find it.
    for name, s in (("damaged", 2), ("alone", 1)):
        f = root / name / f"step-{s:06d}" / "ds/mp_rank_00_model_states.pt"
        data = bytearray(f.read_bytes())
        head, nbytes = own_bytes[name, s]
        at = data.find(head)
        block = fastio.BLOCK_BYTES
        flip = -(-at // block) * block + 100
        assert at > 0 and flip - 100 + block <= at + nbytes
        data[flip] ^= 0xFF
        f.write_bytes(bytes(data))
dist.barrier()
result = {}
for name in ("good", "damaged", "alone"):
    fresh = engine(1)
    start = state(fresh)
    m = manager(name)
    try:
        path = m.resume(reuse=fresh.load_targets)
    except PipelineError as err:  # nothing verifies: moved aside, every rank stops
        path = None
        error = str(err)
    else:
        error = None
    got = {"chosen": None if path is None else path.name}
    if path is not None:
        st = m.load(path, fresh, NoLoader())
        got.update(loaded=m.loaded.name, read_into_engine=m.read_into_engine,
                   exact=same(state(fresh), saved_at[name, st.step]))
    else:
        got["start_up_weights"] = same(state(fresh)[:2], start[:2])
        got["stopped"] = error is not None and "step-000001.damaged-" in error
    result[name] = got
(out / f"rank{rank}.json").write_text(json.dumps({"result": result, "log": log}))
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_two_ranks_read_the_model_states_split_and_resume_exactly(tmp_path: Path,
                                                                   dtype: str) -> None:
    """bf16: the weights in the file are bf16, the masters fp32; the half each rank copies
    from its masters is rounded as DeepSpeed's step rounds it."""
    procs = [subprocess.Popen(
        [str(PY), "-c", _WORKER, str(tmp_path / "ck"), str(tmp_path), str(tmp_path / "store"),
         dtype],
        cwd=REPO, env=subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs[0][-3000:] + errs[1][-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for got in ranks:
        good, damaged, alone = (got["result"][k] for k in ("good", "damaged", "alone"))
        # Masters, two moments and the module's flat buffer read into the engine; the weights,
        # masters and moments are the saved ones bit for bit.
        assert good == {"chosen": "step-000002", "loaded": "step-000002",
                        "read_into_engine": 4, "exact": True}, good
        # Rank 0's half of the newest one is damaged: both ranks fall back to step 1.
        assert damaged == {"chosen": "step-000001", "loaded": "step-000001",
                           "read_into_engine": 4, "exact": True}, damaged
        # Nothing verifies: moved aside and every rank stops naming it, the engine's start-up
        # weights and masters untouched, whole, on both ranks.
        assert alone == {"chosen": None, "start_up_weights": True, "stopped": True}, alone
    warnings = ranks[0]["log"]
    # Found by rank 1: rank 0 did not read its own half of the weights.
    assert any("step-000002" in w and "mp_rank_00_model_states.pt" in w
               and "(verified by rank 1)" in w for w in warnings), warnings
    assert any("step-000001" in w and "(verified by rank 1)" in w for w in warnings), warnings
