"""fastio: the O_DIRECT, checksumming writer behind every checkpoint file, and the manifest
that trusts its checksums (and still reads sha256 manifests of older checkpoints)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from pipeline.checkpoint import fastio
from pipeline.checkpoint import format as ck


@pytest.mark.parametrize("sizes", [[0], [1], [4095], [4096, 1], [3, fastio.BUFFER_BYTES + 5, 7],
                                   [fastio.BLOCK_BYTES], [fastio.BLOCK_BYTES - 1, 2]])
def test_writer_round_trip_is_byte_exact_with_the_right_checksum(tmp_path: Path,
                                                                  sizes: list[int]) -> None:
    rng = np.random.default_rng(sum(sizes))
    chunks = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    seen: list[tuple[Path, str, int]] = []
    path = tmp_path / "f.bin"
    with fastio.ChecksumWriter(path, on_close=lambda *a: seen.append(a)) as w:
        for c in chunks:
            assert w.write(c) == len(c)
        assert w.tell() == sum(sizes)
    data = b"".join(chunks)
    assert path.read_bytes() == data  # the padding of the last O_DIRECT block is cut off
    # The block checksums, computed here independently: one xxh3-64 per BLOCK_BYTES.
    blocks = [xxhash.xxh3_64_hexdigest(data[i:i + fastio.BLOCK_BYTES])
              for i in range(0, len(data), fastio.BLOCK_BYTES)]
    assert seen == [(path, fastio.digest_file(path), len(data), blocks)]
    assert fastio.digest_file_blocks(path) == (fastio.digest_file(path), blocks)
    entry = fastio.manifest_entry(*seen[0][1:])
    assert ("blocks" in entry) == (len(data) > fastio.BLOCK_BYTES)


def test_writer_falls_back_when_the_filesystem_refuses_o_direct(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: str, flags: int, *a: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with fastio.ChecksumWriter(tmp_path / "f.bin") as w:
        w.write(b"abc" * 5000)
    assert not w.direct
    assert (tmp_path / "f.bin").read_bytes() == b"abc" * 5000


@pytest.mark.parametrize("zipfile", [True, False])
def test_torch_save_through_the_writer_loads_with_weights_only(tmp_path: Path,
                                                                zipfile: bool) -> None:
    # DeepSpeed saves with the legacy (non-zip) format by default: both must round-trip.
    state = {"w": torch.randn(1000, 37), "step": 3, "nested": {"b": torch.arange(10)}}
    digests = fastio.Digests()
    with fastio.no_torch_crc32():
        fastio.torch_save(state, tmp_path / "s.pt", digests,
                          _use_new_zipfile_serialization=zipfile)
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3
    assert torch.equal(back["nested"]["b"], state["nested"]["b"])
    entry = digests.relative_to(tmp_path)["s.pt"]
    assert entry == {fastio.DIGEST: fastio.digest_file(tmp_path / "s.pt"),
                     "bytes": (tmp_path / "s.pt").stat().st_size}


def _tmp_checkpoint(root: Path, step: int) -> Path:
    tmp = ck.tmp_dir(root, step)
    (tmp / "dcp").mkdir(parents=True)
    (tmp / "dcp" / "a.distcp").write_bytes(os.urandom(10000))
    (tmp / "trainer.json").write_text("{}")
    return tmp


def test_manifest_uses_write_time_checksums_and_verify_reads_the_disk(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    tmp = _tmp_checkpoint(root, 5)
    real = fastio.digest_file(tmp / "dcp" / "a.distcp")
    # A checksum from the writer is trusted as is (a wrong one shows at verify, from disk).
    known = {"dcp/a.distcp": {fastio.DIGEST: "0" * 32, "bytes": 10000}}
    final = ck.finalize(root, 5, {"backend": "fsdp"}, keep_last=2, known=known)
    files = json.loads((final / ck.MANIFEST).read_text())["files"]
    assert files["dcp/a.distcp"][fastio.DIGEST] == "0" * 32
    assert files["trainer.json"][fastio.DIGEST] == fastio.digest_file(final / "trainer.json")
    assert "a.distcp does not match its checksum" in ck.verify(final)
    # With the right checksum it verifies; one flipped byte on disk is caught.
    tmp = _tmp_checkpoint(root, 6)
    (tmp / "dcp" / "a.distcp").write_bytes((final / "dcp" / "a.distcp").read_bytes())
    final = ck.finalize(root, 6, {"backend": "fsdp"}, keep_last=2,
                        known={"dcp/a.distcp": {fastio.DIGEST: real, "bytes": 10000}})
    assert ck.verify(final) is None
    blob = bytearray((final / "dcp" / "a.distcp").read_bytes())
    blob[1234] ^= 1
    (final / "dcp" / "a.distcp").write_bytes(bytes(blob))
    assert "does not match" in ck.verify(final)


def test_a_sha256_manifest_of_an_older_checkpoint_still_verifies(tmp_path: Path) -> None:
    path = tmp_path / "step-000001"
    path.mkdir()
    (path / "x.bin").write_bytes(b"hello")
    files = {"x.bin": {"sha256": hashlib.sha256(b"hello").hexdigest(), "bytes": 5}}
    (path / ck.MANIFEST).write_text(json.dumps({"step": 1, "files": files}))
    assert ck.verify(path) is None
    (path / "x.bin").write_bytes(b"hellp")
    assert ck.verify(path) == "x.bin does not match its checksum"


# --- the manifest is the trust anchor: it accounts for every file, paths stay inside ---------


def _final(root: Path, step: int = 7) -> Path:
    _tmp_checkpoint(root, step)
    return ck.finalize(root, step, {"backend": "fsdp"}, keep_last=5)


def _edit(path: Path, fn) -> None:
    meta = json.loads((path / ck.MANIFEST).read_text())
    fn(meta)
    (path / ck.MANIFEST).write_text(json.dumps(meta))


def test_verify_refuses_files_the_manifest_does_not_account_for(tmp_path: Path) -> None:
    final = _final(tmp_path / "checkpoints")
    assert ck.verify(final) is None
    (final / "dcp" / "extra.bin").write_bytes(b"planted")
    assert ck.verify(final).startswith("dcp/extra.bin is not listed in manifest.json")
    (final / "dcp" / "extra.bin").unlink()
    _edit(final, lambda m: m.update(files={}))  # nothing listed: nothing vouched for
    assert "lists no files" in ck.verify(final)
    _edit(final, lambda m: m.pop("files"))
    assert ck.verify(final) == "manifest.json has no 'files' key"
    (final / ck.MANIFEST).write_text("[1, 2]")
    assert ck.verify(final) == "manifest.json is not a JSON object"


@pytest.mark.parametrize("rel", ["../outside.bin", "/etc/hostname", "dcp/../../outside.bin",
                                 "./trainer.json", "dcp//a.distcp", ""])
def test_verify_refuses_manifest_paths_that_are_not_plain_paths_inside(tmp_path: Path,
                                                                         rel: str) -> None:
    final = _final(tmp_path / "checkpoints")
    (final.parent / "outside.bin").write_bytes(b"x")
    entry = {fastio.DIGEST: fastio.digest_file(final.parent / "outside.bin"), "bytes": 1}
    _edit(final, lambda m: m["files"].update({rel: entry}))
    assert f"the path {rel!r}" in ck.verify(final)


def test_verify_refuses_symbolic_links_and_bad_entries(tmp_path: Path) -> None:
    final = _final(tmp_path / "checkpoints")
    f = final / "dcp" / "a.distcp"
    copy = tmp_path / "a.copy"
    copy.write_bytes(f.read_bytes())
    f.unlink()
    f.symlink_to(copy)  # same bytes, same size and checksum: still refused
    assert ck.verify(final) == "dcp/a.distcp is a symbolic link (a checkpoint holds only plain files)"
    f.unlink()
    copy.rename(f)
    assert ck.verify(final) is None
    _edit(final, lambda m: m["files"]["trainer.json"].pop("bytes"))
    assert ck.verify(final) == "manifest.json: the entry of trainer.json has no valid 'bytes'"
    link = tmp_path / "checkpoints" / "step-000009"
    link.symlink_to(final, target_is_directory=True)
    assert "symbolic link" in ck.verify(link)


def test_dcp_metadata_is_unpickled_only_through_the_allow_list(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from pipeline.checkpoint.tensors import DCPSource, dcp_load, read_dcp_metadata
    from pipeline.errors import PipelineError

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)},
             "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert set(read_dcp_metadata(tmp_path / "dcp").state_dict_metadata) >= {"model.w"}
    src = DCPSource(tmp_path / "dcp")
    assert torch.equal(dict(src.read(["w"]))["w"], state["model"]["w"])
    back = {"model": {"w": torch.zeros(2, 3)},
            "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": [0]}]}}
    dcp_load(back, tmp_path / "dcp", no_dist=True)  # non-tensor entries: weights_only=True
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)

    # The storage index may name only files of the folder (not ../ or absolute paths).
    meta = read_dcp_metadata(tmp_path / "dcp")
    good = (tmp_path / "dcp" / ".metadata").read_bytes()
    for bad in ("../outside.distcp", "/etc/hostname"):
        for info in meta.storage_data.values():
            info.relative_path = bad
        (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(meta))
        with pytest.raises(PipelineError, match="storage index names"):
            DCPSource(tmp_path / "dcp")
    (tmp_path / "dcp" / ".metadata").write_bytes(good)
    assert DCPSource(tmp_path / "dcp").tensors["w"].shape == (2, 3)

    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(PipelineError, match=r"\.metadata: refused to unpickle.*allow-list"):
        DCPSource(tmp_path / "dcp")
    with pytest.raises(PipelineError, match=r"\.metadata"):
        dcp_load(back, tmp_path / "dcp", no_dist=True)
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(PipelineError, match="unreadable DCP metadata"):
        read_dcp_metadata(tmp_path / "dcp")
    assert not marker.exists()
