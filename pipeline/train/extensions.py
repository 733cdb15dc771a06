"""DeepSpeed's JIT-built ops, loaded so that one killed process cannot hang every later one.

``torch.utils.cpp_extension.load`` guards every load of a JIT extension (a build, or only
ninja's check that nothing changed, ~10 ms) with a lock *file* in the build directory
(``FileBaton``: created with ``O_EXCL``, removed at the end). A process killed in between, by
SIGKILL, by Slurm at the time limit or by torchrun's SIGTERM to the siblings of a failed rank,
leaves the file behind, and every later process that loads that extension waits for it to go
away: forever, silently. DeepSpeed loads its CPU communication op in every process that sets up
``deepspeed.comm`` and its Adam op in every engine, so one stale file stops every DeepSpeed job
of the user (our CI saw it: every DeepSpeed test hung on a ``lock`` left in
``~/.cache/torch_extensions``). The first build of an op takes a minute (CPU) to several (CUDA),
a wide window for a requeue or a failed sibling to kill a process in.

:func:`guard_extension_loads` wraps ``torch.utils.cpp_extension.load`` (which DeepSpeed's
``OpBuilder.jit_load`` calls) so that a zerosnake process loads an extension holding an
``flock`` on ``zerosnake.lock`` beside torch's file. The kernel drops an ``flock`` with its
process, so this lock cannot go stale; holding it, a torch lock file found was left by a process
that died loading the extension, unless a process outside zerosnake is building it right now,
which shows as a process working in the build directory (torch runs ninja there). A stale file
is removed, with a warning naming it; a live build is waited for, as torch would. Where the
filesystem has no ``flock`` (Lustre mounted without ``-o flock``), only a torch lock file older
than :data:`STALE_AFTER_S` with no build seen is taken as stale.

Ops installed prebuilt (``DS_BUILD_OPS=1 pip install deepspeed``) never reach this path: for
many ranks on a shared home that is the faster set-up anyway (no ninja check per process).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

#: Without ``flock``: a torch lock file this old, with no build running on this node, is stale
#: (the slowest first build of a DeepSpeed op, CUDA's fused Adam on a busy login node, takes a
#: few minutes).
STALE_AFTER_S = 900.0

#: Our lock file, beside torch's ``lock`` in the extension's build directory.
GUARD_NAME = "zerosnake.lock"

#: ``flock`` errors that mean "this filesystem cannot lock", not "someone holds it".
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def builders_in(build_dir: Path) -> list[int]:
    """Processes (other than this one) whose working directory is ``build_dir``: a build in
    progress there, as torch runs ninja (and ninja the compiler) in the build directory. Only
    this node's processes can be seen; ``/proc`` entries that vanish or that this user may not
    read are skipped."""
    target = os.path.realpath(build_dir)
    found: list[int] = []
    if not os.path.isdir("/proc"):  # not Linux: no process is known to build
        return found
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/cwd") == target:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def clear_stale_lock(build_dir: Path, *, exclusive: bool) -> bool:
    """Remove torch's ``lock`` in ``build_dir`` if it is stale; True if one was removed.

    ``exclusive``: the caller holds :data:`GUARD_NAME`'s ``flock``, so no zerosnake process is
    loading this extension and the file is stale unless a build runs here; without it the file
    must also be :data:`STALE_AFTER_S` old."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if not exclusive and age < STALE_AFTER_S:
        return False
    pids = builders_in(build_dir)
    if pids:
        log.warning("waiting for %s: a build of this extension is running in it (pids %s)",
                    lock, ", ".join(map(str, pids)))
        return False
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    log.warning("removed %s (%.0f s old): left by a process killed while it loaded this "
                "extension; no process is building it, and torch would wait for it forever",
                lock, age)
    return True


@contextlib.contextmanager
def extension_guard(build_dir: Path) -> Iterator[None]:
    """Hold :data:`GUARD_NAME`'s ``flock`` in ``build_dir`` (blocking), a stale torch lock file
    removed first. Held only while torch checks or builds the extension: never across a
    collective, where a rank waiting for it would stall the rank holding it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / GUARD_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                raise
            locked = False
        clear_stale_lock(build_dir, exclusive=locked)
        yield
    finally:
        os.close(fd)  # drops the flock


def _build_directory(name: str, kwargs: dict[str, Any]) -> Path | None:
    """Where torch builds extension ``name``: its ``build_directory`` argument, else torch's own
    choice (``TORCH_EXTENSIONS_DIR`` or the user's cache, per Python and accelerator; a private
    function of torch's, so None where a future torch lacks it and the load goes unguarded)."""
    if kwargs.get("build_directory"):
        return Path(kwargs["build_directory"])
    from torch.utils import cpp_extension

    find = getattr(cpp_extension, "_get_build_directory", None)
    return Path(find(name, False)) if find is not None else None


def guard_extension_loads() -> None:
    """Make this process's ``torch.utils.cpp_extension.load`` calls go through
    :func:`extension_guard` (idempotent)."""
    from torch.utils import cpp_extension

    load: Callable[..., Any] = cpp_extension.load
    if getattr(load, "_zerosnake_guarded", False):
        return

    @functools.wraps(load)
    def guarded(name: str, *args: Any, **kwargs: Any) -> Any:
        build_dir = _build_directory(name, kwargs)
        if build_dir is None:
            return load(name, *args, **kwargs)
        with extension_guard(build_dir):
            return load(name, *args, **kwargs)

    guarded._zerosnake_guarded = True  # type: ignore[attr-defined]
    cpp_extension.load = guarded


def import_deepspeed() -> ModuleType:
    """``deepspeed``, with its JIT op loads guarded: every zerosnake process that uses
    DeepSpeed imports it through here before DeepSpeed loads an op."""
    guard_extension_loads()
    import deepspeed

    return deepspeed
