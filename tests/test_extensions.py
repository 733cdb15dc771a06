"""pipeline.train.extensions: a lock file left by a process killed while it loaded a JIT op
does not hang the next DeepSpeed job, and a live load or build is never disturbed.

The stale file is planted, not caused: it is exactly what a process killed inside torch's
``FileBaton`` leaves (an empty ``lock`` in the build directory), and killing one inside a
10 ms window on purpose would be a race. Everything else is real: DeepSpeed's own op builders
load its compiled CPU ops through torch under the guard.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pipeline.train import extensions
from tests.conftest import PY, REPO, subprocess_env

#: DeepSpeed's CPU ops a DeepSpeed engine loads: its Adam and deepspeed.comm's shared-memory op.
BUILDERS = {"fused_adam": "FusedAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}

_LOAD_OPS = r"""
import sys
from pipeline.train.extensions import import_deepspeed

import_deepspeed()
from deepspeed.accelerator import get_accelerator
from torch.utils.cpp_extension import _get_build_directory

for name in sys.argv[1:]:
    get_accelerator().create_op_builder(name).load(verbose=False)
print("BUILT", _get_build_directory("fused_adam", False))
"""


def _load_ops(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", _LOAD_OPS, *BUILDERS.values()], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_stale_torch_lock_does_not_hang_deepspeeds_op_loads(tmp_path: Path) -> None:
    # The ops as the other DeepSpeed tests use them (built once per machine in the user's
    # cache: the first time, a minute or two), copied into an extensions dir of this test's own.
    res = _load_ops(subprocess_env())
    assert res.returncode == 0, res.stderr[-3000:]
    cache = Path(res.stdout.split("BUILT ", 1)[1].strip()).parent
    own = tmp_path / "torch_extensions"
    for name in BUILDERS:
        shutil.copytree(cache / name, own / name, ignore=shutil.ignore_patterns(
            "lock", extensions.GUARD_NAME))
        # What a process killed between torch's try_acquire and release leaves behind.
        (own / name / "lock").touch()
    res = _load_ops(subprocess_env(TORCH_EXTENSIONS_DIR=str(own)))
    # Unguarded, torch's FileBaton.wait polls for these files forever (the subprocess timeout).
    assert res.returncode == 0, res.stderr[-3000:]
    for name in BUILDERS:
        assert not (own / name / "lock").exists()
        assert f"removed {own / name / 'lock'}" in res.stderr, res.stderr[-3000:]
    assert (own / "fused_adam" / "fused_adam.so").stat().st_mtime == (
        cache / "fused_adam" / "fused_adam.so").stat().st_mtime  # loaded, not rebuilt


def test_a_lock_file_with_a_build_running_in_its_directory_is_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    build = subprocess.Popen(["sleep", "60"], cwd=tmp_path)  # as ninja runs in the build dir
    try:
        assert extensions.builders_in(tmp_path) == [build.pid]
        assert not extensions.clear_stale_lock(tmp_path, exclusive=True)
        assert lock.exists()
    finally:
        build.kill()
        build.wait()
    assert extensions.builders_in(tmp_path) == []
    assert extensions.clear_stale_lock(tmp_path, exclusive=True)
    assert not lock.exists()


def test_without_flock_only_an_old_lock_file_is_stale(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    assert not extensions.clear_stale_lock(tmp_path, exclusive=False)
    assert lock.exists()
    old = time.time() - extensions.STALE_AFTER_S - 1
    os.utime(lock, (old, old))
    assert extensions.clear_stale_lock(tmp_path, exclusive=False)
    assert not lock.exists()


def test_a_lock_file_of_a_load_in_progress_is_waited_for(tmp_path: Path) -> None:
    # Another zerosnake process inside torch's load: it holds the guard's flock and torch's
    # lock file. A second loader waits for the flock and leaves the file alone.
    holder = subprocess.Popen(
        [PY, "-c", "import fcntl, os, sys\n"
                   f"fd = os.open({str(tmp_path / extensions.GUARD_NAME)!r}, os.O_RDWR | os.O_CREAT)\n"
                   "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                   f"open({str(tmp_path / 'lock')!r}, 'x').close()\n"
                   "print('held', flush=True)\n"
                   "sys.stdin.read()\n"
                   f"os.unlink({str(tmp_path / 'lock')!r})\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def second_loader() -> None:
            with extensions.extension_guard(tmp_path):
                entered.set()

        thread = threading.Thread(target=second_loader, daemon=True)
        thread.start()
        thread.join(timeout=1.0)
        assert not entered.is_set() and (tmp_path / "lock").exists()
        holder.stdin.close()  # the first load ends: torch removes its file, the flock goes
        thread.join(timeout=30)
        assert entered.is_set()
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "lock").exists()


def test_the_guard_wraps_torchs_load_once() -> None:
    from torch.utils import cpp_extension

    extensions.guard_extension_loads()
    first = cpp_extension.load
    extensions.guard_extension_loads()
    assert cpp_extension.load is first and first._zerosnake_guarded
