"""Outputs and inputs that belong to another run: a command replaces a folder only where its
own marker names the same run, and consolidates or evaluates only this run's checkpoint.

Cases by class (8): another run's output in the way (consolidate ``--out`` 3: a marker naming
another run, a marker that is not a record, a linked marker; evaluate ``--out`` 1); another
run's model or checkpoint given as this run's (evaluate ``--model`` of another run 1, of this
run's name with another config 1; consolidate of a checkpoint trained with another config 1,
over another dataset 1). Each is refused before any work, naming the folder or file, with
every file around it unchanged (``assert_refused``). The checkpoint cases write a checkpoint
folder with the trainer's own writer (``finalize``) into a rendered run: no training.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.artifacts import CKPT_TRAINER, DATA_MANIFEST, TRAIN_DONE
from pipeline.checkpoint import format as ck
from pipeline.config.files import load_run_config
from pipeline.io import sha256_file
from tests.bad_input.conftest import REPO, assert_refused, run, snapshot


@pytest.fixture(scope="module")
def rendered(ws: Path) -> Path:
    """The default config's ``fsdp`` run rendered over the tiny data (no training)."""
    out = ws / "rendered" / "fsdp"
    res = run(["-m", "pipeline.render", "--config", str(REPO / "config" / "config.yaml"),
               "--run", "fsdp", "--out", str(out), "--data-manifest",
               str(ws / "data" / DATA_MANIFEST)], ws)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def _run_copy(rendered: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "fsdp"
    shutil.copytree(rendered, run_dir)
    return run_dir


def _checkpoint(run_dir: Path, data: Path, *, chash: str | None = None,
                data_hash: str | None = None) -> Path:
    """A complete checkpoint folder written by the trainer's writer, and train.done naming it;
    by default with this run's config hash and data hash."""
    root = run_dir / "checkpoints"
    tmp = ck.tmp_dir(root, 4)
    tmp.mkdir(parents=True)
    (tmp / CKPT_TRAINER).write_text('{"step": 4}')
    meta = {"config_hash": chash or ck.config_hash(load_run_config(run_dir / "config.json")),
            "data_manifest_sha256": data_hash or sha256_file(data / DATA_MANIFEST)}
    path = ck.finalize(root, 4, meta, keep_last=2)
    (run_dir / TRAIN_DONE).write_text(json.dumps({"step": 4, "checkpoint": path.name}))
    return path


def _consolidate(run_dir: Path, data: Path, out: Path):
    return run(["-m", "pipeline.consolidate", "--run-dir", str(run_dir), "--data-dir", str(data),
                "--out", str(out)], run_dir.parent)


@pytest.mark.parametrize("marker", ['{"run": "other", "step": 9}', "[1, 2]", "link"])
def test_consolidate_never_replaces_another_runs_hf(marker, ws, rendered, tmp_path) -> None:
    run_dir = _run_copy(rendered, tmp_path)
    other = tmp_path / "runs" / "other" / "hf"
    other.mkdir(parents=True)
    (other / "model.safetensors").write_bytes(b"their weights")
    if marker == "link":
        (tmp_path / "mine.json").write_text('{"run": "fsdp"}')
        (other / "zerosnake.json").symlink_to(tmp_path / "mine.json")
    else:
        (other / "zerosnake.json").write_text(marker)
    before = snapshot(tmp_path / "runs")
    res = _consolidate(run_dir, ws / "data", other)
    assert_refused(res, str(other), before=before, roots=[tmp_path / "runs"])
    if marker.startswith("{"):
        assert "run 'other'" in res.stderr


def test_consolidate_refuses_a_checkpoint_of_another_config(ws, rendered, tmp_path) -> None:
    run_dir = _run_copy(rendered, tmp_path)
    ckpt = _checkpoint(run_dir, ws / "data", chash="f" * 64)
    before = snapshot(run_dir)
    res = _consolidate(run_dir, ws / "data", run_dir / "hf")
    assert_refused(res, str(ckpt), "another config", "config.json", before=before,
                   roots=[run_dir])


def test_consolidate_refuses_a_checkpoint_over_other_data(ws, rendered, tmp_path) -> None:
    run_dir = _run_copy(rendered, tmp_path)
    _checkpoint(run_dir, ws / "data", data_hash="e" * 64)
    before = snapshot(run_dir)
    res = _consolidate(run_dir, ws / "data", run_dir / "hf")
    assert_refused(res, "another tokenized dataset", "--data-dir", before=before,
                   roots=[run_dir])


def _model_dir(tmp_path: Path, record: dict) -> Path:
    """What evaluate checks before it loads anything: an HF config and the consolidation
    record (the weights are never reached when the record is refused)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "zerosnake.json").write_text(json.dumps(
        {"step": 4, "checkpoint": "step-000004", "checkpoint_manifest_sha256": "0" * 64,
         **record}))
    return model


def _evaluate(model: Path, ws: Path, run_dir: Path, out: Path):
    return run(["-m", "pipeline.evaluate", "--model", str(model), "--data-dir", str(ws / "data"),
                "--run-dir", str(run_dir), "--out", str(out)], run_dir.parent)


def test_evaluate_refuses_a_model_of_another_run(ws, rendered, tmp_path) -> None:
    run_dir = _run_copy(rendered, tmp_path)
    model = _model_dir(tmp_path, {"run": "other"})
    before = snapshot(tmp_path)
    res = _evaluate(model, ws, run_dir, run_dir / "eval")
    assert_refused(res, "consolidated from run 'other'", str(run_dir), before=before,
                   roots=[tmp_path])


def test_evaluate_refuses_a_model_trained_with_another_config(ws, rendered, tmp_path) -> None:
    run_dir = _run_copy(rendered, tmp_path)
    model = _model_dir(tmp_path, {"run": "fsdp", "config_hash": "a" * 64})
    before = snapshot(tmp_path)
    res = _evaluate(model, ws, run_dir, run_dir / "eval")
    assert_refused(res, "another config", "config.json", before=before, roots=[tmp_path])


def test_evaluate_never_replaces_another_runs_eval(ws, rendered, tmp_path) -> None:
    run_dir = _run_copy(rendered, tmp_path)
    model = _model_dir(tmp_path, {"run": "fsdp"})
    theirs = tmp_path / "runs" / "other" / "eval"
    theirs.mkdir(parents=True)
    (theirs / ".zerosnake-eval").write_text('{"written_by": "evaluate", "run": "other"}\n')
    (theirs / "metrics.json").write_text('{"bits_per_byte": 1.5}')
    before = snapshot(tmp_path)
    res = _evaluate(model, ws, run_dir, theirs)
    assert_refused(res, "--out", str(theirs), "run 'other'", before=before, roots=[tmp_path])
