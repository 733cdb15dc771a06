"""Shared test fixtures: repo paths, the shared corpora, environment for subprocesses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO.parent / "shared" / "corpora"
PY = sys.executable

# No hub access anywhere in the tests: everything is built from configs and trained locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def require_corpora() -> Path:
    """The shared real-text corpora (beside the checkout here and in CI, not on users'
    machines); skips the calling test with the reason when they are absent."""
    if not (CORPORA / "tinyshakespeare.txt").is_file():
        pytest.skip(f"shared corpora not found at {CORPORA} (they exist beside the checkout only)")
    return CORPORA


@pytest.fixture
def corpora() -> Path:
    """The shared real-text corpora, or a skip."""
    return require_corpora()


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for stage subprocesses: offline, CPU DeepSpeed, the repo importable."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        DS_ACCELERATOR="cpu",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env
