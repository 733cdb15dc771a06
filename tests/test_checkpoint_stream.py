"""pipeline.checkpoint.stream: the resume's checksum pass and the engine's re-hashing read
through reused O_DIRECT windows (small windows here, so that a few hundred KB span many)."""

from __future__ import annotations

import io
import os
import platform
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from pipeline.checkpoint import stream as cs
from pipeline.errors import PipelineError


@pytest.fixture(autouse=True)
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cs, "CHUNK_BYTES", 16384)
    monkeypatch.setattr(cs, "WINDOW_BYTES", 4 * 16384)


def _file(tmp_path: Path, size: int, seed: int = 0) -> tuple[Path, bytes]:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / f"f{size}.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "o-direct"])
@pytest.mark.parametrize("size", [1, 4095, 4096, 65536, 65536 * 3 + 123])
def test_digest_reads_the_whole_file_exactly(tmp_path: Path, size: int, direct: bool) -> None:
    path, data = _file(tmp_path, size)
    windows = cs.Windows()
    try:
        assert (cs.digest_file_windowed(path, size, windows, direct=direct)
                == xxhash.xxh3_128(data).hexdigest())
        with pytest.raises(OSError, match="manifest says"):
            cs.digest_file_windowed(path, size + 1, windows, direct=direct)
    finally:
        windows.close()


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "o-direct"])
def test_stream_serves_any_read_order_and_rechecks_a_front_to_back_read(tmp_path: Path,
                                                                         direct: bool) -> None:
    size = 65536 * 3 + 123
    path, data = _file(tmp_path, size)
    digest = xxhash.xxh3_128(data).hexdigest()
    windows = cs.Windows()
    rng = np.random.default_rng(1)
    try:
        with cs.WindowStream(path, size, digest, windows, direct=direct) as f:
            for _ in range(50):  # random seeks: the bytes, wherever the window was
                off, n = int(rng.integers(0, size)), int(rng.integers(1, 100_000))
                f.seek(off)
                assert f.read(n) == data[off:off + n]
            f.seek(0)
            assert f.read(10) == data[:10]
            f.seek(-7, io.SEEK_END)
            assert f.read() == data[-7:]
        with cs.WindowStream(path, size, digest, windows, direct=direct) as f:
            got = bytearray()
            while chunk := f.read(5000):
                got += chunk
            assert bytes(got) == data
        assert f.rechecked
    finally:
        windows.close()


def test_a_file_changed_after_verification_fails_when_read(tmp_path: Path) -> None:
    size = 65536 * 2 + 5
    path, data = _file(tmp_path, size)
    digest = xxhash.xxh3_128(data).hexdigest()
    changed = bytearray(data)
    changed[size - 3] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(changed))
    windows = cs.Windows()
    try:
        f = cs.WindowStream(path, size, digest, windows, direct=False)
        f.read()
        with pytest.raises(PipelineError, match=f"{path.name} changed after it was verified"):
            f.close()
        assert f.closed
    finally:
        windows.close()


def test_torch_load_through_the_stream_is_rechecked(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 200), "step": 3, "b": torch.arange(5000)}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    data = path.read_bytes()
    windows = cs.Windows()
    try:
        with cs.WindowStream(path, len(data), xxhash.xxh3_128(data).hexdigest(), windows) as f:
            got = torch.load(f, weights_only=True)
        assert f.rechecked  # the zip's directory first, then front to back: still rechecked
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    finally:
        windows.close()


def _blocks(data: bytes, size: int) -> tuple[int, list[str]]:
    return size, [xxhash.xxh3_64_hexdigest(data[i:i + size]) for i in range(0, len(data), size)]


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "o-direct"])
def test_block_checked_stream_serves_verified_bytes_and_stops_at_a_damaged_block(
        tmp_path: Path, direct: bool) -> None:
    size, block = 65536 * 3 + 123, 16384
    path, data = _file(tmp_path, size)
    blocks = _blocks(data, block)
    windows = cs.Windows()
    rng = np.random.default_rng(2)
    try:
        with cs.WindowStream(path, size, None, windows, direct=direct, blocks=blocks) as f:
            for _ in range(50):  # any read order: every refill is whole, checked blocks
                off, n = int(rng.integers(0, size)), int(rng.integers(1, 100_000))
                f.seek(off)
                assert f.read(n) == data[off:off + n]
            assert f.damage is None
        bad = bytearray(data)
        bad[5 * block + 7] ^= 0x40  # one bit of block 5
        path.write_bytes(bytes(bad))
        with cs.WindowStream(path, size, None, windows, direct=direct, blocks=blocks) as f:
            assert f.read(5 * block) == data[:5 * block]  # the blocks before it still serve
            with pytest.raises(cs.CheckpointDamaged,
                               match=f"bytes {5 * block}-{6 * block} do not match"):
                f.read(10)
            assert isinstance(f.damage, cs.CheckpointDamaged)
            f.seek(0)  # a window that failed its check serves nothing afterwards
            with pytest.raises(cs.CheckpointDamaged):
                f.read(size)
        path.write_bytes(data[:4 * block])  # cut short
        with (cs.WindowStream(path, size, None, windows, direct=direct, blocks=blocks) as f,
              pytest.raises(cs.CheckpointDamaged, match="shorter than the manifest")):
            f.read(size)
    finally:
        windows.close()


def _recording_windows() -> tuple[cs.Windows, list[int]]:
    """Windows whose fills record their lengths (in the returned list)."""
    windows = cs.Windows()
    fills: list[int] = []
    real = windows.fill
    windows.fill = lambda fd, view, off: fills.append(len(view)) or real(fd, view, off)
    return windows, fills


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "o-direct"])
def test_blocks_larger_than_a_window_are_read_in_windows_of_whole_blocks(
        tmp_path: Path, direct: bool) -> None:
    # A checkpoint written with larger blocks (4 MiB, before 1 MiB) than today's windows: still
    # one pass, each block checked whole before any byte of it serves.
    block = 2 * cs.WINDOW_BYTES
    size = 3 * block + 123
    path, data = _file(tmp_path, size)
    windows, fills = _recording_windows()
    try:
        with cs.WindowStream(path, size, None, windows, direct=direct,
                             blocks=_blocks(data, block)) as f:
            assert b"".join(iter(lambda: f.read(10_000), b"")) == data
        assert fills and all(n % block == 0 for n in fills), fills
        bad = bytearray(data)
        bad[block + 1] ^= 0x01
        path.write_bytes(bytes(bad))
        with cs.WindowStream(path, size, None, windows, direct=direct,
                             blocks=_blocks(data, block)) as f:
            assert f.read(block) == data[:block]
            with pytest.raises(cs.CheckpointDamaged, match=f"bytes {block}-{2 * block} do not"):
                f.read(1)
    finally:
        windows.close()


def test_a_read_far_ahead_keeps_the_main_runs_read_ahead(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A large zip item's directory is read (at its end) before the item: the front-to-back
    # run keeps growing its read-ahead instead of starting again from the minimum.
    monkeypatch.setattr(cs.WindowStream, "MIN_AHEAD", 4096)
    size, block = 65536 * 8, 4096
    path, data = _file(tmp_path, size)
    windows, fills = _recording_windows()
    try:
        with cs.WindowStream(path, size, None, windows, blocks=_blocks(data, block)) as f:
            got = bytearray()
            for i in range(0, size, 65536):
                f.seek(min(size - 10, i + 65536 * 3))  # peek far ahead
                assert f.read(10) == data[min(size - 10, i + 65536 * 3):][:10]
                f.seek(i)
                got += f.read(65536)
            assert bytes(got) == data
    finally:
        windows.close()
    # The peeks cost one block each; the main run streams in whole windows.
    assert len(fills) <= 16 and sum(f == cs.WINDOW_BYTES for f in fills) >= 7, fills


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc")
def test_prefault_makes_new_memory_present_and_leaves_its_bytes_alone() -> None:
    """``prefault`` (run while a load writes into the same memory) must not change a byte: the
    bytes written before it and the pages it makes present (zero) are what they were."""
    from pipeline.checkpoint.stream import prefault

    big = torch.UntypedStorage(96 << 20)  # untouched: its pages are not present yet
    written = torch.tensor([], dtype=torch.uint8).set_(big)
    written[:4096] = 7  # the first page, as a reader that began first
    before = _resident_bytes()
    thread = prefault([big, torch.UntypedStorage(100)])  # a small one is skipped
    assert thread is not None
    thread.join()
    grew = _resident_bytes() - before
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    if m is None or (int(m[1]), int(m[2])) < (5, 14):
        pytest.skip(f"MADV_POPULATE_WRITE is Linux 5.14+, this is {platform.release()}")
    assert grew >= (64 << 20), grew  # the pages are present (the 96 MiB, less what shares)
    assert bool((written[:4096] == 7).all()) and int(written[4096:].sum()) == 0
    assert prefault([]) is None
