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


def consolidated_probe(run_dir: Path, data_dir: Path, out: Path) -> tuple[object, object, dict]:
    """Consolidate a trained run into ``out`` and run its ``from_pretrained`` model on the
    probe batch the trainer saved: ``(model, logits, probe)`` for the caller to compare."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.consolidate import consolidate

    hf = consolidate(run_dir, data_dir, out)
    probe = load_file(str(run_dir / "probe_logits.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager", dtype="auto")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
    return model, logits, probe
