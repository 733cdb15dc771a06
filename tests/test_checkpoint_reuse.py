"""pipeline.checkpoint.reuse: a torch file deserialized as ``torch.load(weights_only=True)``
would, with the storages of the tensors at the engine's paths read into the engine's own
tensors (the state the load replaces anyway), in both of torch.save's formats."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint.reuse import LoadTargets, load_reusing
from pipeline.errors import PipelineError

N = 300_000


def _targets(tensors: dict) -> tuple[LoadTargets, list]:
    undone: list = []
    return LoadTargets(dict(tensors), lambda: undone.append(True)), undone


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
def test_the_same_objects_as_torch_load_in_the_engines_tensors(zipfile: bool) -> None:
    f, size = _saved(_state(), zipfile)
    ref = torch.load(io.BytesIO(f.getvalue()), weights_only=True)
    m, v, master = torch.zeros(N), torch.zeros(N), torch.zeros(N)
    wrong = torch.zeros(9)  # bf16 in the file: a float32 tensor there is not read into
    targets, undone = _targets({
        ("base", "state", 0, "exp_avg"): m, ("base", "state", 0, "exp_avg_sq"): v,
        ("fp32", 0): master, ("bf16",): wrong, ("absent", 3): torch.zeros(N)})
    got = load_reusing(f, size, "part.pt", [], targets)
    st, rs = got["base"]["state"][0], ref["base"]["state"][0]
    for a, b in [(st["exp_avg"], rs["exp_avg"]), (st["exp_avg_sq"], rs["exp_avg_sq"]),
                 (st["step"], rs["step"]), (got["fp32"][0], ref["fp32"][0]),
                 (got["bf16"], ref["bf16"]), (got["shared"][0], ref["shared"][0])]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got["base"]["param_groups"] == ref["base"]["param_groups"] and got["n"] == 5
    # A storage two tensors share is still one storage.
    assert got["shared"][1].untyped_storage().data_ptr() == got["shared"][0].untyped_storage().data_ptr()
    # Each of the three equal-sized storages is in the engine tensor of its role: the moments
    # are the engine's tensors, the master too (DeepSpeed's copy of it does nothing).
    assert st["exp_avg"] is m and st["exp_avg_sq"] is v and got["fp32"][0] is master
    assert torch.equal(m, rs["exp_avg"]) and torch.equal(master, ref["fp32"][0])
    assert not wrong.any() and targets.claimed == 3 and set(targets.tensors) == {
        ("bf16",), ("absent", 3)}
    targets.restore()  # an abandoned load: the engine's undo runs (once)
    targets.restore()
    assert undone == [True]


def test_a_view_of_the_engines_storage_is_read_in_place() -> None:
    """A tensor saved as a view of a larger storage (DeepSpeed's unpadded master partition)
    is read into the engine tensor that is the same view of a storage of that size."""
    flat = torch.arange(float(N))
    f, size = _saved({"masters": [flat[: N - 8]], "other": flat[N - 8:]}, False)
    mine = torch.zeros(N)
    targets, _ = _targets({("masters", 0): mine[: N - 8]})
    got = load_reusing(f, size, "p.pt", [], targets)
    assert torch.equal(mine, flat) and targets.claimed == 1
    assert got["masters"][0].untyped_storage().data_ptr() == mine.data_ptr()
    assert got["other"].data_ptr() == mine.data_ptr() + (N - 8) * 4  # shares that storage
    # A target of another shape is not read into.
    targets, _ = _targets({("masters", 0): torch.zeros(N - 9)})
    load_reusing(io.BytesIO(f.getvalue()), size, "p.pt", [], targets)
    assert targets.claimed == 0


@pytest.mark.parametrize("zipfile", [False, True], ids=["legacy", "zip"])
def test_views_of_one_storage_are_read_in_place_all_but_the_range_the_engine_rebuilds(
        zipfile: bool) -> None:
    """DeepSpeed's parameters, views of one flat buffer saved whole: read into the engine's
    flat buffer if the file lays out every one of them as the engine does, leaving the
    ``skip`` range (this rank's partition, rebuilt from its masters) as it was; read into fresh
    memory, as ``torch.load`` would, if the layout of any differs."""
    flat = torch.arange(1000.0)
    f, size = _saved({"module": {"a": flat[:400].view(20, 20), "b": flat[400:]}}, zipfile)
    mine = torch.full((1000,), -1.0)
    targets, _ = _targets({("module", "a"): mine[:400].view(20, 20), ("module", "b"): mine[400:]})
    targets.skip[mine.untyped_storage().data_ptr()] = (400 * 4, 700 * 4)
    got = load_reusing(f, size, "m.pt", [], targets)
    assert got["module"]["a"].data_ptr() == mine.data_ptr() and targets.claimed == 1
    assert got["module"]["b"].data_ptr() == mine.data_ptr() + 400 * 4
    assert torch.equal(mine[:400], flat[:400]) and torch.equal(mine[700:], flat[700:])
    assert bool((mine[400:700] == -1).all()) and targets.skipped  # not read
    # One of the engine's parameters laid out otherwise in its buffer (the other as in the
    # file): not read into it.
    mine = torch.full((1000,), -1.0)
    targets, _ = _targets({("module", "a"): mine[:400].view(20, 20), ("module", "b"): mine[500:]})
    targets.skip[mine.untyped_storage().data_ptr()] = (0, 4000)
    got = load_reusing(io.BytesIO(f.getvalue()), size, "m.pt", [], targets)
    assert targets.claimed == 0 and not targets.skipped and bool((mine == -1).all())
    assert torch.equal(got["module"]["a"].flatten(), flat[:400])
    assert torch.equal(got["module"]["b"], flat[400:])


class _Evil:
    def __reduce__(self) -> tuple:
        return (print, ("pwned",))


@pytest.mark.parametrize("zipfile", [False, True], ids=["legacy", "zip"])
def test_what_torch_load_refuses_is_refused(zipfile: bool) -> None:
    f, size = _saved({"x": _Evil()}, zipfile)
    with pytest.raises(PipelineError, match="refused to unpickle"):
        load_reusing(f, size, "evil.pt", [], None)
    f, size = _saved(_state(), zipfile)
    cut = io.BytesIO(f.getvalue()[:size - 1000])
    with pytest.raises(PipelineError, match=r"cut\.pt"):
        load_reusing(cut, size - 1000, "cut.pt", [], None)


def test_a_legacy_file_whose_storage_list_is_not_a_list_is_refused() -> None:
    """The legacy format's last pickle lists the storages that follow; anything else is a clean
    error naming the file, not a TypeError."""
    import pickle

    buf = io.BytesIO()
    for part in (torch.serialization.MAGIC_NUMBER, torch.serialization.PROTOCOL_VERSION,
                 {"little_endian": True}, {"n": 5}, 7):
        pickle.dump(part, buf, protocol=2)
    with pytest.raises(PipelineError, match=r"odd\.pt: its list of storages is a int"):
        load_reusing(io.BytesIO(buf.getvalue()), len(buf.getvalue()), "odd.pt", [], None)


def _partition(root: Path, step: int) -> Path:
    """A checkpoint holding one DeepSpeed-named optimizer partition of 3 × 6 MB, written as the
    engine's files are (the zip format the rendered ds_config asks for; block checksums)."""
    from pipeline.checkpoint import fastio
    from pipeline.checkpoint import format as ck

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
    from pipeline.checkpoint import fastio
    from pipeline.checkpoint import read as cr
    from pipeline.io import read_json

    path = _partition(tmp_path, 1)
    rel = "ds/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    files = read_json(path / "manifest.json")["files"]
    assert cr.read_once(rel, files[rel], [0], 0)  # block checksums: read once, by its rank
    ref = torch.load(path / rel, weights_only=True)
    old = [torch.zeros(1_500_000) for _ in range(3)]  # the engine's moments and master
    paths = [("base_optimizer_state", "state", 0, "exp_avg"),
             ("base_optimizer_state", "state", 0, "exp_avg_sq"),
             ("single_partition_of_fp32_groups", 0)]
    out, why, refused = cr.verify_local(path, files, [rel], frozenset({rel}),
                                        _targets(dict(zip(paths, old, strict=True)))[0])
    assert (why, refused) == (None, False)
    got = out.ds_loader()(path / rel, map_location="cpu")
    moments = got["base_optimizer_state"]["state"][0]
    assert torch.equal(moments["exp_avg"], ref["base_optimizer_state"]["state"][0]["exp_avg"])
    mine = [moments["exp_avg"], moments["exp_avg_sq"], got["single_partition_of_fp32_groups"][0]]
    assert all(a is b for a, b in zip(mine, old, strict=True))  # the engine's own tensors
    out.release()
    # One flipped byte in the 3rd block: the verdict names it, nothing is handed to the
    # engine, and the engine's memory that was read into is zeroed again.
    data = bytearray((path / rel).read_bytes())
    data[(8 << 20) + 5] ^= 1
    (path / rel).write_bytes(bytes(data))
    old = [torch.ones(1_500_000) for _ in range(3)]
    targets = LoadTargets(dict(zip(paths, old, strict=True)), lambda: [t.fill_(7.0) for t in old])
    out, why, refused = cr.verify_local(path, files, [rel], frozenset({rel}), targets)
    block = fastio.BLOCK_BYTES
    assert why is not None and f"bytes {8 << 20}-{(8 << 20) + block} do not match" in why
    assert not refused
    assert not out.loaded and all(bool((t == 7.0).all()) for t in old)  # undone
    out.release()


_FRESH_ENGINE = r"""
import socket, sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pipeline.train.extensions import import_deepspeed

deepspeed = import_deepspeed()  # as the pipeline does: op loads safe from a stale lock

from pipeline.train.engines import DeepSpeedEngine

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.1}}}


def engine():
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 16)
    return deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]


def step(e):
    loss = e(torch.ones(1, 16)).square().sum()
    e.backward(loss)
    e.step()
    return torch.cat([p.detach().flatten() for p in e.module.parameters()])


used = engine()
inner = used.optimizer.optimizer
assert not inner.state  # DeepSpeed's base optimizer makes its state at its first step
targets = DeepSpeedEngine.load_targets(SimpleNamespace(engine=used, pp=1, tp=1))
keys = sorted(str(k[-1]) for k in targets.tensors if k[0] != "module")
assert keys == ["0", "exp_avg", "exp_avg_sq"] and targets.made and not targets.used, keys
# The module's weights too: views of DeepSpeed's one flat buffer, whose own partition (all of
# it, one rank) is left to the master partition.
module = sorted(k[1] for k in targets.tensors if k[0] == "module")
flat = used.optimizer.bit16_groups_flat[0]
assert module == ["bias", "weight"] and list(targets.skip.values()) == [(0, flat.nbytes)], module
assert sorted(inner.state[inner.param_groups[0]["params"][0]]) == ["exp_avg", "exp_avg_sq", "step"]
# A load abandoned before it read anything (another rank found damage): the uninitialized
# moments made for it are dropped, and the engine steps exactly as one that never resumed.
targets.restore()
assert not inner.state
assert torch.equal(step(used), step(engine()))
print("OK")
"""


def test_a_fresh_deepspeed_engine_makes_its_moments_for_a_load_and_drops_them_if_abandoned() -> None:
    """``DeepSpeedEngine.load_targets`` on a requeued job's engine (no optimizer state yet):
    the base optimizer's moments are made for the partition to be read into, and an abandoned
    load leaves no uninitialized state behind (real DeepSpeed, one gloo process)."""
    import subprocess

    from tests.conftest import PY, REPO, subprocess_env

    res = subprocess.run([str(PY), "-c", _FRESH_ENGINE], cwd=REPO,
                         env=subprocess_env(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1"),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-3000:]


def test_moments_made_for_a_load_are_dropped_unless_the_engine_took_them(tmp_path: Path) -> None:
    """``VerifiedFiles.release``: tensors the engine made for a load (``LoadTargets.made``:
    a fresh optimizer's uninitialized moments) are undone when the load did not take them, also
    where this rank read nothing (another rank found damage first), and left alone once the
    engine's load took the partition read into them."""
    from pipeline.checkpoint.read import VerifiedFiles

    for handed, expect_undone in ((False, True), (True, False)):
        targets, undone = _targets({("m",): torch.zeros(4)})
        targets.made = True
        out = VerifiedFiles(tmp_path, targets=targets, handed=handed)
        out.release()
        assert bool(undone) is expect_undone and targets.made is not expect_undone
