"""Training data loader: memory-mapped shards, checksums, the resumable global stream."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.data.loader import BatchLoader, PackedDataset, validation_batches
from pipeline.errors import PipelineError
from pipeline.text.tokenizer import train_tokenizer
from pipeline.tokenize import SourceSpec, gather, shard_path, tokenize_shard

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SEQ = 160


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    texts = [p.read_text("utf-8") for p in sorted(STDLIB.glob("json/*.py"))]
    tok = train_tokenizer(texts, 512, root / "tokenizer")
    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py"), str(STDLIB / "email" / "*.py")])
    for i in range(3):
        tokenize_shard(
            spec, tok, seq_len=SEQ, shards=3, shard=i, out=root, val_fraction=0.1, progress=False
        )
    gather(root, 3, tok)
    return root


def test_dataset_reads_every_row_like_datasets_does(data_dir: Path) -> None:
    import datasets

    ds = PackedDataset(data_dir)
    m = ds.manifest
    assert len(ds) == m["splits"]["train"]["sequences"] > 1000
    rows = []
    for e in m["splits"]["train"]["shards"]:
        hf = datasets.Dataset.from_file(str(data_dir / e["path"])).with_format("numpy")
        rows.append(hf["input_ids"])
    want = np.concatenate(rows)
    got = np.stack([ds[i] for i in range(len(ds))])
    assert got.dtype == np.int32 and got.shape == (len(ds), SEQ)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ds.get_rows([5, len(ds) - 1, 0]), want[[5, len(ds) - 1, 0]])
    with pytest.raises(IndexError):
        ds[len(ds)]


def _stream(loaders: list[BatchLoader], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    idx, ids = [], []
    for _ in range(steps):
        for ld in loaders:  # rank order = global order
            b = ld.next_batch()
            assert b["input_ids"].dtype == torch.long and b["input_ids"].shape == (
                ld.micro_batch_size,
                SEQ,
            )
            idx += b["indices"]
            ids.append(b["input_ids"])
    return idx, ids


def test_resume_dp2_to_dp1_gives_the_uninterrupted_stream(data_dir: Path) -> None:
    ds = PackedDataset(data_dir)
    ref = BatchLoader(ds, micro_batch_size=4, dp_rank=0, dp_size=1, seed=7)
    ref_idx, ref_ids = _stream([ref], 1000)
    assert len(ref_idx) == 4000 > len(ds)  # crosses an epoch boundary

    # First half at DP 2 (micro 2 per rank = the same global micro batch of 4) ...
    ranks = [BatchLoader(ds, micro_batch_size=2, dp_rank=r, dp_size=2, seed=7) for r in range(2)]
    idx_a, ids_a = _stream(ranks, 500)
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    state = json.loads(json.dumps(state))  # as it would be stored in a checkpoint
    # ... then a fresh process at DP 1.
    resumed = BatchLoader(PackedDataset(data_dir), micro_batch_size=4, dp_rank=0, dp_size=1, seed=7)
    resumed.load_state_dict(state)
    idx_b, ids_b = _stream([resumed], 500)

    assert idx_a + idx_b == ref_idx
    assert torch.equal(torch.cat(ids_a + ids_b), torch.cat(ref_ids))
    # Each epoch is a permutation: nothing repeated or skipped inside it.
    n = len(ds)
    assert sorted(ref_idx[:n]) == list(range(n))
    assert ref_idx[:n] != ref_idx[n : 2 * n]  # reshuffled per epoch


def test_seed_changes_the_order_and_state_is_checked(data_dir: Path) -> None:
    ds = PackedDataset(data_dir)
    a = BatchLoader(ds, micro_batch_size=8, dp_rank=0, dp_size=1, seed=1)
    b = BatchLoader(ds, micro_batch_size=8, dp_rank=0, dp_size=1, seed=2)
    assert a.next_batch()["indices"] != b.next_batch()["indices"]
    with pytest.raises(PipelineError, match="seed 1"):
        b.load_state_dict(a.state_dict())
    other = BatchLoader(
        PackedDataset(data_dir, "validation"), micro_batch_size=2, dp_rank=0, dp_size=1, seed=1
    )
    with pytest.raises(PipelineError, match="other data"):
        other.load_state_dict(a.state_dict())


def test_validation_batches_cover_the_split_once_in_order(data_dir: Path) -> None:
    val = PackedDataset(data_dir, "validation")
    assert len(val) > 5
    batches = list(validation_batches(val, 4))
    assert [i for b in batches for i in b["indices"]] == list(range(len(val)))
    assert torch.equal(
        torch.cat([b["input_ids"] for b in batches]),
        torch.from_numpy(val.get_rows(range(len(val)))).long(),
    )
    r0 = list(validation_batches(val, 4, dp_rank=0, dp_size=2))
    r1 = list(validation_batches(val, 4, dp_rank=1, dp_size=2))
    assert sorted(i for b in r0 + r1 for i in b["indices"]) == list(range(len(val)))


def _copy(data_dir: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(data_dir, dst)
    return dst


def test_tampered_shard_is_a_clear_error(data_dir: Path, tmp_path: Path) -> None:
    d = _copy(data_dir, tmp_path / "d")
    p = shard_path(d, "train", 1)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    p.write_bytes(bytes(data))
    ds = PackedDataset(d)
    first = ds.manifest["splits"]["train"]["shards"][0]["sequences"]
    assert ds[0] is not None  # shard 0 is intact and opens
    with pytest.raises(
        PipelineError, match=r"shard .*train/shard-00001\.arrow does not match its sha256"
    ):
        ds[first]
    # verify=False opens it (for forensics); the bytes differ from the original.
    assert PackedDataset(d, verify=False)[first] is not None


def test_truncated_shard_is_a_clear_error(data_dir: Path, tmp_path: Path) -> None:
    d = _copy(data_dir, tmp_path / "d")
    p = shard_path(d, "train", 2)
    p.write_bytes(p.read_bytes()[:-1000])
    ds = PackedDataset(d, verify=False)  # even without hashing, the size check catches it
    with pytest.raises(
        PipelineError, match=r"train/shard-00002\.arrow has \d+ bytes, the manifest says"
    ):
        ds.open_all()


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match=r"manifest\.json does not exist"):
        PackedDataset(tmp_path)


def test_manifest_shard_paths_stay_inside_the_data_dir(data_dir: Path, tmp_path: Path) -> None:
    import json

    d = _copy(data_dir, tmp_path / "d")
    outside = tmp_path / "elsewhere.arrow"
    outside.write_bytes(shard_path(d, "train", 0).read_bytes())  # a real shard, but not this folder's
    m = json.loads((d / "manifest.json").read_text())
    m["splits"]["train"]["shards"][0]["path"] = "../elsewhere.arrow"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PipelineError, match=r"manifest\.json: path '\.\./elsewhere\.arrow'.*leaves"):
        PackedDataset(d)


def test_manifest_missing_a_key_names_it(data_dir: Path, tmp_path: Path) -> None:
    import json

    d = _copy(data_dir, tmp_path / "d")
    m = json.loads((d / "manifest.json").read_text())
    del m["splits"]["train"]["shards"][1]["sequences"]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PipelineError, match=r"'splits\.train\.shards\[1\]\.sequences'.*gather"):
        PackedDataset(d)


@pytest.mark.parametrize("joined", [True, False])
@pytest.mark.parametrize("mixture", [None, {"source0": 1.0}])
def test_planned_batches_equal_the_stream_step_by_step(data_dir: Path, mixture, joined) -> None:
    """next_batch plans PLAN_STEPS steps at once and gathers from every shard joined in one
    mapping (or row by row): its indices and rows are still exactly the stream's
    (next_indices; get_rows through pyarrow's own views), across plan and epoch boundaries, for
    a rank other than 0, and after the cursor is moved (a restored state) in a plan."""
    from pipeline.data.loader import PLAN_STEPS

    ds = PackedDataset(data_dir)
    kw = {"micro_batch_size": 3, "dp_rank": 1, "dp_size": 2, "seed": 5, "mixture": mixture}
    planned, plain = BatchLoader(ds, **kw, joined=joined), BatchLoader(ds, **kw)
    if joined:  # this machine (Linux x86-64/aarch64) joins the three shards
        _windows, offsets = ds.row_windows()
        assert len(ds.entries) == 3 and len(offsets) == len(ds)
    steps = 5 * PLAN_STEPS - 3
    assert steps * 6 > len(ds)  # crosses an epoch
    for step in range(steps):
        if step == PLAN_STEPS + 5:  # jump back mid-plan, as load_state_dict does
            planned.cursor = plain.cursor = 6 * 11
        batch = planned.next_batch()
        idx = plain.next_indices()
        assert batch["indices"] == idx.tolist(), step
        assert batch["input_ids"].dtype == torch.int64
        assert torch.equal(batch["input_ids"], torch.from_numpy(ds.get_rows(idx, np.int64)))
    assert planned.state_dict() == plain.state_dict()
    assert (planned._plan_off is not None) == joined
