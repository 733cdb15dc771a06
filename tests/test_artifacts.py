"""The artifact contract (pipeline.artifacts) and the readers every stage shares through it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pipeline import artifacts as af
from pipeline.errors import PipelineError
from pipeline.evaluate import read_metrics
from pipeline.status import run_status


def _torn_metrics(run: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    # Step 2 repeats after a resume; the last line was cut by a crash mid-write.
    (run / af.METRICS).write_text(
        '{"step": 1, "loss": 5.0, "tokens_per_s": 100}\n'
        '{"step": 2, "loss": 4.0, "tokens_per_s": 100}\n'
        '{"step": 2, "loss": 3.9, "tokens_per_s": 300}\n'
        '{"step": 3, "lo'
    )


def test_one_tolerant_reader_for_every_stage(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r"
    _torn_metrics(run)
    assert [m["step"] for m in af.read_metrics(run)] == [1, 2, 2]
    # evaluate keeps the last record of each step and does not crash on the cut line
    assert [(m["step"], m["loss"]) for m in read_metrics(run / af.METRICS)] == [(1, 5.0), (2, 3.9)]
    # status reads the same records
    assert run_status(run).step == "2"
    # a tail read starts mid-line: that first piece is skipped, not misread
    tail = af.read_jsonl(run / af.METRICS, tail_bytes=70)
    assert all("step" in m for m in tail) and tail[-1]["loss"] == 3.9


def test_attempts_count_start_events_not_substrings(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    af.append_event(run, "start", step=0)
    af.append_event(run, "restart_note", text='"event": "start"')  # must not count
    af.append_event(run, "start", step=10)
    with (run / af.EVENTS).open("a") as f:
        f.write('{"event": "sta')  # cut by a crash
    assert af.attempts(run) == 2
    assert run_status(run).restarts == 1


def test_latest_checkpoint_is_the_newest_with_a_manifest(tmp_path: Path) -> None:
    run = tmp_path / "r"
    ck = run / af.CHECKPOINTS
    for step, complete in [(10, True), (20, True), (30, False)]:
        d = ck / af.step_name(step)
        d.mkdir(parents=True)
        if complete:
            (d / af.CKPT_MANIFEST).write_text("{}")
    (ck / ".tmp-step-000040").mkdir()
    (ck / "step-junk").mkdir()
    assert af.latest_checkpoint(run) == ck / "step-000020"
    assert af.latest_checkpoint_name(run) == "step-000020"
    assert run_status(run).checkpoint == "step-000020"
    assert af.latest_checkpoint(tmp_path / "none") is None


def test_status_survives_a_malformed_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / af.RUN_CONFIG).write_text("[1, 2")  # torn
    (run / af.JOB).write_text('"a string"')  # not an object
    st = run_status(run)
    assert st.stage == "rendered" and st.job_id == "-"


def test_read_artifact_names_the_file_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match=r"train\.done.*run the train rule"):
        af.read_train_done(tmp_path)
    (tmp_path / af.TRAIN_DONE).write_text("{not json")
    with pytest.raises(PipelineError, match="unreadable"):
        af.read_train_done(tmp_path)


def test_inside_keeps_artifact_paths_in_their_folder(tmp_path: Path) -> None:
    assert af.inside(tmp_path, "checkpoints/step-000001") == (
        tmp_path / "checkpoints" / "step-000001"
    ).resolve()
    for bad in ("../x", "/etc", "a/../../x"):
        with pytest.raises(PipelineError, match="leaves"):
            af.inside(tmp_path, bad)


def test_replacing_dir_is_atomic_and_only_replaces_its_own(tmp_path: Path) -> None:
    dest = tmp_path / "hf"
    for i in range(2):
        with af.replacing_dir(dest, "mark.json") as tmp:
            (tmp / "mark.json").write_text("{}")
            (tmp / "w").write_text(str(i))
    assert (dest / "w").read_text() == "1"
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing left beside it
    # a failure inside the block leaves the old folder as it was and nothing beside it
    with pytest.raises(RuntimeError), af.replacing_dir(dest, "mark.json") as tmp:
        (tmp / "w").write_text("half")
        raise RuntimeError("boom")
    assert (dest / "w").read_text() == "1"
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    # a folder this command did not write is refused before anything is built
    stranger = tmp_path / "mine"
    stranger.mkdir()
    (stranger / "thesis.tex").write_text("years of work")
    with pytest.raises(PipelineError, match="not written by this command"), \
            af.replacing_dir(stranger, "mark.json"):
        raise AssertionError("the block must not run")
    assert (stranger / "thesis.tex").read_text() == "years of work"
    (tmp_path / "file").write_text("x")
    with pytest.raises(PipelineError), af.replacing_dir(tmp_path / "file", "mark.json"):
        pass


def test_an_empty_folder_is_replaceable(tmp_path: Path) -> None:
    # Snakemake creates an output's parent folder (hf/ for hf/config.json) before the job runs.
    dest = tmp_path / "hf"
    dest.mkdir()
    with af.replacing_dir(dest, "mark.json") as tmp:
        (tmp / "mark.json").write_text("{}")
    assert (dest / "mark.json").is_file()


def _manifest() -> dict:
    shard = {"path": "shards/train/shard-00000.arrow", "sha256": "0" * 64, "bytes": 10,
             "sequences": 1}
    return {"format": 1, "seq_len": 8,
            "tokenizer": {"path": "tokenizer", "vocab_size": 300, "eos_id": 0, "bos_id": None},
            "splits": {"train": {"shards": [shard]}, "validation": {"shards": []}}}


@pytest.mark.parametrize(("edit", "key"), [
    (lambda m: m.pop("seq_len"), "'seq_len'"),
    (lambda m: m.__setitem__("seq_len", "8"), "'seq_len'"),
    (lambda m: m.pop("tokenizer"), "'tokenizer'"),
    (lambda m: m["tokenizer"].__setitem__("eos_id", 300), "'tokenizer.eos_id'"),
    (lambda m: m["tokenizer"].__setitem__("bos_id", -1), "'tokenizer.bos_id'"),
    (lambda m: m["splits"].pop("validation"), "'splits.validation'"),
    (lambda m: m["splits"]["train"]["shards"][0].pop("sha256"), "'splits.train.shards[0].sha256'"),
    (lambda m: m["splits"]["train"]["shards"][0].__setitem__("bytes", True),
     "'splits.train.shards[0].bytes'"),
])
def test_data_manifest_is_checked_key_by_key(tmp_path: Path, edit, key: str) -> None:
    import json

    af.check_data_manifest(_manifest(), tmp_path / "manifest.json")  # the whole one passes
    m = _manifest()
    edit(m)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PipelineError, match=rf"manifest\.json: .*{re.escape(key)}.*gather"):
        af.read_data_manifest(tmp_path)


def test_inside_names_the_file_the_path_came_from(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match=r"stats\.json: path '\.\./x' .* leaves"):
        af.inside(tmp_path, "../x", tmp_path / "stats.json")


def test_json_readers_neither_hang_on_a_fifo_nor_crash_on_deep_nesting(tmp_path: Path) -> None:
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    assert af.read_jsonl(fifo) == [] and af.read_json_or_none(fifo) is None
    with pytest.raises(PipelineError, match="unreadable"):
        af.read_artifact(fifo, "metrics")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000)
    assert af.read_json_or_none(deep) is None and af.read_jsonl(deep) == []
    with pytest.raises(PipelineError, match="unreadable"):
        af.read_artifact(deep, "deep thing")
