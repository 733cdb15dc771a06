"""Several files mapped read-only into one contiguous address range, so that numpy can gather
rows from all of them in one call, as from one memory-mapped file.

Why: the loader's batch is a handful of rows from any of a split's shards; copying them one
Python-level row at a time cost ~30 % against a single ``np.memmap`` (bench/loader.py). With
every shard in one range, a batch is one fancy index of a strided view (0.99× the memmap in the
same run). How: a ``PROT_NONE`` reservation of the total (page-rounded) size, then each file
``mmap``-ed over its part with ``MAP_FIXED``, through libc (Python's ``mmap`` module cannot map
at an address). Linux on x86-64 and aarch64 only (the flag values below are theirs);
:meth:`JoinedMap.create` returns None anywhere else, or when a call fails, and the loader keeps
its per-row copy. The mapping lives as long as any array viewing it (each view holds the
ctypes buffer, which holds the map), so it is never unmapped under a reader.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
from pathlib import Path

import numpy as np

_PROT_NONE, _PROT_READ = 0x0, 0x1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED = 0x01, 0x02, 0x10
_MAP_ANONYMOUS, _MAP_NORESERVE = 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


class JoinedMap:
    """Files ``paths`` mapped back to back, each from a page boundary: file ``k`` starts at
    byte ``starts[k]`` of the range."""

    def __init__(self, libc: ctypes.CDLL, base: int, total: int, starts: list[int]) -> None:
        self._libc, self.base, self.total, self.starts = libc, base, total, starts

    @classmethod
    def create(cls, paths: list[Path], identities: list[tuple[int, int, int]]) -> JoinedMap | None:
        """Map ``paths`` (non-empty files), each checked to be the file ``identities`` names
        (device, inode, size: the one that was verified); None where this cannot be done."""
        libc = _libc()
        if libc is None or not paths:
            return None
        page = mmap.PAGESIZE
        sizes = [ident[2] for ident in identities]
        spans = [-(-s // page) * page for s in sizes]
        total = sum(spans)
        base = libc.mmap(None, total, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE,
                         -1, 0)
        if base in (None, _MAP_FAILED):
            return None
        starts, off = [], 0
        try:
            for path, ident, size, span in zip(paths, identities, sizes, spans, strict=True):
                fd = os.open(path, os.O_RDONLY)
                try:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino, st.st_size) != ident or size == 0:
                        return cls._undo(libc, base, total)  # replaced since it was verified
                    got = libc.mmap(base + off, size, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0)
                finally:
                    os.close(fd)
                if got != base + off:
                    return cls._undo(libc, base, total)
                starts.append(off)
                off += span
        except OSError:
            return cls._undo(libc, base, total)
        return cls(libc, base, total, starts)

    @staticmethod
    def _undo(libc: ctypes.CDLL, base: int, total: int) -> None:
        libc.munmap(base, total)
        return None

    def array(self, dtype: type) -> np.ndarray:
        """The whole range as a read-only 1-D array of ``dtype``; it keeps the mapping alive."""
        raw = (ctypes.c_char * self.total).from_address(self.base)
        raw._joined = self  # type: ignore[attr-defined]  # the map outlives every view of it
        out = np.frombuffer(raw, dtype=dtype)
        out.flags.writeable = False
        return out

    def __del__(self) -> None:
        libc = getattr(self, "_libc", None)
        if libc is not None:
            libc.munmap(self.base, self.total)
