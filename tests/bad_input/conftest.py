"""The bad-input suite's one shape of assertion: a user's mistake (or a hostile input) gives a
non-zero exit status, one message that names the key or file, no traceback, and every file
around it exactly as it was.

Each module here is one class of input (config, sources, tokenizer, artifacts, run files,
checkpoints, command lines, paths). A case runs the real command (``python -m
pipeline.<stage> ...``, or Snakemake) in a subprocess and checks it with :func:`assert_refused`.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import PY, REPO, subprocess_env

__all__ = ["PY", "REPO", "assert_refused", "run", "snapshot"]


def run(argv: Sequence[str], cwd: Path, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    """``python <argv>`` (e.g. ``["-m", "pipeline.consolidate", ...]``) in ``cwd``."""
    return subprocess.run([PY, *argv], cwd=cwd, capture_output=True, text=True,
                          env=subprocess_env(**env), timeout=timeout)


def snapshot(*roots: Path) -> dict[str, tuple[int, str]]:
    """Every file and folder under ``roots``: path → (size, sha256); folders as (-1, "")."""
    out: dict[str, tuple[int, str]] = {}
    for root in roots:
        if not root.exists():
            continue
        paths = [root, *root.rglob("*")] if root.is_dir() else [root]
        for p in paths:
            if p.is_symlink():
                out[str(p)] = (-2, str(p.readlink()))
            elif p.is_dir():
                out[str(p)] = (-1, "")
            else:
                out[str(p)] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def assert_refused(res: subprocess.CompletedProcess, *needles: str,
                   before: dict[str, tuple[int, str]] | None = None,
                   roots: Sequence[Path] = ()) -> None:
    """The command failed cleanly: exit status ≠ 0, every needle in its message (the key or file
    and what to do), no Python traceback, and (with ``before``) the files under ``roots``
    unchanged."""
    text = res.stderr + res.stdout
    assert res.returncode != 0, f"exit status 0 for a bad input:\n{text[-3000:]}"
    assert "Traceback (most recent call last)" not in text, f"a traceback:\n{text[-3000:]}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in the message:\n{text[-3000:]}"
    if before is not None:
        after = snapshot(*roots)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        assert not changed, f"files changed by a refused command: {changed[:10]}"


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A data directory (tokenizer, shards, manifest) and a run directory, built once per
    module (tests/bad_input/tiny_data.py)."""
    from tests.bad_input.tiny_data import build_data, build_run

    root = tmp_path_factory.mktemp("ws")
    build_data(root)
    build_run(root)
    return root
