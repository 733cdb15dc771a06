"""A resume's verification split over the ranks (pipeline.checkpoint.read): each rank checks the
files it reads, every file is checked by some rank, and all ranks agree before any engine reads.

The collective test runs the real ``CheckpointManager.resume`` on two gloo processes over
checkpoint folders written by ``checkpoint.finalize`` (engine-shaped file names, random bytes:
the engines' own resumes are covered by test_resume and test_chaos)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.checkpoint import claims as cc
from pipeline.checkpoint import format as ck
from pipeline.checkpoint import read as cr
from pipeline.checkpoint.manager import CheckpointManager

FILES = {
    "dcp/__0_0.distcp": 3 << 20,  # rank 0's shard (large: read with O_DIRECT)
    "dcp/__1_0.distcp": 3 << 20,  # rank 1's shard
    "dcp/.metadata": 300,         # every rank
    "trainer.json": 40,           # every rank
    "extra/blob.bin": 5000,       # no rank claims it: still verified by one
}


def _checkpoint(root: Path, step: int) -> Path:
    tmp = ck.tmp_dir(root, step)
    for rel, size in FILES.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(os.urandom(size))
    meta = {"world_size": 2, "config_hash": "cfg", "data_manifest_sha256": "data"}
    return ck.finalize(root, step, meta, keep_last=5)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))  # same size: only the checksum can tell


def test_every_file_is_verified_by_some_rank_and_shards_by_their_own() -> None:
    files = {rel: {"bytes": n} for rel, n in FILES.items()}
    mine = cc.assign(files, 2, 2)
    assert "dcp/__0_0.distcp" in mine[0] and "dcp/__0_0.distcp" not in mine[1]
    assert "dcp/__1_0.distcp" in mine[1] and "dcp/__1_0.distcp" not in mine[0]
    assert all(f in mine[0] and f in mine[1] for f in ("dcp/.metadata", "trainer.json"))
    assert set(mine[0]) | set(mine[1]) == set(files)
    # Saved by another world size: no shard belongs to a rank, all are still shared out.
    other = cc.assign(files, 2, 4)
    assert set(other[0]) | set(other[1]) == set(files)


def _manager_warnings() -> list[str]:
    """The checkpoint package's log messages of this process (the manager's, and the format's
    for a folder moved aside), as they come."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("pipeline.checkpoint").addHandler(Keep())
    return messages


def _worker(rank: int, store: str, roots: list[str], out: str) -> None:
    import torch.distributed as dist

    messages = _manager_warnings()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    import torch

    from pipeline.errors import PipelineError
    from pipeline.train.engines import FSDPEngine

    result = []
    for root in roots:
        manager = CheckpointManager(Path(root), config_hash="cfg", data_hash="data",
                                       keep_last=5, backend="fsdp", zero_stage=None,
                                       rank=rank, world_size=2)
        # A requeued job's fsdp engine: an optimizer without state, whose moments the resume
        # makes at its start (load_targets) for the load to fill.
        param = torch.nn.Parameter(torch.ones(3, 5))
        engine = SimpleNamespace(opt=torch.optim.AdamW([param]))
        try:
            path = manager.resume(reuse=lambda engine=engine: FSDPEngine.load_targets(engine))
        except PipelineError as err:  # every checkpoint damaged: moved aside, no fresh start
            path, result_error = None, str(err)
        else:
            result_error = None
        verified = manager._verified
        state = engine.opt.state.get(param, {})
        result.append({"path": None if path is None else Path(path).name,
                       "kept": sorted(verified.data) if verified is not None else None,
                       "moments": sorted(k for k, v in state.items() if k != "step"
                                         and v.shape == param.shape),
                       "error": result_error})
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"result": result, "log": messages}))


def test_a_corrupt_file_fails_on_every_rank_and_the_previous_checkpoint_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.multiprocessing as mp

    from pipeline.checkpoint import fastio

    # Shards smaller than a block have no block checksums: the resume hashes them whole.
    monkeypatch.setattr(fastio, "BLOCK_BYTES", 8 << 20)
    shard = tmp_path / "shard" / "checkpoints"    # newest: a byte of rank 1's shard flipped
    unread = tmp_path / "unread" / "checkpoints"  # newest: a byte of a file no rank reads
    alone = tmp_path / "alone" / "checkpoints"    # the only one, corrupt: stop, naming it
    for root in (shard, unread):
        _checkpoint(root, 1)
    _flip(_checkpoint(shard, 2) / "dcp/__1_0.distcp", (3 << 20) - 7)
    _flip(_checkpoint(unread, 2) / "extra/blob.bin", 10)
    _flip(_checkpoint(alone, 1) / "dcp/__0_0.distcp", 0)
    mp.spawn(_worker, args=(str(tmp_path / "store"), [str(shard), str(unread), str(alone)],
                            str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for got in ranks:
        assert [x["path"] for x in got["result"]] == ["step-000001", "step-000001", None]
        # Each rank kept the small files it verified, for the engine to read from memory; the
        # large shards are read again, re-hashed, when the engine reads them.
        kept = got["result"][0]["kept"]
        assert {"dcp/.metadata", "trainer.json"} <= set(kept), kept
        assert not any(k.endswith(".distcp") for k in kept), kept
        # The moments made for a checkpoint that verifies are there for the engine's load;
        # with nothing to load they are dropped (uninitialized memory is no Adam state).
        assert [x["moments"] for x in got["result"]] == [["exp_avg", "exp_avg_sq"]] * 2 + [[]]
        # The only checkpoint damaged: moved aside (kept), and every rank stops naming it
        # rather than train from step 0 unnoticed.
        assert "no checkpoint in" in got["result"][2]["error"]
        assert "step-000001.damaged-" in got["result"][2]["error"]
    assert [p.name.split(".")[0] for p in alone.iterdir()] == ["step-000001"]
    (moved,) = [p.name for p in shard.iterdir() if ".damaged-" in p.name]
    assert moved.startswith("step-000002")
    warnings = ranks[0]["log"]
    assert any("step-000002" in w and "dcp/__1_0.distcp does not match its checksum "
               "(verified by rank 1)" in w for w in warnings), warnings
    assert any("step-000002" in w and "extra/blob.bin does not match" in w for w in warnings)
    assert any("dcp/__0_0.distcp does not match its checksum (verified by rank 0)" in w
               for w in warnings)
    assert not ranks[1]["log"]  # rank 0 alone reports the skip


class _DictEngine:
    """The engine protocol over a plain dict of tensors, saved and loaded by DCP as the fsdp
    engine does (fastio's checksumming writer; the resume's verified reader)."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def save(self, ckpt: Path) -> dict:
        import torch.distributed.checkpoint as dcp

        from pipeline.checkpoint import fastio
        from pipeline.checkpoint.async_save import dcp_writer

        digests = fastio.Digests()
        dcp.save(self.state, storage_writer=dcp_writer(ckpt, digests))
        return {"digests": digests.relative_to(ckpt)}

    def load(self, ckpt: Path, extra: dict) -> None:
        from pipeline.checkpoint.tensors import dcp_load

        dcp_load(self.state, ckpt / "dcp", fs=extra["verified"].dcp_filesystem())


class _NoLoader:
    def load_state_dict(self, state: dict) -> None:
        pass


def _damage_worker(rank: int, store: str, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from pipeline.errors import PipelineError

    messages = _manager_warnings()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    # 6 MB per rank (several blocks): each rank's own shard file, read by it alone.
    engine = _DictEngine({f"w{rank}": torch.zeros(1_500_000), "shared": torch.zeros(10)})
    result: dict = {}
    for name in ("two", "alone"):
        manager = CheckpointManager(Path(root) / name, config_hash="cfg", data_hash="data",
                                       keep_last=5, backend="fsdp", zero_stage=None,
                                       rank=rank, world_size=2)
        steps = (1, 2) if name == "two" else (1,)
        for step in steps:
            for t in engine.state.values():
                t.fill_(float(step))
            manager.save(engine, ck.TrainerState(step=step, tokens_seen=0, loader={}))
        dist.barrier()
        if rank == 0:  # one byte of rank 1's shard of the newest checkpoint, in its 2nd block
            _flip(Path(root) / name / f"step-{steps[-1]:06d}" / "dcp/__1_0.distcp", 5 << 20)
        dist.barrier()
        for t in engine.state.values():
            t.fill_(-1.0)
        path = manager.resume()
        # The damaged shard is not read before the engine reads it: resume chooses it.
        result[name] = {"chosen": Path(path).name}
        try:
            state = manager.load(path, engine, _NoLoader())
            result[name].update(loaded=manager.loaded.name, step=state.step,
                                values=sorted({float(t.mean()) for t in engine.state.values()}))
        except PipelineError as err:
            result[name]["error"] = str(err)
    dist.destroy_process_group()
    Path(out, f"damage{rank}.json").write_text(json.dumps({"result": result, "log": messages}))
    # Out without the interpreter's teardown: about one run in seven, one of these processes
    # aborted there ("terminate called without an active exception", no Python frame, after
    # its results were written), which spawn reports as a failure of the test.
    os._exit(0)


def test_a_block_damaged_since_the_save_is_found_as_the_engine_reads_and_the_older_one_loads(
        tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_damage_worker, args=(str(tmp_path / "store"), str(tmp_path / "ck"),
                                   str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"damage{r}.json").read_text()) for r in (0, 1)]
    manifest = json.loads((tmp_path / "ck/two/step-000001" / ck.MANIFEST).read_text())
    shard = manifest["files"]["dcp/__1_0.distcp"]
    block = shard["blocks"]["bytes"]
    assert len(shard["blocks"]["xxh3_64"]) == -(-shard["bytes"] // block) > (5 << 20) // block
    for got in ranks:
        two, alone = got["result"]["two"], got["result"]["alone"]
        assert two["chosen"] == "step-000002"
        # Every rank fell back together; every tensor holds step 1's values, none step 2's.
        assert (two["loaded"], two["step"], two["values"]) == ("step-000001", 1, [1.0])
        assert alone["chosen"] == "step-000001" and "loaded" not in alone
        # Moved aside (kept for a person), and every rank stops naming it.
        assert "no checkpoint in" in alone["error"] and "moved aside" in alone["error"]
        assert "step-000001.damaged-" in alone["error"]
    assert any("step-000002" in w and f"bytes {(5 << 20) // block * block}-" in w
               and "__1_0.distcp" in w
               for w in ranks[0]["log"]), ranks[0]["log"]


def test_a_file_every_rank_maps_is_checked_in_shares_that_cover_it(tmp_path: Path) -> None:
    import torch

    from pipeline.checkpoint import fastio

    rel = "ds/ds/mp_rank_00_model_states.pt"  # DeepSpeed's model states: every rank maps it
    tmp = ck.tmp_dir(tmp_path, 1)
    (tmp / "ds/ds").mkdir(parents=True)
    digests = fastio.Digests()
    fastio.torch_save({"module": {"w": torch.randn(3_000_000)}}, tmp / rel, digests)
    path = ck.finalize(tmp_path, 1, {"world_size": 2}, keep_last=5,
                       known=digests.relative_to(tmp))
    files = json.loads((path / ck.MANIFEST).read_text())["files"]
    who = cc.claims(files, 2, 2)
    assert who[rel] == [0, 1]
    shares = [cr.split_shared(files, who, r)[rel] for r in (0, 1)]
    size = files[rel]["bytes"]
    assert shares[0][0] == 0 and shares[0][1] == shares[1][0] and shares[1][1] == size
    for r in (0, 1):
        assert cr.verify_local(path, files, [], parts={rel: shares[r]})[1] is None
    for offset, bad in ((shares[1][0] + 10, 1), (5, 0)):  # a byte in one rank's share
        data = bytearray((path / rel).read_bytes())
        data[offset] ^= 1
        (path / rel).write_bytes(bytes(data))
        verdicts = [cr.verify_local(path, files, [], parts={rel: shares[r]})[1:] for r in (0, 1)]
        assert verdicts[1 - bad] == (None, False)
        assert "do not match the manifest's block checksum" in verdicts[bad][0]
        assert verdicts[bad][1] is False  # damage, not a refusal
        data[offset] ^= 1
        (path / rel).write_bytes(bytes(data))


def test_block_checksums_are_used_up_to_the_largest_block_a_window_takes() -> None:
    from pipeline.checkpoint.stream import MAX_BLOCK_BYTES

    def entry(block: int) -> dict:
        return {"bytes": 3 * block, "blocks": {"bytes": block, "xxh3_64": ["0" * 16] * 3}}

    assert cr.usable_blocks(entry(4 << 20))[0] == 4 << 20  # written before 1 MiB blocks
    assert cr.usable_blocks(entry(MAX_BLOCK_BYTES)) is not None
    assert cr.usable_blocks(entry(2 * MAX_BLOCK_BYTES)) is None  # hashed whole instead
