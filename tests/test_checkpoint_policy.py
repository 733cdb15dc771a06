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
    # The damaged one is moved aside, whole, never deleted; no reader takes it any more.
    (aside,) = ck.damaged_aside(root)
    assert aside.name.startswith("step-000009.damaged-")
    assert (aside / "weights.bin").read_bytes() == b"torn"
    assert [s for s, _ in checkpoint_steps(root)] == [3, 6]


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


def test_a_second_config_change_keeps_the_first_moved_aside(tmp_path):
    root = tmp_path / "checkpoints"
    for _ in range(2):
        save(root, 3, chash="0123456789abcdef")
        assert ck.resume_point(root, "other", "data") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoints.old-0123456789ab", "checkpoints.old-0123456789ab-2"]


def test_saving_a_step_again_moves_the_old_folder_aside(tmp_path):
    """A folder of the step being saved that resume did not take (damaged; a person's file
    inside) is moved aside, never deleted; a link in its place is moved, its target kept."""
    root = tmp_path / "checkpoints"
    save(root, 3)
    (ck.step_dir(root, 3) / "notes.txt").write_text("mine")
    save(root, 3)
    (aside,) = ck.damaged_aside(root)
    assert (aside / "notes.txt").read_text() == "mine"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    ck.step_dir(root, 6).symlink_to(elsewhere, target_is_directory=True)
    assert save(root, 6) == ck.step_dir(root, 6)  # saving that step succeeds
    assert not ck.step_dir(root, 6).is_symlink()
    assert (elsewhere / "keep.txt").read_text() == "keep"
    assert any(p.is_symlink() for p in ck.damaged_aside(root))


def test_prune_deletes_only_what_the_trainer_wrote(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 1)
    save(root, 2)
    (ck.step_dir(root, 1) / "thesis.tex").write_text("years of work")
    for step in (3, 4):
        save(root, step, keep=2)
    assert [s for s, _ in checkpoint_steps(root)] == [3, 4]
    assert not ck.step_dir(root, 2).exists()  # the trainer's own: removed
    (aside,) = ck.damaged_aside(root)
    assert (aside / "thesis.tex").read_text() == "years of work"


def test_a_linked_tmp_folder_is_unlinked_not_followed(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    (target / "data").write_text("x")
    ck.tmp_dir(root, 5).symlink_to(target, target_is_directory=True)
    ck.clean_tmp(root)
    assert not ck.tmp_dir(root, 5).is_symlink() and (target / "data").read_text() == "x"


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
