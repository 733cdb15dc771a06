"""Bad and hostile artifacts: a data manifest cut short, edited or pointing outside its folder,
tampered shards, corrupt shard stats files, torn metrics lines, malformed consolidation records
and model folders, malformed run directories. A stage refuses each with one line naming the
file (and the key), no traceback and nothing changed; evaluate finishes over a torn
metrics.jsonl, and status shows every other run when one is malformed. A manifest's numbers
are bounded: a vocabulary or sequence length past the pipeline's limit is the manifest's fault,
never the GPU memory's.

Cases: 15 data manifests (2 of them claiming sizes of 10^12), 2 shards, 6 shard stats files
(gather), 6 metrics files and model folders (evaluate), 3 run directories (status); the run
files read by report, status and a resume are tests/bad_input/test_run_file_inputs.py's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.bad_input.conftest import REPO, assert_refused, run, snapshot
from tests.bad_input.tiny_data import build_hf


@pytest.fixture(scope="module")
def hf(ws: Path) -> Path:
    """A tiny consolidated model trained on nothing (evaluate only needs it to load)."""
    return build_hf(ws / "hf", ws / "data" / "tokenizer")


@pytest.fixture
def data(ws: Path, tmp_path: Path) -> Path:
    """This test's own copy of the data directory (to damage)."""
    return Path(shutil.copytree(ws / "data", tmp_path / "data"))


@pytest.fixture
def run_dir(ws: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ws / "runs" / "r", tmp_path / "runs" / "r"))


@pytest.fixture
def fake_hf(tmp_path: Path) -> Path:
    """A model folder that passes evaluate's first checks (it fails on the data first)."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}\n")
    (d / "zerosnake.json").write_text(json.dumps(
        {"step": 2, "checkpoint_manifest_sha256": "0" * 64}) + "\n")
    return d


def _evaluate(cwd: Path, model: Path, data: Path, run_dir: Path, out: Path | None = None):
    out = out if out is not None else run_dir / "eval"
    return run(["-m", "pipeline.evaluate", "--model", str(model), "--data-dir", str(data),
                "--run-dir", str(run_dir), "--out", str(out)], cwd)


def _edit_manifest(data: Path, edit) -> None:
    m = json.loads((data / "manifest.json").read_text())
    edit(m)
    (data / "manifest.json").write_text(json.dumps(m))


def _manifest_case(tmp_path: Path, data: Path, run_dir: Path, fake_hf: Path, *needles: str):
    before = snapshot(tmp_path)
    assert_refused(_evaluate(tmp_path, fake_hf, data, run_dir), "manifest.json", *needles,
                   before=before, roots=[tmp_path])


# --- the data manifest -----------------------------------------------------------------------


def test_manifest_that_is_not_json(tmp_path, data, run_dir, fake_hf) -> None:
    (data / "manifest.json").write_text('{"format": 1, "seq_len": 16, "tokeni')
    _manifest_case(tmp_path, data, run_dir, fake_hf, "unreadable", "tokenize")


def test_manifest_that_is_a_list(tmp_path, data, run_dir, fake_hf) -> None:
    (data / "manifest.json").write_text("[1, 2, 3]\n")
    _manifest_case(tmp_path, data, run_dir, fake_hf, "not a JSON object")


def test_manifest_nested_too_deep(tmp_path, data, run_dir, fake_hf) -> None:
    (data / "manifest.json").write_text("[" * 200_000)
    _manifest_case(tmp_path, data, run_dir, fake_hf, "unreadable")


def test_manifest_without_seq_len(tmp_path, data, run_dir, fake_hf) -> None:
    _edit_manifest(data, lambda m: m.pop("seq_len"))
    _manifest_case(tmp_path, data, run_dir, fake_hf, "'seq_len'", "gather")


def test_manifest_without_the_validation_split(tmp_path, data, run_dir, fake_hf) -> None:
    _edit_manifest(data, lambda m: m["splits"].pop("validation"))
    _manifest_case(tmp_path, data, run_dir, fake_hf, "'splits.validation'")


def test_manifest_shard_entry_that_is_not_an_object(tmp_path, data, run_dir, fake_hf) -> None:
    _edit_manifest(data, lambda m: m["splits"]["validation"]["shards"].__setitem__(0, "x.arrow"))
    _manifest_case(tmp_path, data, run_dir, fake_hf, "'splits.validation.shards[0]'")


def test_manifest_shard_without_sha256(tmp_path, data, run_dir, fake_hf) -> None:
    _edit_manifest(data, lambda m: m["splits"]["validation"]["shards"][0].pop("sha256"))
    _manifest_case(tmp_path, data, run_dir, fake_hf, "'splits.validation.shards[0].sha256'")


@pytest.mark.parametrize("path", ["../../outside.arrow", "/etc/passwd",
                                  "shards/../../data-elsewhere/x.arrow"])
def test_manifest_shard_path_leaving_the_data_dir(tmp_path, data, run_dir, fake_hf,
                                                   path: str) -> None:
    def edit(m):
        m["splits"]["validation"]["shards"][0]["path"] = path

    _edit_manifest(data, edit)
    before = snapshot(tmp_path)
    assert_refused(_evaluate(tmp_path, fake_hf, data, run_dir), repr(path), "leaves",
                   before=before, roots=[tmp_path])


def test_manifest_with_an_empty_validation_split(tmp_path, data, run_dir, fake_hf) -> None:
    def edit(m):
        m["splits"]["validation"]["shards"] = []

    _edit_manifest(data, edit)
    before = snapshot(tmp_path)
    assert_refused(_evaluate(tmp_path, fake_hf, data, run_dir), "validation split",
                   "no sequences", "val_fraction", before=before, roots=[tmp_path])


def test_manifest_without_tokenizer_is_refused_by_render(tmp_path, data) -> None:
    _edit_manifest(data, lambda m: m.pop("tokenizer"))
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.render", "--config", str(REPO / "config" / "config.yaml"),
               "--run", "fsdp", "--out", str(tmp_path / "runs" / "fsdp"),
               "--data-manifest", str(data / "manifest.json")], tmp_path)
    assert_refused(res, "manifest.json", "'tokenizer'", before=before, roots=[tmp_path])


def test_manifest_eos_beyond_the_vocabulary_is_refused_by_render(tmp_path, data) -> None:
    _edit_manifest(data, lambda m: m["tokenizer"].__setitem__("eos_id", 10**6))
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.render", "--config", str(REPO / "config" / "config.yaml"),
               "--run", "fsdp", "--out", str(tmp_path / "runs" / "fsdp"),
               "--data-manifest", str(data / "manifest.json")], tmp_path)
    assert_refused(res, "manifest.json", "'tokenizer.eos_id'", before=before, roots=[tmp_path])


def test_manifest_claiming_a_vocabulary_of_1e12_is_blamed_on_the_manifest(tmp_path, data) -> None:
    # Not on cluster.gpu_mem_gb: the planner never sizes a model for it.
    _edit_manifest(data, lambda m: m["tokenizer"].__setitem__("vocab_size", 10**12))
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.render", "--config", str(REPO / "config" / "config.yaml"),
               "--run", "fsdp", "--out", str(tmp_path / "runs" / "fsdp"),
               "--data-manifest", str(data / "manifest.json")], tmp_path)
    assert_refused(res, "manifest.json", "vocabulary", "1,000,000,000,000", "tokenize again",
                   before=before, roots=[tmp_path])
    assert "gpu_mem_gb" not in res.stderr


def test_manifest_claiming_rows_of_1e12_tokens_is_refused_by_evaluate(
        tmp_path, data, run_dir, fake_hf) -> None:
    _edit_manifest(data, lambda m: m.__setitem__("seq_len", 10**12))
    _manifest_case(tmp_path, data, run_dir, fake_hf, "sequence length", "1,000,000,000,000")


# --- shards ----------------------------------------------------------------------------------


def test_truncated_shard(tmp_path, data, run_dir, fake_hf) -> None:
    shard = data / "shards" / "validation" / "shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:-100])
    before = snapshot(tmp_path)
    assert_refused(_evaluate(tmp_path, fake_hf, data, run_dir), "shard-00000.arrow",
                   "truncated", before=before, roots=[tmp_path])


def test_shard_replaced_by_other_bytes_of_the_same_size(tmp_path, data, run_dir, fake_hf) -> None:
    shard = data / "shards" / "validation" / "shard-00000.arrow"
    shard.write_bytes(bytes(shard.stat().st_size))
    before = snapshot(tmp_path)
    assert_refused(_evaluate(tmp_path, fake_hf, data, run_dir), "shard-00000.arrow", "sha256",
                   before=before, roots=[tmp_path])


# --- shard stats files (gather) --------------------------------------------------------------


def _gather(cwd: Path, data: Path):
    return run(["-m", "pipeline.tokenize", "gather", "--out", str(data), "--shards", "1",
                "--tokenizer", str(data / "tokenizer")], cwd)


def _stats_case(tmp_path: Path, data: Path, content: str, *needles: str) -> None:
    (data / "shards" / "shard-00000.stats.json").write_text(content)
    before = snapshot(tmp_path)
    assert_refused(_gather(tmp_path, data), "shard-00000.stats.json", *needles,
                   before=before, roots=[tmp_path])


def _stats(data: Path) -> dict:
    return json.loads((data / "shards" / "shard-00000.stats.json").read_text())


def test_stats_file_that_is_not_json(tmp_path, data) -> None:
    _stats_case(tmp_path, data, '{"format": 1, "shard": 0, "opt', "unreadable", "rerun shard")


def test_stats_file_that_is_empty(tmp_path, data) -> None:
    _stats_case(tmp_path, data, "", "unreadable", "--shard 0")


def test_stats_file_without_splits(tmp_path, data) -> None:
    st = _stats(data)
    del st["splits"]
    _stats_case(tmp_path, data, json.dumps(st), "malformed", "rerun shard")


def test_stats_file_with_a_string_count(tmp_path, data) -> None:
    st = _stats(data)
    st["splits"]["train"]["sequences"] = "many"
    _stats_case(tmp_path, data, json.dumps(st), "malformed")


def test_stats_file_path_leaving_the_data_dir(tmp_path, data) -> None:
    st = _stats(data)
    st["splits"]["train"]["path"] = "../../../etc/hostname"
    _stats_case(tmp_path, data, json.dumps(st), "leaves")


def test_gather_with_a_shard_file_missing(tmp_path, data) -> None:
    (data / "shards" / "train" / "shard-00000.arrow").unlink()
    before = snapshot(tmp_path)
    assert_refused(_gather(tmp_path, data), "shard-00000.arrow", "rerun shard 0",
                   before=before, roots=[tmp_path])


# --- metrics and the consolidated model (evaluate) -------------------------------------------


def test_evaluate_finishes_over_a_torn_metrics_line(tmp_path, ws, hf, run_dir) -> None:
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 2.5, "lr": 0.001, "tok')  # the crash cut this line
    res = _evaluate(tmp_path, hf, ws / "data", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    report = (run_dir / "eval" / "report.md").read_text()
    assert "Final training loss 4.0000 at step 2" in report  # the last whole record
    assert json.loads((run_dir / "eval" / "metrics.json").read_text())["step"] == 2


def test_evaluate_skips_metrics_records_without_numbers(tmp_path, ws, hf, run_dir) -> None:
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": "3", "loss": 1}\n{"step": 4, "loss": null, "lr": 1}\n[1, 2]\n'
                '{"step": 5, "loss": "NaN", "lr": 0.1, "tokens_seen": 1, "tokens_per_s": 1}\n')
    res = _evaluate(tmp_path, hf, ws / "data", run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Final training loss 4.0000" in (run_dir / "eval" / "report.md").read_text()


def test_model_folder_with_corrupt_weights(tmp_path, ws, hf, run_dir) -> None:
    model = Path(shutil.copytree(hf, tmp_path / "hf"))
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    before = snapshot(tmp_path)
    assert_refused(_evaluate(tmp_path, model, ws / "data", run_dir), "hf",
                   "does not load", "consolidate", before=before, roots=[tmp_path])


def test_model_with_another_tokenizer_than_the_data(tmp_path, data, run_dir, fake_hf) -> None:
    spec = json.loads((data / "tokenizer" / "tokenizer.json").read_text())
    spec["model"]["vocab"]["zzz-other"] = spec["model"]["vocab"].pop("Ġthe", 299)
    (fake_hf / "tokenizer.json").write_text(json.dumps(spec))
    before = snapshot(tmp_path)
    assert_refused(_evaluate(tmp_path, fake_hf, data, run_dir), "another tokenizer",
                   "--data-dir", before=before, roots=[tmp_path])


def test_model_folder_without_its_consolidation_record(tmp_path, data, run_dir, fake_hf) -> None:
    (fake_hf / "zerosnake.json").unlink()
    before = snapshot(tmp_path)
    assert_refused(_evaluate(tmp_path, fake_hf, data, run_dir), "zerosnake.json",
                   "consolidate", before=before, roots=[tmp_path])


def test_consolidation_record_without_a_step(tmp_path, data, run_dir, fake_hf) -> None:
    (fake_hf / "zerosnake.json").write_text('{"step": "last"}\n')
    before = snapshot(tmp_path)
    assert_refused(_evaluate(tmp_path, fake_hf, data, run_dir), "zerosnake.json", "step",
                   before=before, roots=[tmp_path])


# --- run directories (status) ----------------------------------------------------------------


def _status(results: Path) -> subprocess.CompletedProcess:
    return run(["-m", "pipeline.status", "--results", str(results)], results, timeout=60)


def test_status_shows_every_run_beside_malformed_ones(ws: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(ws / "runs", results / "runs")
    deep = results / "runs" / "deep"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 200_000)
    (deep / "job.json").write_text('{"job_id": "1; rm -rf /", "launcher": "slurm"}')
    (deep / "events.jsonl").write_text("{" * 200_000 + "\n")
    torn = results / "runs" / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_bytes(b'{"step": 1, "tokens_per_s": 5}\n\xff\xfe{"st')
    (torn / "job.json").write_text("[]")
    fifo = results / "runs" / "fifo"
    fifo.mkdir()
    for name in ("metrics.jsonl", "config.json", "job.json", "events.jsonl"):
        os.mkfifo(fifo / name)  # opening one would block forever
    (results / "runs" / "a-file").write_text("not a run")
    roots = [results / "runs" / name for name in ("r", "deep", "torn", "a-file")]  # no FIFOs
    before = snapshot(*roots)
    res = _status(results)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines()[1:]}
    assert set(rows) == {"deep", "fifo", "r", "torn"}
    assert rows["r"][1] == "training" and rows["r"][4] == "2/4" and "step-000002" in rows["r"]
    assert rows["torn"][4] == "1"
    assert snapshot(*roots) == before


def test_status_escapes_control_characters_in_run_names(ws: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "runs" / "evil\x1b[2J\x07").mkdir(parents=True)
    res = _status(results)
    assert res.returncode == 0 and "\x1b" not in res.stdout and "\\x1b[2J" in res.stdout


def test_status_names_an_unreadable_run_and_shows_the_others(
        ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from pipeline import status

    results = tmp_path / "results"
    shutil.copytree(ws / "runs", results / "runs")
    (results / "runs" / "broken").mkdir()
    real = status.run_status

    def flaky(run_dir: Path):
        if run_dir.name == "broken":
            raise OSError(5, "Input/output error", str(run_dir / "metrics.jsonl"))
        return real(run_dir)

    monkeypatch.setattr(status, "run_status", flaky)
    before = snapshot(results)
    rc = status.main(["--results", str(results)])
    out, err = capsys.readouterr()
    res = subprocess.CompletedProcess([], rc, out, err)
    assert_refused(res, "broken", "cannot be read", "Input/output error", before=before,
                   roots=[results])
    assert "r " in out and "training" in out and "unreadable" in out
