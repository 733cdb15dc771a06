"""Checkpoint reading through a few reused buffers: the checksum pass of a resume
(:func:`digest_file_windowed`) and the engine's read (:class:`WindowStream`).

A large file whose manifest entry lists block checksums is read once: :class:`WindowStream`
checks each block of a window as it is filled, before any byte of it is served, and raises
:class:`CheckpointDamaged` at one that differs. Without block checksums (checkpoints written
before them) the file is hashed whole first (no engine reads anything before every rank's files
matched), then read again through a :class:`WindowStream` that hashes what it serves when it
reads the file front to back: a file changed between the two reads is an error, not silently
loaded. Both read with O_DIRECT (``direct=True``) or through the page cache (``direct=False``);
``pipeline.checkpoint.read.THROUGH_PAGE_CACHE`` chooses, with the measurements. A stream read
front to back has its next window read in the background while the engine uses the current one.

Why reused buffers rather than the file held in fresh memory between the two passes (as the
first version of this did): the first write to a fresh page costs a page fault, and where the
guest's free memory is handed back to the hypervisor (free page reporting, ballooning: microVMs
and many cloud VMs; the development machine is a Firecracker VM with ``page_reporting``) each
such fault is a host fault, serialised across the processes of the node. Measured there (800 MB
files, ``O_DIRECT``, 16 MB requests, 4 in flight): one process reading into fresh memory
1.3-2.0 GB/s; two processes at once (the two ranks of a resume) 355-412 MB/s each; the same two
into four reused 16 MB buffers 1.56-1.58 GB/s each.
"""

from __future__ import annotations

import errno
import hashlib
import io
import mmap
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from pipeline.checkpoint.fastio import ALIGN
from pipeline.errors import PipelineError

#: One read request, and the requests in flight at once (queue depth helps virtual and NVMe
#: disks alike): a window of :data:`WINDOW_BYTES` is read as :data:`QUEUE_DEPTH` requests.
CHUNK_BYTES = 512 << 10
QUEUE_DEPTH = 4
#: A window: 2 MiB, so that a rank's buffers (two windows served from, one read ahead) stay a
#: few MiB. Small windows read faster on the development VM, a Firecracker guest: two
#: processes reading 800 MB files at once with O_DIRECT, alternating in one run, 1.83-1.98
#: GB/s together with 2 MiB windows (4 x 512 KiB) against 1.47-1.48 with 16 MiB (4 x 4 MiB)
#: and 1.42-1.60 with 4 MiB ones; two ``dd bs=4M`` 1.73-1.85. In ``python -m bench.checkpoint``
#: (134 M model, 2 ranks; 3 runs alternating, 9 loads each) a requeued job's load took a median
#: 1.16 s against 1.29 s with 16 MiB windows for fsdp, 1.70 s against 1.85 s for deepspeed.
#: (Earlier, 16 MiB requests had measured worse than 4 MiB ones.) A file whose block checksums
#: are larger (checkpoints written before 1 MiB blocks) gets windows of a whole number of its
#: blocks (:class:`WindowStream`). Tuned on that VM's virtio disk only: a parallel filesystem
#: (Lustre, GPFS) may want larger requests and more of them in flight; measure there
#: (``python -m bench.checkpoint --workdir <its path>``) before changing these.
WINDOW_BYTES = CHUNK_BYTES * QUEUE_DEPTH
#: The largest block checksum a reader checks (a window holds whole blocks): a manifest that
#: names larger blocks is verified by hashing the whole file instead.
MAX_BLOCK_BYTES = 64 << 20


#: ``madvise`` advice (Linux 5.14+, ``linux/mman.h``): make the pages of a range present and
#: writable as a write would, without writing (their contents stay as they are).
MADV_POPULATE_WRITE = 23
#: The range of one such advice (:func:`prefault`): a multiple of the page size.
PREFAULT_BYTES = 4 << 20


def prefault(storages: list[Any]) -> threading.Thread | None:
    """Fault in the pages of ``storages`` (``torch.UntypedStorage``: memory just allocated that
    a load is about to fill), in order, in a background thread; None if there is nothing to do.

    Why: the first write to each page of new memory is a page fault; taken by the copy that
    fills it, it stalls the read behind it. ``MADV_POPULATE_WRITE`` takes those faults ahead of
    the reader, overlapping the disk reads, and leaves the contents alone, so the reader may
    write into a storage while the thread still works on it. Measured on the development VM
    (a requeued job's FSDP load of a 134 M model, 2 ranks): the copy into the optimizer's new
    moments ran at ~1.1 GB/s, into memory already present at ~3.5 GB/s. Where the advice is
    unknown (an older kernel: EINVAL; not Linux) the thread stops at once: an optimisation only.

    One advice per :data:`PREFAULT_BYTES`, not one per storage: the advice holds the process's
    memory-map lock while it faults its whole range, and every ``mmap``/``munmap`` of the
    loading threads (the allocator's large blocks) waits for it, and the page faults queued
    behind that writer with them. Measured on the development VM (DeepSpeed, each load in a new
    process, 2 ranks, 536 MB of moments per rank made at the load's start): 4 loads in 4 MiB
    pieces at 0.60-0.81x ``dd``, in one piece per storage 0.43-0.56x (two runs).
    """
    page = mmap.PAGESIZE
    regions = [(s.data_ptr(), s.nbytes()) for s in storages if s.nbytes() >= 2 * page]
    if not regions or not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def run(keep: list[Any]) -> None:  # ``keep``: the storages stay alive while it runs
        for address, nbytes in regions:
            start = -(-address // page) * page  # whole pages only: the ends may be shared
            end = (address + nbytes) // page * page
            while start < end:
                step = min(end - start, PREFAULT_BYTES)
                if (madvise(start, step, MADV_POPULATE_WRITE) != 0
                        and ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS)):
                    return  # the kernel does not know the advice
                start += step

    thread = threading.Thread(target=run, args=(list(storages),), name="ckpt-prefault",
                              daemon=True)
    thread.start()
    return thread


def open_read(path: Path, direct: bool) -> tuple[int, bool]:
    """A read-only descriptor that follows no symbolic link; O_DIRECT where asked and allowed
    (tmpfs and some network filesystems refuse it: then an ordinary one)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
    return os.open(path, flags), False


class Windows:
    """Reused page-aligned buffers of :data:`WINDOW_BYTES` or more (anonymous mmaps, as O_DIRECT
    needs) and the threads that fill them. One per rank and resume; :meth:`close` when done."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead_pool: ThreadPoolExecutor | None = None

    def take(self, nbytes: int | None = None) -> mmap.mmap:
        """A free buffer of at least ``nbytes`` (a multiple of the page size; a window by
        default), or a new one."""
        nbytes = nbytes or WINDOW_BYTES
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= nbytes:
                    return self._free.pop(i)
        return mmap.mmap(-1, nbytes)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)

    def fill(self, fd: int, view: memoryview, offset: int) -> int:
        """Read the file at ``offset`` (aligned) into ``view`` in :data:`CHUNK_BYTES` requests,
        all in flight at once; the bytes read (fewer at the end of the file)."""
        assert offset % ALIGN == 0 and len(view) % ALIGN == 0
        step = min(CHUNK_BYTES, len(view))

        def chunk(start: int) -> int:
            end = min(start + step, len(view))
            got = 0
            while start + got < end:
                n = os.preadv(fd, [view[start + got:end]], offset + start + got)
                if n == 0:
                    break
                got += n
            return got

        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(QUEUE_DEPTH, thread_name_prefix="ckpt-read")
            pool = self._pool
        starts = range(0, len(view), step)
        got = list(pool.map(chunk, starts) if len(starts) > 1 else map(chunk, starts))
        # A short chunk is the end of the file: nothing after it counts.
        total = 0
        for g in got:
            total += g
            if g < step:
                break
        return total

    def fill_later(self, fd: int, view: memoryview, offset: int) -> Future[int]:
        """:meth:`fill` in a background thread (one at a time: a stream's next window)."""
        with self._lock:
            if self._ahead_pool is None:
                self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-ahead")
            pool = self._ahead_pool
        return pool.submit(self.fill, fd, view, offset)

    def close(self) -> None:
        with self._lock:
            if self._ahead_pool is not None:
                self._ahead_pool.shutdown()
                self._ahead_pool = None
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
            for buf in self._free:
                buf.close()
            self._free.clear()


def digest_file_windowed(path: Path, size: int, windows: Windows, *, direct: bool = True,
                       algorithm: str = "xxh3_128") -> str:
    """Hex digest (xxh3-128, or sha256 for manifests older than xxh3) of ``path`` read with
    O_DIRECT through one reused window. ``OSError`` if the file is not exactly ``size`` bytes
    long."""
    h: Any = xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.new(algorithm)
    fd, _ = open_read(path, direct)
    buf = windows.take()
    try:
        view = memoryview(buf)
        off = 0
        while off < size:
            n = windows.fill(fd, view, off)
            if n == 0:
                break
            h.update(view[:min(n, size - off)])
            off += n
            if n < len(view):
                break
        view.release()
        if off != size or os.fstat(fd).st_size != size:
            raise OSError(errno.EIO, f"read {off} bytes, the manifest says {size}")
    finally:
        windows.give(buf)
        os.close(fd)
    return h.hexdigest()


class SeekableReader(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes whose subclass supplies ``readinto`` from
    position ``_pos``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int = -1) -> bytes:
        n = self.size - self._pos if size is None or size < 0 else size
        buf = bytearray(max(0, min(n, self.size - self._pos)))
        got = self.readinto(buf)
        return bytes(buf[:got])

    def readall(self) -> bytes:
        return self.read(-1)


class CheckpointDamaged(PipelineError):
    """A block of a checkpoint file did not match the manifest's block checksum when read for
    the engine (nothing of it reached the engine). The manager then loads the next older
    checkpoint over whatever the engine had loaded before the damage showed."""


class WindowStream(SeekableReader):
    """A seekable, read-only file over ``path`` for an engine's reader, served from two reused
    windows refilled with O_DIRECT reads (:meth:`Windows.fill`): two, because ``torch.load``
    reads a zip's directory at its end before its records, and a record that straddles a window
    boundary would otherwise cost two refills. The windows' bytes are hashed whenever they
    continue the front-to-back run hashed so far; if that run covers the file by :meth:`close`
    (reading what is left, up to one window), its xxh3-128 must equal ``digest`` (the
    manifest's, which the file matched moments before): otherwise
    :class:`~pipeline.errors.PipelineError`.

    With ``blocks`` (the manifest's block size and block checksums,
    :func:`pipeline.checkpoint.format.block_digests`) the file was *not* read before: every refill
    covers whole blocks and each is checked before any byte of it is served, so the engine only
    ever sees verified bytes, read once from the disk; a block that does not match raises
    :class:`CheckpointDamaged`."""

    SLOTS = 2
    #: The first read-ahead after a jump; it grows fourfold with each refill that continues
    #: the last one, up to a window (a file read front to back streams; a few small items
    #: read from another rank's file cost little).
    MIN_AHEAD = 1 << 20

    def __init__(self, path: Path, size: int, digest: str | None, windows: Windows,
                 *, direct: bool = True, blocks: tuple[int, list[str]] | None = None) -> None:
        super().__init__(size)
        assert blocks is None or (0 < blocks[0] <= MAX_BLOCK_BYTES and blocks[0] % ALIGN == 0)
        self.path = Path(path)
        self._blocks = blocks
        self._digest = None if blocks is not None else digest
        self._align = ALIGN if blocks is None else blocks[0]
        # A window holds whole blocks: WINDOW_BYTES, or the smallest multiple of larger blocks.
        self._window = -(-WINDOW_BYTES // self._align) * self._align
        self._windows = windows
        self._fd, _ = open_read(self.path, direct)
        self._slots: list[list[Any]] = []  # [start, end, buffer, view], most recent first
        self._hashed = 0
        self._hash = xxhash.xxh3_128()
        # Sequential runs being read, most recent first: [end of its last refill, read-ahead].
        # Two, so that a read far ahead (a large item's zip directory, at its end, read before
        # the item) starts a run of its own instead of resetting the read-ahead of the main one.
        self._runs: list[list[int]] = []
        self._ahead: tuple[int, Any, memoryview, Future[int]] | None = None
        self._limit = size  # no read past it (verify_range)
        self.rechecked = False
        """Whether :meth:`close` compared the bytes read with ``digest``."""
        self.damage: CheckpointDamaged | None = None
        """The block that did not match its checksum, if one did (``blocks``)."""

    def _slot(self, pos: int, want: int = 1) -> list[Any]:
        """The window holding ``pos`` (refilled into the least recently used one if none, with
        at least ``want`` bytes or the read-ahead, at most a window)."""
        for i, slot in enumerate(self._slots):
            if slot[0] <= pos < slot[1]:
                if i:
                    self._slots.insert(0, self._slots.pop(i))
                return slot
        if len(self._slots) < self.SLOTS:
            buf = self._windows.take(self._window)
            slot = [0, 0, buf, memoryview(buf)]
        else:
            slot = self._slots.pop()
        self._slots.insert(0, slot)
        # A read a little past the last refill (torch.load reads a record's zip directory, at
        # its end, before the record) continues the run from there instead of leaving a gap
        # that the record's own reads would refill again.
        align = self._align
        run = next((r for r in self._runs if r[0] % align == 0 and r[0] <= pos < r[0] + r[1]),
                   None)
        if run is not None:  # continues a run: from its end, four times the read-ahead
            self._runs.remove(run)
            start, run[1] = run[0], min(4 * run[1], self._window)
        else:
            start, run = pos - pos % align, [0, min(max(self.MIN_AHEAD, align), self._window)]
        self._runs = [run, *self._runs][:self.SLOTS]
        length = min(self._window, max(run[1], pos - start + want), self._limit - start)
        length = -(-length // align) * align
        slot[0] = slot[1] = 0  # refilled: holds nothing until verified
        n = self._take_ahead(slot, start, length)
        if n is None:
            n = self._windows.fill(self._fd, slot[3][:length], start)
        run[0] = start + n
        if run[1] == self._window and n == length and run[0] < min(self.size, self._limit):
            self._read_ahead(run[0])  # streaming: the next window while this one is used
        end = start + min(n, max(0, self.size - start))
        if self._blocks is not None:
            good, damage = self._check_blocks(slot[3], start, end, length)
            if damage is not None and pos >= good:
                self.damage = damage  # kept: a reader may wrap what it raises
                raise damage
            end = good  # the read-ahead past a damaged block serves up to it
        slot[0], slot[1] = start, end
        progress = self._digest is not None
        while progress:  # extend the hashed run with every window that continues it
            progress = False
            for s0, s1, _, view in self._slots:
                if s0 <= self._hashed < s1:
                    self._hash.update(view[self._hashed - s0:s1 - s0])
                    self._hashed, progress = s1, True
        return slot

    def skip_to(self, pos: int) -> None:
        """Seek forward to ``pos``, past bytes nobody reads: a read ahead begun before it is
        dropped (it would hold back the read-ahead of the run that starts there)."""
        if self._ahead is not None and self._ahead[0] + self._window <= pos:
            self._drop_ahead()
        self.seek(pos)

    def verify_range(self, start: int, end: int) -> None:
        """Read and check the blocks of ``[start, end)`` (block-aligned ``start``), serving
        nothing (a file several ranks read, verified by each in part): :class:`CheckpointDamaged`
        at a block that differs."""
        assert self._blocks is not None and start % self._align == 0
        self._limit = min(self.size, -(-end // self._align) * self._align)
        pos = start
        while pos < min(end, self.size):
            pos = self._slot(pos)[1]

    def _read_ahead(self, start: int) -> None:
        """Start reading the window at ``start`` in the background (:meth:`_take_ahead`)."""
        if self._ahead is not None:
            return  # one read ahead at a time: the one pending may be another run's
        buf = self._windows.take(self._window)
        view = memoryview(buf)[:self._window]
        self._ahead = (start, buf, view, self._windows.fill_later(self._fd, view, start))

    def _drop_ahead(self) -> None:
        assert self._ahead is not None
        _, buf, view, done = self._ahead
        self._ahead = None
        done.exception()  # the descriptor and the buffer are in use until the read ends
        view.release()
        self._windows.give(buf)

    def _take_ahead(self, slot: list[Any], start: int, length: int) -> int | None:
        """The bytes read ahead into a window, swapped into ``slot``, if that read began at
        ``start`` and covers ``length``; else None (a read ahead elsewhere stays pending: the
        run it continues may come back to it)."""
        if self._ahead is None or self._ahead[0] != start:
            return None
        n = self._ahead[3].result()
        if n < length and start + n < self.size:
            self._drop_ahead()
            return None
        _, buf, view, _ = self._ahead
        self._ahead = None
        slot[3].release()
        self._windows.give(slot[2])
        slot[2], slot[3] = buf, view
        return n

    def _check_blocks(self, view: memoryview, start: int, end: int,
                      length: int) -> tuple[int, CheckpointDamaged | None]:
        """Check the blocks of ``[start, end)`` (just read into ``view``) against the manifest:
        the end of the verified ones, and the damage found at the first that differs or that
        the file cut short (None if none)."""
        assert self._blocks is not None
        size, digests = self._blocks
        for off in range(start, end, size):
            got = xxhash.xxh3_64_hexdigest(view[off - start:min(off + size, end) - start])
            if got != digests[off // size]:
                return off, CheckpointDamaged(
                    f"{self.path}: bytes {off}-{min(off + size, end)} do not match the "
                    "manifest's block checksum (damaged since it was saved)")
        if end < min(start + length, self.size):
            return end - end % size, CheckpointDamaged(
                f"{self.path} is shorter than the manifest says (read up to byte {end} of "
                f"{self.size})")
        return end, None

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        done = 0
        while done < len(out) and self._pos < self.size:
            start, end, _, view = self._slot(self._pos, len(out) - done)
            if self._pos >= end:
                break  # the file is shorter than it was: the caller sees the short read
            k = min(len(out) - done, end - self._pos)
            out[done:done + k] = view[self._pos - start:self._pos - start + k]
            self._pos += k
            done += k
        return done

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._digest is not None and self.size - self._hashed <= self._window:
                while self._hashed < self.size:  # the rest of the run: at most one window
                    before = self._hashed
                    self._slot(self._hashed)
                    if self._hashed == before:
                        break
                if self._hashed == self.size:
                    self.rechecked = True
                    if self._hash.hexdigest() != self._digest:
                        raise PipelineError(
                            f"{self.path} changed after it was verified (its bytes no longer "
                            "match the checkpoint's manifest): do not modify a checkpoint "
                            "while a run resumes from it")
        finally:
            if self._ahead is not None:
                self._drop_ahead()
            for slot in self._slots:
                slot[3].release()
                self._windows.give(slot[2])
            self._slots.clear()
            os.close(self._fd)
            super().close()
