"""The checkpoint manager's resume-point choice (pipeline.checkpoint.format.resume_point), on
checkpoint folders written with the real finalize (no torch, no process group)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.artifacts import CKPT_TRAINER, checkpoint_steps
from pipeline.checkpoint import format as ck
from pipeline.errors import PipelineError


def save(root: Path, step: int, *, chash: str = "cfg", data: str = "data", keep: int = 5) -> Path:
    tmp = ck.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / CKPT_TRAINER).write_text(f'{{"step": {step}}}')
    (tmp / "weights.bin").write_bytes(bytes([step]) * 64)
    return ck.finalize(root, step, {"config_hash": chash, "data_manifest_sha256": data}, keep)


def test_no_checkpoints_means_a_fresh_start(tmp_path):
    assert ck.resume_point(tmp_path / "checkpoints", "cfg", "data") is None


def test_the_newest_checkpoint_that_verifies_is_chosen(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (3, 6, 9):
        save(root, step)
    assert ck.resume_point(root, "cfg", "data") == (9, ck.step_dir(root, 9))
    (ck.step_dir(root, 9) / "weights.bin").write_bytes(b"torn")  # a truncated file
    ck.tmp_dir(root, 12).mkdir()  # a save that never finished
    assert ck.resume_point(root, "cfg", "data") == (6, ck.step_dir(root, 6))


def test_checkpoints_over_other_data_are_an_error(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 3, data="old-data")
    with pytest.raises(PipelineError, match="trained on another tokenized dataset"):
        ck.resume_point(root, "cfg", "new-data")
    assert checkpoint_steps(root)  # nothing was moved or removed


def test_checkpoints_of_another_config_are_moved_aside(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 3, chash="0123456789abcdef")
    assert ck.resume_point(root, "other", "data") is None
    assert not root.exists()
    aside = tmp_path / "checkpoints.old-0123456789ab"
    assert [s for s, _ in checkpoint_steps(aside)] == [3]


def test_finalize_prunes_to_keep_last(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        save(root, step, keep=2)
    assert [s for s, _ in checkpoint_steps(root)] == [3, 4]
    assert ck.prune(root, 1) == [ck.step_dir(root, 3)]
    assert ck.prune(root, 0) == []  # 0 keeps everything (as finalize always did)


def test_the_checkpoint_module_imports_without_torch():
    import subprocess

    code = "import sys, pipeline.checkpoint.format; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
