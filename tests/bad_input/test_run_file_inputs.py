"""Bad and hostile run files read by the login node's readers (``pipeline.report``,
``pipeline.status``), by evaluate and by a resume: a mistyped or wrong-shaped
``eval/metrics.json``, ``config.json`` or ``trackers.json`` is refused with one line naming the
file and the field (status shows the run anyway and warns); strings from the files are shown with
their control characters escaped, on the terminal and in report.html; and ``pipeline.report
--out`` replaces only a page it wrote.

Cases: 16 malformed run files (report 9, evaluate 3, a resume's trackers and config 2, status
2), a report over odd metrics and a math-text run name, 5 hostile strings shown (status 3,
report 2), 8 ``report --out`` targets (6 refused, 2 replaced).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.bad_input.conftest import assert_refused, run, snapshot

ESC = "\x1b[2J\x1b]0;pwned\x07"


@pytest.fixture
def results(ws: Path, tmp_path: Path) -> Path:
    """``results/`` holding this test's copy of the run ``r`` (tests/bad_input/tiny_data.py)."""
    shutil.copytree(ws / "runs" / "r", tmp_path / "results" / "runs" / "r")
    return tmp_path / "results"


def _report(results: Path, *extra: str):
    return run(["-m", "pipeline.report", "--results", str(results), *extra], results.parent,
               timeout=120)


def _status(results: Path):
    return run(["-m", "pipeline.status", "--results", str(results)], results.parent, timeout=60)


def _write(path: Path, content: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))


# --- report: eval/metrics.json and config.json, field by field ---------------------------------

REPORT_CASES = [
    ("eval-loss-a-string", "eval/metrics.json", {"loss": "low", "step": 2},
     ("'loss'", "a number", "evaluate the run again")),
    ("eval-a-list", "eval/metrics.json", [1, 2], ("not a JSON object",)),
    ("eval-lm-eval-results-a-list", "eval/metrics.json", {"lm_eval": {"results": ["acc"]}},
     ("'lm_eval.results'", "a JSON object")),
    ("eval-lm-eval-task-a-number", "eval/metrics.json", {"lm_eval": {"results": {"t": 1}}},
     ("'lm_eval.results.t'",)),
    ("eval-mixture-share-a-string", "eval/metrics.json",
     {"mixture": {"code": {"target": "half", "consumed": 0.5}}}, ("'mixture.code.target'",)),
    ("config-nodes-a-string", "config.json", {"cluster": {"nodes": "2"}},
     ("'cluster.nodes'", "a positive integer", "render the run again")),
    ("config-train-a-list", "config.json", {"train": ["fsdp"]}, ("'train'", "a JSON object")),
    ("config-not-json", "config.json", '{"cluster": {"nodes": 1', ("unreadable",)),
    ("config-backend-a-number", "config.json", {"train": {"backend": 3}}, ("'train.backend'",)),
]


@pytest.mark.parametrize(("name", "content", "needles"), [c[1:] for c in REPORT_CASES],
                         ids=[c[0] for c in REPORT_CASES])
def test_report_names_a_malformed_run_file(results: Path, name: str, content: object,
                                           needles: tuple[str, ...]) -> None:
    _write(results / "runs" / "r" / name, content)
    before = snapshot(results.parent)
    assert_refused(_report(results), name, *needles, before=before, roots=[results.parent])


def test_report_draws_runs_with_odd_metrics_and_a_math_text_name(results: Path) -> None:
    # Float token counts (a hand-edited line) and a run name that is matplotlib math text.
    odd = results / "runs" / "$\\frac{$"
    shutil.copytree(results / "runs" / "r", odd)
    with (odd / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 2.0, "tokens_seen": 48.5}) + "\n")
    res = _report(results)
    assert res.returncode == 0, res.stderr[-3000:]
    page = (results / "report.html").read_text()
    assert 'data-run="$\\frac{$"' in page and "<td>32</td>" in page  # the last integer count


# --- evaluate and a resume: checked before any work ------------------------------------------


@pytest.fixture
def fake_hf(tmp_path: Path) -> Path:
    """A model folder that passes evaluate's first checks (it is refused before loading)."""
    d = tmp_path / "hf"
    _write(d / "config.json", {})
    _write(d / "zerosnake.json", {"step": 2, "checkpoint_manifest_sha256": "0" * 64})
    return d


EVALUATE_CASES = [
    ("config-trackers-a-string", "config.json", {"train": {"trackers": "tensorboard"}},
     ("'train.trackers'", "a list of strings")),
    ("trackers-runs-a-list", "trackers.json", {"config_hash": "x", "runs": []},
     ("trackers.json", "'runs'", "a JSON object", "move it aside")),
    ("trackers-mlflow-without-run-id", "trackers.json",
     {"config_hash": "x", "runs": {"mlflow": {"tracking_uri": "file:///m", "experiment_id": "1",
                                              "since_attempt": 1}}},
     ("'runs.mlflow.run_id'", "missing")),
]


@pytest.mark.parametrize(("name", "content", "needles"), [c[1:] for c in EVALUATE_CASES],
                         ids=[c[0] for c in EVALUATE_CASES])
def test_evaluate_names_a_malformed_run_file_before_loading(
        ws: Path, results: Path, fake_hf: Path, name: str, content: object,
        needles: tuple[str, ...]) -> None:
    run_dir = results / "runs" / "r"
    _write(run_dir / name, content)
    before = snapshot(results.parent)
    res = run(["-m", "pipeline.evaluate", "--model", str(fake_hf), "--data-dir",
               str(ws / "data"), "--run-dir", str(run_dir), "--out", str(run_dir / "eval")],
              results.parent)
    assert_refused(res, name, *needles, before=before, roots=[results.parent])


def test_a_resume_names_a_malformed_trackers_record(results: Path) -> None:
    # What rank 0's recorder calls on every attempt, before it opens any tracker.
    from pipeline.errors import PipelineError
    from pipeline.observe.trackers import Trackers

    run_dir = results / "runs" / "r"
    _write(run_dir / "trackers.json", {"config_hash": "h", "runs": {"wandb": {
        "id": "r-1", "project": "p", "name": ["r"], "since_attempt": 1}}})
    before = snapshot(results)
    with pytest.raises(PipelineError, match=r"trackers\.json.*'runs\.wandb\.name' is not a string"):
        Trackers.for_training(run_dir, ["tensorboard"], {}, "h", attempt=2)
    assert snapshot(results) == before


def test_a_resume_names_a_mistyped_run_config(ws: Path, results: Path) -> None:
    # The launcher and every rank read config.json through the typed parse (load_run_config).
    run_dir = results / "runs" / "r"
    _write(run_dir / "config.json", {"name": "r", "data": {"sources": [{"path": "x"}]},
                                     "train": {"lr": "fast"}})
    before = snapshot(results.parent)
    res = run(["-m", "pipeline.train", "launch", "--run-dir", str(run_dir), "--data-dir",
               str(ws / "data")], results.parent)
    assert_refused(res, "config.json", "train.lr", before=before, roots=[results.parent])


def test_status_shows_a_run_with_a_malformed_config_and_names_the_file(results: Path) -> None:
    _write(results / "runs" / "r" / "config.json", {"train": {"max_steps": "4" + ESC}})
    res = _status(results)
    assert res.returncode == 0, res.stderr
    assert "config.json" in res.stderr and "'train.max_steps'" in res.stderr
    assert "\x1b" not in res.stdout + res.stderr and "\\x1b[2J" in res.stderr
    row = next(line.split() for line in res.stdout.splitlines() if line.startswith("r "))
    assert row[1] == "training" and row[4] == "2"  # shown without the config's max_steps


def test_status_shows_a_run_whose_config_is_a_list(results: Path) -> None:
    _write(results / "runs" / "r" / "config.json", "[]")
    res = _status(results)
    assert res.returncode == 0 and "not a JSON object" in res.stderr, res.stderr
    assert any(line.startswith("r ") for line in res.stdout.splitlines())


# --- hostile strings: shown escaped ----------------------------------------------------------


def test_status_escapes_a_local_jobs_id(results: Path) -> None:
    _write(results / "runs" / "r" / "job.json", {"job_id": "7" + ESC, "launcher": "local"})
    res = _status(results)
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout
    assert "7\\x1b[2J" in res.stdout


def test_status_escapes_a_slurm_jobs_id_and_a_bidi_override(results: Path) -> None:
    _write(results / "runs" / "r" / "job.json", {"job_id": "\u202e9" + ESC, "launcher": "slurm"})
    res = _status(results)
    assert "\x1b" not in res.stdout and "\u202e" not in res.stdout and "\\u202e9" in res.stdout


def test_status_ignores_a_checkpoint_folder_named_with_a_line_break(results: Path) -> None:
    # "$" matches before a trailing newline: such a folder would pass for the newest step.
    odd = results / "runs" / "r" / "checkpoints" / "step-000009\n"
    _write(odd / "manifest.json", {"step": 9})
    res = _status(results)
    assert res.returncode == 0, res.stderr
    assert "step-000002" in res.stdout and "step-000009" not in res.stdout
    assert len(res.stdout.splitlines()) == 2  # the header and run r: no line break in a cell


def test_report_page_escapes_markup_and_control_characters(results: Path) -> None:
    hostile = "a<script>x" + ESC
    shutil.copytree(results / "runs" / "r", results / "runs" / hostile)
    _write(results / "runs" / hostile / "eval" / "metrics.json",
           {"loss": 2.0, "lm_eval": {"results": {"t\x1b[31m": {"acc": 0.5}}},
            "mixture": {"<b>\x07": {"target": 1.0, "consumed": 1.0}}})
    res = _report(results)
    assert res.returncode == 0, res.stderr[-3000:]
    page = (results / "report.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert not any(c in page for c in "\x1b\x07")
    assert "t\\x1b[31m acc" in page and "&lt;b&gt;\\x07" in page


def test_report_error_escapes_a_run_name(results: Path) -> None:
    res = _report(results, "--run", "gone" + ESC)
    assert_refused(res, "gone\\x1b[2J")
    assert "\x1b" not in res.stderr


# --- report --out: only a page this command wrote is replaced --------------------------------


def _out_case(results: Path, out: Path, *needles: str) -> None:
    before = snapshot(results.parent)
    assert_refused(_report(results, "--out", str(out)), str(out), *needles,
                   before=before, roots=[results.parent])


def test_report_out_refuses_a_users_file(results: Path) -> None:
    thesis = results.parent / "thesis.tex"
    thesis.write_text("\\documentclass{article}\n% two years of work\n")
    _out_case(results, thesis, "not a page this command wrote", "nothing was written")


def test_report_out_refuses_a_runs_config(results: Path) -> None:
    _out_case(results, results / "runs" / "r" / "config.json", "not a page this command wrote")


def test_report_out_refuses_an_html_page_of_someone_else(results: Path) -> None:
    page = results.parent / "index.html"
    page.write_text("<!DOCTYPE html>\n<html><head><title>my site</title></head></html>\n")
    _out_case(results, page, "no zerosnake report marker")


def test_report_out_refuses_a_folder(results: Path) -> None:
    _out_case(results, results / "runs", "not a file")


def test_report_out_refuses_a_symbolic_link(results: Path) -> None:
    (results.parent / "target.html").write_text("mine\n")
    (results.parent / "link.html").symlink_to("target.html")
    _out_case(results, results.parent / "link.html", "symbolic link")


def test_report_default_out_refuses_a_users_file(results: Path) -> None:
    (results / "report.html").write_text("my own notes\n")
    before = snapshot(results.parent)
    assert_refused(_report(results), "report.html", "not a page this command wrote",
                   before=before, roots=[results.parent])


def test_report_out_replaces_its_own_page(results: Path) -> None:
    out = results.parent / "batch.html"
    assert _report(results, "--out", str(out)).returncode == 0
    first = out.read_text()
    assert '<meta name="generator" content="zerosnake report">' in first
    shutil.copytree(results / "runs" / "r", results / "runs" / "r2")
    res = _report(results, "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'data-run="r2"' in out.read_text() and 'data-run="r2"' not in first


def test_report_out_replaces_a_page_written_before_the_marker(results: Path) -> None:
    out = results / "report.html"
    out.write_text('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
                   "<title>zerosnake batch report</title>\n</head><body>old</body></html>\n")
    res = _report(results)
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'data-run="r"' in out.read_text()
