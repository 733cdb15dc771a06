"""Resume-time reading of a checkpoint: every rank verifies the files it will read, from the
very bytes the engine then deserializes.

Before (issue 14), a resume read the checkpoint twice: rank 0 hashed every file
(``checkpoint.verify``), then each engine read its files again from disk. Now:

1. rank 0 checks the folder's structure (:func:`pipeline.checkpoint.verify` with
   ``contents=False``: manifest, sizes, no links, nothing unlisted) and the config/data hashes,
   and broadcasts its choice;
2. every rank reads the files it will load (:func:`claims`: its own DCP shard files, its own
   DeepSpeed partition, the files every rank reads) into page-aligned memory with large
   ``O_DIRECT`` reads (:func:`read_file`), hashes those bytes and compares them with the
   manifest; the files nobody claims are shared out by size (:func:`assign`) and verified too,
   so that together the ranks verify the whole checkpoint;
3. ``all_gather_object`` of every rank's verdict (:func:`verify_collective`): all ranks learn
   the same first failure before any engine deserializes anything (the manager then falls back
   to the next older checkpoint, as a corrupt file always did; a DeepSpeed file whose checksum
   matches but whose pickle names globals beyond the allow-list stops every rank with the same
   error, as the engine's load did);
4. the engine deserializes from the verified memory (:meth:`VerifiedFiles.dcp_filesystem` for
   DCP's reader, :meth:`VerifiedFiles.ds_loader` for DeepSpeed's checkpoint engine), and reads
   from disk only what no memory holds (files another rank verified, or beyond the memory
   budget).

Which rank reads which file is decided from the file names alone (the manager does not know the
engine's layout): a wrong guess costs a second read from disk, never correctness. Shared files
(read by several ranks) are read through the page cache, so that the node reads them once.
"""

from __future__ import annotations

import contextlib
import errno
import io
import mmap
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from pipeline.errors import PipelineError
from pipeline.fastio import ALIGN, DIGEST

#: One read request: large enough that the disk streams, small enough that several are in
#: flight at once (queue depth helps virtual and NVMe disks alike).
CHUNK_BYTES = 16 << 20
#: Files under this size are read through the page cache (one small request either way).
SMALL_BYTES = 1 << 20
READ_THREADS = 4

_DCP_SHARD = re.compile(r"^dcp/__(\d+)_\d+\.distcp$")
_RNG = re.compile(r"^rng/rank-(\d+)\.pt$")
_DS_ZERO = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt$")
_DS_MODEL = re.compile(r"(?:^|/)mp_rank_(\d+)_model_states\.pt$")
#: Small files every rank reads itself (DCP's index; the trainer state).
_EVERY_RANK = frozenset({"dcp/.metadata", "trainer.json"})


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
        if rel in _EVERY_RANK:
            out[rel] = list(range(world))
        elif m := _DCP_SHARD.match(rel) or _RNG.match(rel):
            if same and int(m.group(1)) < world:
                out[rel] = [int(m.group(1))]
        elif m := _DS_ZERO.search(rel):
            zero.setdefault(m.group(3), []).append((int(m.group(1)), int(m.group(2)), rel))
        elif m := _DS_MODEL.search(rel):
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
    """The files each rank verifies: those it claims (:func:`claims`), and the unclaimed rest
    shared out largest first to the rank with the fewest bytes so far (so that every file is
    verified by at least one rank)."""
    who = claims(files, world, saved_world)
    out: dict[int, list[str]] = {r: [] for r in range(world)}
    load = [0] * world
    for rel, ranks in who.items():
        for r in ranks:
            out[r].append(rel)
            load[r] += files[rel]["bytes"]
    for rel in sorted(set(files) - set(who), key=lambda k: (-files[k]["bytes"], k)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(rel)
        load[r] += files[rel]["bytes"]
    return out


def _open(path: Path, direct: bool) -> tuple[int, bool]:
    """A read-only descriptor that follows no symbolic link; O_DIRECT where asked and allowed."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT), True
        except OSError as err:
            if err.errno != errno.EINVAL:  # tmpfs and some network filesystems refuse O_DIRECT
                raise
    return os.open(path, flags), False


def read_file(path: Path, size: int, *, direct: bool = True,
              pool: ThreadPoolExecutor | None = None,
              in_file: bool = False) -> tuple[memoryview, int | None]:
    """The ``size`` bytes of ``path`` in page-aligned memory (an anonymous mmap, as O_DIRECT
    needs), read in :data:`CHUNK_BYTES` requests, several in flight when ``pool`` is given.
    ``OSError`` if the file is not exactly ``size`` bytes long.

    ``in_file``: the memory is an in-memory file (``memfd_create``, Linux) whose descriptor
    comes back too, so that ``torch.load(mmap=True)`` maps the verified bytes without a copy;
    otherwise (and where there is no ``memfd_create``) the descriptor is None."""
    if size == 0:
        with open(path, "rb") as f:
            if f.read(1):
                raise OSError(errno.EIO, f"{path} is longer than 0 bytes")
        return memoryview(b""), None
    padded = -(-size // ALIGN) * ALIGN
    mem_fd = None
    if in_file and hasattr(os, "memfd_create"):
        mem_fd = os.memfd_create(path.name, getattr(os, "MFD_CLOEXEC", 0))
        os.ftruncate(mem_fd, padded)
        buf = mmap.mmap(mem_fd, padded)
    else:
        buf = mmap.mmap(-1, padded)
    if size >= CHUNK_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults while the reads fill it
    view = memoryview(buf)
    fd, is_direct = _open(path, direct)
    try:
        if hasattr(os, "posix_fadvise") and not is_direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

        def chunk(off: int) -> int:
            # O_DIRECT reads whole aligned blocks: ask for the padded length, get the file's.
            end = min(off + CHUNK_BYTES, len(view))
            got = 0
            while off + got < end:
                n = os.preadv(fd, [view[off + got:end]], off + got)
                if n == 0:
                    break
                got += n
            return got

        offsets = range(0, size, CHUNK_BYTES)
        got = sum(pool.map(chunk, offsets) if pool is not None and len(offsets) > 1
                  else map(chunk, offsets))
        if got != size or os.fstat(fd).st_size != size:
            raise OSError(errno.EIO, f"read {got} bytes, the manifest says {size}")
        if mem_fd is not None:
            os.ftruncate(mem_fd, size)  # the file's own length (the zip directory is at its end)
    except BaseException:
        if mem_fd is not None:
            os.close(mem_fd)
        raise
    finally:
        os.close(fd)
    return view[:size], mem_fd


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over verified bytes (no copy until a read)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        data = bytes(self._view[self._pos:end]) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return data

    def readall(self) -> bytes:
        return self.read(-1)


@dataclass
class VerifiedFiles:
    """The bytes this rank verified and kept, by path relative to the checkpoint ``root``."""

    root: Path
    data: dict[str, memoryview] = field(default_factory=dict)
    fds: dict[str, int] = field(default_factory=dict)
    """In-memory files holding ``data`` (:func:`read_file`'s ``in_file``), by the same path."""
    served: int = 0
    """Bytes the engine read from here rather than from disk."""

    def _rel(self, path: str | os.PathLike) -> str | None:
        try:
            return Path(os.path.abspath(path)).relative_to(os.path.abspath(self.root)).as_posix()
        except ValueError:
            return None

    def get(self, path: str | os.PathLike) -> memoryview | None:
        rel = self._rel(path)
        return None if rel is None else self.data.get(rel)

    @contextlib.contextmanager
    def open(self, path: str | os.PathLike) -> Iterator[io.RawIOBase]:
        """``path`` from memory if this rank kept it, else from disk (verified by another rank)."""
        view = self.get(path)
        if view is None:
            with open(path, "rb") as f:
                yield f
            return
        self.served += len(view)
        with _MemoryFile(view) as f:
            yield f

    def dcp_filesystem(self) -> Any:
        """A DCP ``FileSystem`` whose read streams serve the verified bytes (set it as a
        ``FileSystemReader``'s ``fs``)."""
        from torch.distributed.checkpoint.filesystem import FileSystem

        cache = self

        class _VerifiedFileSystem(FileSystem):
            @contextlib.contextmanager
            def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
                if mode != "rb":
                    with super().create_stream(path, mode) as stream:
                        yield stream
                    return
                with cache.open(path) as stream:
                    yield stream

        return _VerifiedFileSystem()

    def ds_loader(self) -> Callable[..., Any]:
        """DeepSpeed's checkpoint-engine ``load``: the allow-listed ``weights_only`` load of
        :func:`pipeline.checkpoint_tensors.load_ds_file_for_engine`, from memory when kept."""
        from pipeline.checkpoint_tensors import load_ds_file_for_engine

        def load(path: str | os.PathLike, map_location: Any = None) -> Any:
            view = self.get(path)
            if view is None:
                return load_ds_file_for_engine(path, map_location=map_location)
            self.served += len(view)
            return load_ds_bytes(view, Path(path), map_location, self.fds.get(self._rel(path)))

        return load

    def release(self) -> None:
        """Drop the kept bytes (after the engine loaded them; tensors still mapped from an
        in-memory file keep its pages)."""
        self.data.clear()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def ds_globals_refused(view: memoryview, name: Path) -> str | None:
    """The reason a DeepSpeed ``*.pt`` file is refused (globals beyond the allow-list or a
    garbled file), or None."""
    import torch

    from pipeline.checkpoint_tensors import DS_GLOBALS

    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(_MemoryFile(view))
    except Exception as err:  # a truncated or garbled file: the same answer for every kind
        return f"{name}: not a readable torch checkpoint file ({err})"
    foreign = [g for g in unsafe if g not in DS_GLOBALS]
    if foreign:
        return f"{name} pickles objects outside DeepSpeed's allow-list: {foreign[:5]}"
    return None


def load_ds_bytes(view: memoryview, name: Path, map_location: Any = None,
                  fd: int | None = None) -> Any:
    """A verified DeepSpeed ``*.pt`` file from memory: ``weights_only=True`` with
    :data:`~pipeline.checkpoint_tensors.DS_GLOBALS` as the only extra globals. ``fd``: the
    in-memory file holding ``view``, memory-mapped by ``torch.load`` (no copy of the tensors;
    DeepSpeed's model-states file is loaded twice, and copies its tensors out anyway)."""
    import importlib
    import pickle

    import torch

    why = ds_globals_refused(view, name)
    if why is not None:
        raise PipelineError(why)
    classes = []
    for g in torch.serialization.get_unsafe_globals_in_checkpoint(_MemoryFile(view)):
        module, _, attr = g.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attr))
    try:
        with torch.serialization.safe_globals(classes):
            if fd is not None:
                return torch.load(f"/proc/self/fd/{fd}", weights_only=True, mmap=True,
                                  map_location=map_location)
            return torch.load(_MemoryFile(view), weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as err:
        raise PipelineError(f"{name}: refused to unpickle ({str(err).splitlines()[0]})") from None
    except (OSError, RuntimeError, EOFError) as err:
        raise PipelineError(f"{name}: not a readable torch checkpoint file ({err})") from None


def memory_budget() -> int:
    """Bytes one rank may keep: half the memory available, shared by the node's ranks."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // (2 * local)
    except (OSError, ValueError, IndexError):
        pass
    return 4 << 30


def _digest(view: memoryview) -> str:
    return xxhash.xxh3_128(view).hexdigest()


def verify_local(path: Path, files: dict[str, dict[str, Any]], mine: list[str], shared: set[str],
                 *, budget: int | None = None) -> tuple[VerifiedFiles, str | None, bool]:
    """Read and check this rank's files ``mine`` of the checkpoint ``path``; keep their bytes
    (within ``budget``). Returns the kept bytes, the first failure or None, and whether that
    failure is a refusal (a DeepSpeed file that names globals beyond the allow-list: its
    checksum matched, so the checkpoint is tampered with rather than torn) rather than damage.

    ``shared``: files other ranks read too, read through the page cache so that the node reads
    them from the disk once."""
    import hashlib

    budget = memory_budget() if budget is None else budget
    out = VerifiedFiles(path)
    kept = 0
    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        for rel in sorted(mine, key=lambda k: (-files[k]["bytes"], k)):
            info = files[rel]
            size = info["bytes"]
            try:
                # DeepSpeed's files go to torch.load(mmap=True) from an in-memory file.
                view, fd = read_file(path / rel, size, pool=pool,
                                     direct=rel not in shared and size >= SMALL_BYTES,
                                     in_file=rel.startswith("ds/") and rel.endswith(".pt")
                                     and kept + size <= budget)
            except OSError as err:
                return out, f"{rel} could not be read ({err.strerror or err})", False
            if DIGEST in info:
                ok = _digest(view) == info[DIGEST]
            else:  # manifests written before the switch to xxh3
                ok = hashlib.sha256(view).hexdigest() == info.get("sha256")
            if fd is not None:
                out.fds[rel] = fd  # closed by release(), also on a failure
            if not ok:
                return out, f"{rel} does not match its checksum", False
            if rel.endswith(".pt") and rel.startswith("ds/"):
                why = ds_globals_refused(view, path / rel)
                if why is not None:
                    return out, why, True
            if kept + size <= budget:
                out.data[rel] = view
                kept += size
    return out, None, False


def verify_collective(path: Path, rank: int, world: int) -> tuple[VerifiedFiles, str | None]:
    """Collective: every rank verifies its share of ``path`` (:func:`assign`), then all ranks
    exchange their verdicts; every rank returns the same first failure (with the rank that
    found it), or None with the bytes it kept. ``path`` passed rank 0's structural check.

    A refusal (:func:`verify_local`) is raised on every rank as the same
    :class:`~pipeline.errors.PipelineError`: a tampered checkpoint stops the run, as the
    engine's allow-list always did, instead of being skipped like a damaged one."""
    import torch.distributed as dist

    from pipeline.checkpoint import MANIFEST, _manifest_entries
    from pipeline.io import read_json

    cache = VerifiedFiles(path)
    why: str | None
    refused = False
    try:
        meta = read_json(path / MANIFEST)
        files = _manifest_entries(path, meta)
    except (OSError, ValueError, RecursionError) as err:
        files = f"manifest.json is not valid JSON ({err})"
    if isinstance(files, str):
        why = files
    else:
        mine = assign(files, world, meta.get("world_size"))
        who = claims(files, world, meta.get("world_size"))
        shared = {rel for rel, ranks in who.items() if len(ranks) > 1}
        cache, why, refused = verify_local(path, files, mine[rank], shared)
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, (why, refused))
    for v, r_refused in verdicts:
        if r_refused:
            cache.release()
            raise PipelineError(v)
    for r, (v, _) in enumerate(verdicts):
        if v is not None:
            cache.release()
            return cache, v if world == 1 else f"{v} (verified by rank {r})"
    return cache, None
