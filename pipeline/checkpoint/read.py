"""Resume-time reading of a checkpoint: every byte an engine reads is verified first, and the
disk is read once.

1. rank 0 checks the folder's structure (:func:`pipeline.checkpoint.format.verify` with
   ``contents=False``: manifest, sizes, no links, nothing unlisted) and the config/data hashes,
   and broadcasts its choice;
2. every rank verifies its share (:func:`assign`): the files it will load (:func:`claims`: its
   own DCP shard files, its own DeepSpeed partition), a large file several ranks load by one of
   them, and the files nobody claims shared out by size, so that together the ranks cover the
   whole checkpoint. Small files (at most :data:`KEEP_BYTES`: DCP's pickled index, the trainer
   state) are read whole, checked and kept in memory. A large file with block checksums (the
   manifest's ``blocks``) that this rank alone loads is not read now (:func:`read_once`): the
   engine's read checks each block before it is served, except DeepSpeed's optimizer
   partition, deserialized now through that check (:func:`_preload_ds`), as are DeepSpeed's
   model states where two ranks share them (:func:`split_states`). Other large files are hashed
   whole with ``O_DIRECT`` (:func:`~pipeline.checkpoint.stream.digest_file_windowed`);
3. ``all_gather_object`` of every rank's verdict (:func:`verify_collective`): all ranks learn
   the same first failure before any engine deserializes anything (the manager then falls back
   to the next older checkpoint; a DeepSpeed file whose bytes verify but whose pickle names
   globals beyond the allow-list stops every rank with the same error, as the engine's load
   did);
4. the engine reads through :class:`VerifiedFiles` (:meth:`~VerifiedFiles.dcp_filesystem` for
   DCP's reader, :meth:`~VerifiedFiles.ds_loader` for DeepSpeed's checkpoint engine): small
   files from memory, DeepSpeed's partition as already loaded, large files through a
   :class:`~pipeline.checkpoint.stream.WindowStream` (block-checked; without block checksums,
   hashed again and compared at the end), DeepSpeed's model-states file as already loaded
   (:func:`split_states`) or memory-mapped by ``torch.load`` (``weights_only`` with the
   allow-listed globals, verified in step 2). A damaged block found in step 4 fails DCP's
   load on every rank; the manager loads the next older checkpoint over it
   (:meth:`pipeline.checkpoint.manager.CheckpointManager.load`).

Which rank reads which file is decided from the file names alone
(:mod:`pipeline.checkpoint.claims`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from pipeline.checkpoint.claims import (
    DS_MODEL,
    DS_ZERO,
    KEEP_BYTES,
    assign,
    claims,
    is_partition,
)
from pipeline.checkpoint.fastio import DIGEST
from pipeline.checkpoint.stream import (
    MAX_BLOCK_BYTES,
    CheckpointDamaged,
    SeekableReader,
    Windows,
    WindowStream,
    digest_file_windowed,
    open_read,
)
from pipeline.errors import PipelineError

#: Whether a resume reads the large files through the page cache (the checksum pass fills it,
#: the engine's read finds the pages there: one read from the disk) or with O_DIRECT (two).
#: Measured in one run on the development VM (python -m bench.checkpoint, A/B twice, the first
#: load of a fresh process as a requeued job does): fsdp 2.03-2.25 s with O_DIRECT against
#: 2.83-3.05 s through the page cache, deepspeed 4.75-5.25 s against 5.40-5.98 s (filling the
#: page cache touches fresh guest memory there, see pipeline.checkpoint.stream); a second load
#: in the same process favoured the page cache (1.55-1.73 s against 2.10-2.19 s). O_DIRECT, as
#: measured; on a machine where the page cache fills at disk speed the other way reads less.
THROUGH_PAGE_CACHE = False

def read_file(path: Path, size: int) -> memoryview:
    """The ``size`` bytes of a small file (at most :data:`KEEP_BYTES`), through the page
    cache. ``OSError`` if the file is not exactly ``size`` bytes long."""
    fd, _ = open_read(path, direct=False)
    try:
        data = bytearray(size)
        view = memoryview(data)
        got = 0
        while got < size and (n := os.preadv(fd, [view[got:]], got)) > 0:
            got += n
        if got != size or os.fstat(fd).st_size != size:
            raise OSError(errno.EIO, f"read {got} bytes, the manifest says {size}")
    finally:
        os.close(fd)
    return view


class _MemoryFile(SeekableReader):
    """A read-only, seekable file over verified bytes (no copy until a read)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__(len(view))
        self._view = view

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


@dataclass
class VerifiedFiles:
    """What this rank verified, for the engine to read: the small files' bytes (``data``), and
    the manifest's checksum of every file (``digests``), by path relative to ``root``."""

    root: Path
    data: dict[str, memoryview] = field(default_factory=dict)
    digests: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    """(bytes, xxh3-128 or None) of every file of the checkpoint: a large file is read through a
    re-hashing :class:`~pipeline.checkpoint.stream.WindowStream`."""
    blocks: dict[str, tuple[int, list[str]]] = field(default_factory=dict)
    """The block checksums of the files that list them: such a file is read through a
    :class:`~pipeline.checkpoint.stream.WindowStream` that checks each block before serving it
    (those this rank reads were not hashed beforehand, :func:`verify_local`)."""
    loaded: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed optimizer partitions already deserialized while they were verified (one read of
    the disk; :func:`verify_local`), for the engine's load to take."""
    targets: Any = None
    """The engine's :class:`~pipeline.checkpoint.reuse.LoadTargets` that this rank's partition
    is deserialized into (or None: fresh memory)."""
    handed: bool = False
    """Whether the engine's load took a partition read into ``targets`` (then :meth:`release`
    leaves them as they are: they are the engine's state now)."""
    windows: Windows = field(default_factory=Windows)
    states: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed model states deserialized while verified (:func:`split_states`), kept."""
    partition_read: bool = False  # whether this rank's optimizer partition went into targets

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
        """``path`` from memory if this rank kept it, else through a re-hashing stream (a file of
        the checkpoint), else from disk."""
        view = self.get(path)
        if view is not None:
            with _MemoryFile(view) as f:
                yield f
            return
        rel = self._rel(path)
        if rel in self.digests:
            size, digest = self.digests[rel]
            with WindowStream(Path(path), size, digest, self.windows,
                              direct=not THROUGH_PAGE_CACHE, blocks=self.blocks.get(rel)) as f:
                yield f
            return
        with open(path, "rb") as f:
            yield f

    def dcp_filesystem(self) -> Any:
        """A DCP ``FileSystem`` whose read streams are :meth:`open`'s (set it as a
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
        """DeepSpeed's checkpoint-engine ``load``: ``weights_only=True`` with the file's own
        globals, all within :data:`~pipeline.checkpoint.tensors.DS_GLOBALS`. A kept (small) file
        from memory. A large model-states file memory-mapped by ``torch.load``: DeepSpeed loads
        it twice and copies its tensors into the module, so mapping the page cache saves a
        private copy (and a second disk read). A large optimizer partition through
        :meth:`open` (re-hashed): the optimizer's ``load_state_dict`` keeps the loaded tensors
        themselves as its state, which must not be pages of a file that could change under
        training."""

        def load(path: str | os.PathLike, map_location: Any = None) -> Any:
            rel = self._rel(path)
            if rel in self.states:
                self.handed = True
                return self.states[rel]
            if rel in self.loaded and str(map_location or "cpu") == "cpu":
                self.handed = True
                return self.loaded.pop(rel)
            view = self.get(path)
            with _MemoryFile(view) if view is not None else open(path, "rb") as g:
                classes = ds_classes(g, Path(path))
            if view is None and DS_MODEL.search(Path(path).name):
                return load_ds_stream(os.fspath(path), Path(path), classes, map_location)
            with self.open(path) as f:
                if (rel in self.digests and is_partition(rel)
                        and self.targets is not None and not self.partition_read
                        and str(map_location or "cpu") == "cpu"):
                    # A partition read now (small, or without block checksums): into the
                    # engine's tensors too.
                    from pipeline.checkpoint.reuse import load_reusing

                    got = load_reusing(f, self.digests[rel][0], str(path), classes,
                                       self.targets)
                    self.handed = self.partition_read = True
                    return got
                return load_ds_stream(f, Path(path), classes, map_location)

        return load

    def release(self) -> None:
        """Drop the kept bytes, what the engine did not take and the read buffers (after the
        engine loaded them, or instead: then the engine's tensors that a partition was read
        into get their start-up values back, ``LoadTargets.restore``; and tensors the engine
        made for a load that did not take them are dropped: a fresh optimizer's uninitialized
        moments, even where this rank read nothing, as when another rank found damage)."""
        self.data.clear()
        self.states.clear()
        if self.targets is not None and (self.loaded or not self.handed):
            self.targets.restore()
            self.targets.restore_shared()  # collective: every rank abandons the load here
        self.loaded.clear()
        self.windows.close()


def ds_globals_refused(f: Any, name: Path) -> str | None:
    """The reason the DeepSpeed ``*.pt`` file open as ``f`` is refused (globals beyond the
    allow-list or a garbled file), or None."""
    import torch

    from pipeline.checkpoint.tensors import DS_GLOBALS

    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception as err:  # a truncated or garbled file: the same answer for every kind
        return f"{name}: not a readable torch checkpoint file ({err})"
    foreign = [g for g in unsafe if g not in DS_GLOBALS]
    if foreign:
        return f"{name} pickles objects outside DeepSpeed's allow-list: {foreign[:5]}"
    return None


def ds_classes(f: Any, name: Path) -> list[Any]:
    """The classes the DeepSpeed ``*.pt`` file open as ``f`` pickles, imported; a
    :class:`~pipeline.errors.PipelineError` unless all are in
    :data:`~pipeline.checkpoint.tensors.DS_GLOBALS`."""
    import importlib

    import torch

    why = ds_globals_refused(f, name)
    if why is not None:
        raise PipelineError(why)
    f.seek(0)
    classes = []
    for g in torch.serialization.get_unsafe_globals_in_checkpoint(f):
        module, _, attr = g.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attr))
    return classes


def load_ds_stream(f: Any, name: Path, classes: list[Any], map_location: Any = None) -> Any:
    """A verified DeepSpeed ``*.pt`` file, open as ``f`` (seekable) or at the path ``f``
    (memory-mapped): ``weights_only=True`` with ``classes`` (:func:`ds_classes`) as the only
    extra globals."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(classes):
            if isinstance(f, str):
                return torch.load(f, weights_only=True, mmap=True, map_location=map_location)
            return torch.load(f, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as err:
        raise PipelineError(f"{name}: refused to unpickle ({str(err).splitlines()[0]})") from None
    except (OSError, RuntimeError, EOFError) as err:
        raise PipelineError(f"{name}: not a readable torch checkpoint file ({err})") from None


def _check(path: Path, rel: str, info: dict[str, Any], windows: Windows,
           out: VerifiedFiles) -> tuple[str | None, bool]:
    """Verify one file of ``mine``: (failure or None, refused). A small file is kept in
    ``out.data``; a large one is hashed through ``windows``."""
    import hashlib

    size = info["bytes"]
    algorithm = DIGEST if DIGEST in info else "sha256"  # manifests from before xxh3
    try:
        if size <= KEEP_BYTES:
            view = read_file(path / rel, size)
            h: Any = xxhash.xxh3_128(view) if algorithm == DIGEST else hashlib.sha256(view)
            digest = h.hexdigest()
        else:
            view = None
            # DeepSpeed's model states are memory-mapped by the engine's load (ds_loader): read
            # through the page cache here, that load finds them there (one read of the disk).
            mapped = DS_MODEL.search(rel) is not None
            digest = digest_file_windowed(path / rel, size, windows, algorithm=algorithm,
                                        direct=not (THROUGH_PAGE_CACHE or mapped))
    except OSError as err:
        return f"{rel} could not be read ({err.strerror or err})", False
    if digest != info.get(algorithm):
        return f"{rel} does not match its checksum", False
    if rel.endswith(".pt") and rel.startswith("ds/"):
        with contextlib.ExitStack() as stack:
            f = _MemoryFile(view) if view is not None else stack.enter_context(
                open(path / rel, "rb"))
            why = ds_globals_refused(f, path / rel)
        if why is not None:
            return why, True
    if view is not None:
        out.data[rel] = view
    return None, False


def _preload_ds(path: Path, rel: str, out: VerifiedFiles) -> tuple[str | None, bool]:
    """Deserialize this rank's DeepSpeed optimizer partition ``rel`` (or model states,
    :func:`split_states`) through a block-checking stream (its only read of the disk), kept in
    ``out.loaded`` (``out.states``): (failure or None, refused), as :func:`_check`: with every
    byte read verified, a file that still does not load or names globals beyond the allow-list
    was written so (refused)."""
    from pipeline.checkpoint.reuse import load_reusing

    why, refused = None, True  # a failure with every byte read verified: refused
    try:
        with out.open(path / rel) as f:
            try:
                classes = ds_classes(f, path / rel)
                f.seek(0)
                if out.targets is not None:
                    loaded = load_reusing(f, out.digests[rel][0], str(path / rel), classes,
                                          out.targets)
                else:
                    loaded = load_ds_stream(f, path / rel, classes, "cpu")
                if DS_MODEL.search(rel):
                    out.states[rel] = loaded
                else:
                    out.loaded[rel] = loaded
                    out.partition_read = out.targets is not None
            except PipelineError as err:  # torch.load wraps what the stream raised
                why = str(err)
            damage = getattr(f, "damage", None)
    except OSError as err:
        why, refused, damage = f"{rel} could not be read ({err.strerror or err})", False, None
    if why is not None or damage is not None:
        out.loaded.clear()  # the checkpoint is not loaded: the engine's memory as it was
        out.states.clear()
        if out.targets is not None:
            out.targets.restore()
    if damage is not None:
        return f"{rel}: {str(damage).split(': ', 1)[-1]}", False
    return why, why is not None and refused


def _check_part(path: Path, rel: str, lo: int, hi: int,
                out: VerifiedFiles) -> tuple[str | None, bool]:
    """Check bytes ``[lo, hi)`` of the shared file ``rel`` block by block, through the page
    cache (the engine maps it: the ranks' reads leave it there for all of them); the rank with
    the first share also checks the globals its pickle names. (failure or None, refused), as
    :func:`_check`."""
    size, _ = out.digests[rel]
    try:
        with WindowStream(path / rel, size, None, out.windows, direct=False,
                          blocks=out.blocks[rel]) as f:
            f.verify_range(lo, hi)
        if lo == 0:
            with WindowStream(path / rel, size, None, out.windows, direct=False,
                              blocks=out.blocks[rel]) as f:
                why = ds_globals_refused(f, path / rel)
                if f.damage is not None:
                    raise f.damage
            if why is not None:
                return why, True
    except CheckpointDamaged as err:
        return f"{rel}: {str(err).split(': ', 1)[-1]}", False
    except OSError as err:
        return f"{rel} could not be read ({err.strerror or err})", False
    return None, False


def split_shared(files: dict[str, dict[str, Any]], who: dict[str, list[int]],
                 rank: int) -> dict[str, tuple[int, int]]:
    """This rank's byte range of each large file with block checksums that several ranks load
    memory-mapped (DeepSpeed's model states): each of them checks a share of its blocks."""
    out = {}
    for rel, ranks in who.items():
        blocks = usable_blocks(files[rel])
        if len(ranks) < 2 or rank not in ranks or blocks is None or not DS_MODEL.search(rel):
            continue
        n, i = len(blocks[1]), ranks.index(rank)
        lo, hi = n * i // len(ranks), n * (i + 1) // len(ranks)
        if hi > lo:
            out[rel] = (lo * blocks[0], min(hi * blocks[0], files[rel]["bytes"]))
    return out


def split_states(files: dict[str, dict[str, Any]], who: dict[str, list[int]], rank: int,
                 targets: Any) -> frozenset[str]:
    """The DeepSpeed model states (with block checksums) this rank shares with one other:
    read into the engine's module while verified, block-checked, O_DIRECT, all but this rank's
    partition of the weights (``targets.skip``, copied from the masters after the load). The
    two partitions are disjoint (every block checked by one rank): half the file each, not all
    of it mapped through the page cache (new memory) and copied by both. More ranks would each
    read all the others' parts."""
    if targets is None or not targets.skip:
        return frozenset()
    return frozenset(rel for rel, ranks in who.items()
                     if DS_MODEL.search(rel) and len(ranks) == 2 and rank in ranks
                     and files[rel]["bytes"] > KEEP_BYTES and usable_blocks(files[rel]))


def read_once(rel: str, info: dict[str, Any], readers: list[int], rank: int) -> bool:
    """Whether this rank leaves ``rel`` to be verified block by block as it is read, instead of
    hashing it before: a large file with block checksums that this rank alone reads, through a
    stream (not DeepSpeed's memory-mapped model states)."""
    return (readers == [rank] and info["bytes"] > KEEP_BYTES and not DS_MODEL.search(rel)
            and usable_blocks(info) is not None)


def usable_blocks(info: dict[str, Any]) -> tuple[int, list[str]] | None:
    """The entry's block checksums if the reader's windows can check them (blocks of at most
    :data:`~pipeline.checkpoint.stream.MAX_BLOCK_BYTES`), else None."""
    from pipeline.checkpoint.format import block_digests

    found = block_digests(info)
    return found if found is not None and found[0] <= MAX_BLOCK_BYTES else None


def verify_local(path: Path, files: dict[str, dict[str, Any]], mine: list[str],
                 once: frozenset[str] = frozenset(), targets: Any = None,
                 parts: dict[str, tuple[int, int]] | None = None,
                 states: frozenset[str] = frozenset()
                 ) -> tuple[VerifiedFiles, str | None, bool]:
    """Check this rank's files ``mine`` of the checkpoint ``path`` (small ones kept). Those in
    ``once`` (:func:`read_once`) are not read now: the engine's read checks each block, except
    DeepSpeed's optimizer partitions, deserialized now through that check (the engine's load of
    them can fail on one rank only, while the others wait in its collectives).
    Returns what the engine reads through, the first failure or None, and whether that failure
    is a refusal (a DeepSpeed file that names globals beyond the allow-list: its checksum
    matched, so the checkpoint is tampered with rather than torn) rather than damage."""
    out = VerifiedFiles(path, digests={rel: (info["bytes"], info.get(DIGEST))
                                       for rel, info in files.items()})
    out.blocks = {rel: b for rel, info in files.items() if (b := usable_blocks(info))}
    out.targets = targets
    parts = parts or {}
    for rel in sorted(states):  # first: the moments' prefault runs meanwhile
        why, refused = _preload_ds(path, rel, out)
        if why is not None:
            return out, why, refused
    for rel, (lo, hi) in sorted(parts.items()):
        why, refused = _check_part(path, rel, lo, hi, out)
        if why is not None:
            return out, why, refused
    for rel in sorted(mine, key=lambda k: (-files[k]["bytes"], k)):
        if rel in parts or rel in states or (rel in once and not DS_ZERO.search(rel)):
            continue
        if rel in once:
            why, refused = _preload_ds(path, rel, out)
        else:
            why, refused = _check(path, rel, files[rel], out.windows, out)
        if why is not None:
            return out, why, refused
    return out, None, False


def verify_collective(path: Path, rank: int, world: int,
                      reuse: Callable[[], Any] | None = None
                      ) -> tuple[VerifiedFiles, str | None]:
    """Collective: every rank verifies its share of ``path`` (:func:`assign`), then all ranks
    exchange their verdicts; every rank returns the same first failure (with the rank that
    found it), or None with the bytes it kept. ``path`` passed rank 0's structural check.
    ``reuse``: makes the engine's :class:`~pipeline.checkpoint.reuse.LoadTargets` (same world
    size only): the tensors its DeepSpeed partition may be deserialized into, the moments made.

    A refusal (:func:`verify_local`) is raised on every rank as the same
    :class:`~pipeline.errors.PipelineError`: a tampered checkpoint stops the run, as the
    engine's allow-list always did, instead of being skipped like a damaged one."""
    import torch.distributed as dist

    from pipeline.checkpoint.format import MANIFEST, _manifest_entries
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
        once = frozenset(rel for rel in mine[rank]
                         if read_once(rel, files[rel], who.get(rel, []), rank))
        # The engine's tensors are named by their place in its own partition's file (fsdp:
        # none, the moments made): only a resume at the saved world size reads that layout.
        targets = reuse() if reuse is not None and meta.get("world_size") == world else None
        states = split_states(files, who, rank, targets)
        parts = {rel: share for rel, share in split_shared(files, who, rank).items()
                 if rel not in states}
        cache, why, refused = verify_local(path, files, mine[rank], once, targets, parts,
                                           states)
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
