"""pipeline.checkpoint_reuse: a torch file deserialized as ``torch.load(weights_only=True)``
would, with its large storages read into memory the process already has (the optimizer's
state, replaced by the load anyway), in both of torch.save's formats."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint_reuse import StoragePool, load_reusing
from pipeline.errors import PipelineError

N = 300_000  # 1.2 MB of float32: above StoragePool.MIN_BYTES


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"base": {"state": {0: {"exp_avg": torch.randn(N, generator=g),
                                   "exp_avg_sq": torch.rand(N, generator=g),
                                   "step": torch.tensor(3.0)}},
                     "param_groups": [{"lr": 0.1, "params": [0]}]},
            "fp32": [torch.randn(N, generator=g)], "bf16": torch.randn(9).bfloat16(),
            "shared": (lambda t: [t, t[:5]])(torch.arange(20.0)), "n": 5}


def _saved(obj: object, zipfile: bool) -> tuple[io.BytesIO, int]:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=zipfile)
    return io.BytesIO(buf.getvalue()), len(buf.getvalue())


@pytest.mark.parametrize("zipfile", [False, True], ids=["legacy", "zip"])
def test_the_same_objects_as_torch_load_in_the_memory_given(zipfile: bool) -> None:
    f, size = _saved(_state(), zipfile)
    ref = torch.load(io.BytesIO(f.getvalue()), weights_only=True)
    old = [torch.zeros(N), torch.zeros(N), torch.zeros(7)]  # the last: too small to reuse
    pool = StoragePool(old)
    got = load_reusing(f, size, "part.pt", [], pool)
    st, rs = got["base"]["state"][0], ref["base"]["state"][0]
    for a, b in [(st["exp_avg"], rs["exp_avg"]), (st["exp_avg_sq"], rs["exp_avg_sq"]),
                 (st["step"], rs["step"]), (got["fp32"][0], ref["fp32"][0]),
                 (got["bf16"], ref["bf16"]), (got["shared"][0], ref["shared"][0])]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got["base"]["param_groups"] == ref["base"]["param_groups"] and got["n"] == 5
    # A storage two tensors share is still one storage.
    assert got["shared"][1].untyped_storage().data_ptr() == got["shared"][0].untyped_storage().data_ptr()
    # Two of the three equal-sized storages landed in the old tensors' memory, the third in
    # fresh memory; the small old tensor was left alone.
    ptrs = {t.data_ptr() for t in (st["exp_avg"], st["exp_avg_sq"], got["fp32"][0])}
    assert len(ptrs & {old[0].data_ptr(), old[1].data_ptr()}) == 2 and len(pool.borrowed) == 2
    pool.wipe()  # an abandoned load: the borrowed memory is zeroed again
    assert not old[0].any() and not old[1].any()


class _Evil:
    def __reduce__(self) -> tuple:
        return (print, ("pwned",))


@pytest.mark.parametrize("zipfile", [False, True], ids=["legacy", "zip"])
def test_what_torch_load_refuses_is_refused(zipfile: bool) -> None:
    f, size = _saved({"x": _Evil()}, zipfile)
    with pytest.raises(PipelineError, match="refused to unpickle"):
        load_reusing(f, size, "evil.pt", [], StoragePool())
    f, size = _saved(_state(), zipfile)
    cut = io.BytesIO(f.getvalue()[:size - 1000])
    with pytest.raises(PipelineError, match=r"cut\.pt"):
        load_reusing(cut, size - 1000, "cut.pt", [], StoragePool())


def _partition(root: Path, step: int) -> Path:
    """A checkpoint holding one DeepSpeed-named optimizer partition of 3 × 6 MB, written as the
    engine's files are (the zip format the rendered ds_config asks for; block checksums)."""
    from pipeline import checkpoint as ck
    from pipeline import fastio

    tmp = ck.tmp_dir(root, step)
    (tmp / "ds/ds").mkdir(parents=True)
    digests = fastio.Digests()
    g = torch.Generator().manual_seed(step)
    part = {"base_optimizer_state": {"state": {0: {"exp_avg": torch.randn(1_500_000, generator=g),
                                                   "exp_avg_sq": torch.rand(1_500_000, generator=g)}}},
            "single_partition_of_fp32_groups": [torch.randn(1_500_000, generator=g)]}
    fastio.torch_save(part, tmp / "ds/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt", digests,
                      _use_new_zipfile_serialization=True)
    return ck.finalize(root, step, {"world_size": 1}, keep_last=5,
                       known=digests.relative_to(tmp))


def test_a_partition_is_verified_block_by_block_into_the_engines_memory(tmp_path: Path) -> None:
    from pipeline import checkpoint_read as cr
    from pipeline.io import read_json

    path = _partition(tmp_path, 1)
    rel = "ds/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    files = read_json(path / "manifest.json")["files"]
    assert cr.read_once(rel, files[rel], [0], 0)  # block checksums: read once, by its rank
    ref = torch.load(path / rel, weights_only=True)
    old = [torch.zeros(1_500_000), torch.zeros(1_500_000)]  # the engine's current moments
    out, why, refused = cr.verify_local(path, files, [rel], frozenset({rel}), StoragePool(old))
    assert (why, refused) == (None, False)
    got = out.ds_loader()(path / rel, map_location="cpu")
    moments = got["base_optimizer_state"]["state"][0]
    assert torch.equal(moments["exp_avg"], ref["base_optimizer_state"]["state"][0]["exp_avg"])
    assert {moments["exp_avg"].data_ptr(), moments["exp_avg_sq"].data_ptr()} <= {
        t.data_ptr() for t in old} | {got["single_partition_of_fp32_groups"][0].data_ptr()}
    out.release()
    # One flipped byte in the 3rd block: the verdict names it, nothing is handed to the
    # engine, and the engine's memory that was read into is zeroed again.
    data = bytearray((path / rel).read_bytes())
    data[(8 << 20) + 5] ^= 1
    (path / rel).write_bytes(bytes(data))
    old = [torch.ones(1_500_000), torch.ones(1_500_000)]
    out, why, refused = cr.verify_local(path, files, [rel], frozenset({rel}), StoragePool(old))
    assert why is not None and "bytes 8388608-12582912 do not match" in why and not refused
    assert not out.loaded and not any(t.any() for t in old)  # they were ones
    out.release()
