"""Bad and hostile command lines of every ``python -m pipeline.*`` command: output paths that
point at a folder the command did not write (``.``, ``/``, a run or data directory, a file),
inputs that do not exist, out-of-range numbers and hostile strings. Each is refused with one
line naming the option or the path, no traceback, and every file around it unchanged: a
command writes a folder only when it is new, empty, or one it wrote before. Every size and
count a command takes is bounded as its options are parsed, before any work (an option that
mirrors a config key names the key and holds its limits).

Cases: 40 output paths, missing inputs and out-of-range options, stage by stage (tokenize 11,
tokenizer 8, render 8, evaluate 9; status, train launch and consolidate 4); 23 sizes, counts
and durations past their limits (22 options of tokenize, tokenizer, plan, render and train
launch; a model file's).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.bad_input.conftest import REPO, assert_refused, run, snapshot

CONFIG = str(REPO / "config" / "config.yaml")


@pytest.fixture
def proj(ws: Path, tmp_path: Path) -> Path:
    """A project folder to run in: the user's files, results/data and results/runs/r (a
    copy per test), and a corpus."""
    (tmp_path / "README.md").write_text("my project\n")
    (tmp_path / "my.yaml").write_text("runs: {}\n")
    shutil.copytree(ws / "data", tmp_path / "results" / "data")
    shutil.copytree(ws / "runs" / "r", tmp_path / "results" / "runs" / "r")
    shutil.copytree(ws / "corpus", tmp_path / "corpus")
    return tmp_path


DATA = "results/data"
RUN = "results/runs/r"
TOK = "results/data/tokenizer"


def _refused(proj: Path, argv: list[str], *needles: str) -> None:
    """``python <argv>`` in ``proj`` is refused and changes nothing under ``proj``."""
    before = snapshot(proj)
    assert_refused(run(argv, proj), *needles, before=before, roots=[proj])


# --- tokenize shard / gather -----------------------------------------------------------------


def _shard(*extra: str, out: str = "new-data") -> list[str]:
    return ["-m", "pipeline.tokenize", "shard", "--input", "corpus", "--tokenizer", TOK,
            "--seq-len", "16", "--out", out, "--no-progress", *extra]


def test_tokenize_shard_out_dot(proj: Path) -> None:
    _refused(proj, _shard(out="."), "--out .", "not a data directory")


def test_tokenize_shard_out_run_dir(proj: Path) -> None:
    _refused(proj, _shard(out=RUN), RUN, "not a data directory")


def test_tokenize_shard_out_is_a_file(proj: Path) -> None:
    _refused(proj, _shard(out="README.md"), "README.md", "not a folder")


def test_tokenize_shard_out_with_a_file_where_a_split_folder_goes(proj: Path) -> None:
    (proj / "new-data" / "shards").mkdir(parents=True)
    (proj / "new-data" / "shards" / "train").write_text("in the way")
    _refused(proj, _shard(), "new-data/shards/train", "not a folder")


def test_tokenize_shard_threads_zero(proj: Path) -> None:
    _refused(proj, _shard("--threads", "0"), "--threads 0")


def test_tokenize_shard_index_out_of_range(proj: Path) -> None:
    _refused(proj, _shard("--shards", "2", "--shard", "5"), "--shard 5", "0..1")


def test_tokenize_shard_seq_len_one(proj: Path) -> None:
    _refused(proj, _shard("--seq-len", "1"), "--seq-len 1")


def test_tokenize_shard_val_fraction_one(proj: Path) -> None:
    _refused(proj, _shard("--val-fraction", "1.0"), "--val-fraction 1.0")


def test_tokenize_shard_missing_tokenizer(proj: Path) -> None:
    argv = _shard()
    argv[argv.index(TOK)] = "results/data/no-tokenizer"
    _refused(proj, argv, "no-tokenizer", "does not exist")


def test_tokenize_gather_without_shards(proj: Path) -> None:
    (proj / "empty").mkdir()
    _refused(proj, ["-m", "pipeline.tokenize", "gather", "--out", "empty", "--shards", "1",
                    "--tokenizer", TOK], "empty/shards", "not complete")


def test_tokenize_gather_zero_shards(proj: Path) -> None:
    _refused(proj, ["-m", "pipeline.tokenize", "gather", "--out", DATA, "--shards", "0",
                    "--tokenizer", TOK], "--shards 0")


# --- tokenizer train / import ----------------------------------------------------------------


def _train(*extra: str, out: str = "newtok") -> list[str]:
    return ["-m", "pipeline.tokenize", "tokenizer", "train", "--input", "corpus", "--vocab-size", "300",
            "--out", out, *extra]


def test_tokenizer_train_out_data_dir(proj: Path) -> None:
    _refused(proj, _train(out=DATA), DATA, "not written by this command")


def test_tokenizer_train_out_dot(proj: Path) -> None:
    _refused(proj, _train(out="."), ". exists", "not written by this command")


def test_tokenizer_import_out_run_dir(proj: Path) -> None:
    _refused(proj, ["-m", "pipeline.tokenize", "tokenizer", "import", "--path", TOK, "--out", RUN],
             RUN, "not written by this command")


def test_tokenizer_train_out_under_a_file(proj: Path) -> None:
    _refused(proj, _train(out="README.md/tokenizer"), "README.md", "check --out")


def test_tokenizer_train_vocab_too_small(proj: Path) -> None:
    argv = _train()
    argv[argv.index("300")] = "10"
    _refused(proj, argv, "--vocab-size 10", "at least 260", "data.tokenizer.vocab_size")


def test_tokenizer_train_max_bytes_zero(proj: Path) -> None:
    _refused(proj, _train("--max-bytes", "0"), "--max-bytes 0")


def test_tokenizer_train_empty_special_token(proj: Path) -> None:
    _refused(proj, _train("--special-token", " "), "special token", "empty")


def test_tokenizer_train_shell_metacharacters_are_a_path(proj: Path) -> None:
    argv = _train()
    argv[argv.index("corpus")] = "$(touch pwned); `touch pwned2`"
    _refused(proj, argv, "$(touch pwned)", "matches no file")
    assert not (proj / "pwned").exists() and not (proj / "pwned2").exists()


# --- render ----------------------------------------------------------------------------------


def _render(out: str, *extra: str) -> list[str]:
    return ["-m", "pipeline.render", "--config", CONFIG, "--run", "fsdp", "--out", out,
            *(extra or ("--vocab-size", "300"))]


def test_render_out_root(proj: Path) -> None:
    if os.path.exists("/plan.md") or os.path.exists("/config.json"):
        pytest.skip("/ already holds render's file names")
    _refused(proj, _render("/"), "--out /", "not a run directory")
    assert not os.path.exists("/plan.md") and not os.path.exists("/config.json")


def test_render_out_dot(proj: Path) -> None:
    _refused(proj, _render("."), "--out .", "not a run directory")


def test_render_out_data_dir(proj: Path) -> None:
    _refused(proj, _render(DATA), DATA, "not a run directory")


def test_render_out_another_runs_dir(proj: Path) -> None:
    _refused(proj, _render(RUN), RUN, "run 'r'", "not of run 'fsdp'")


def test_render_missing_data_manifest(proj: Path) -> None:
    _refused(proj, _render("results/runs/fsdp", "--data-manifest", "nowhere/manifest.json"),
             "nowhere/manifest.json", "no data manifest")


def test_render_run_config_json_that_is_not_json(proj: Path) -> None:
    _refused(proj, ["-m", "pipeline.render", "--run-config-json", "{'name': 'x'",
                    "--out", "results/runs/x"], "--run-config-json", "not valid JSON")


def test_render_vocab_size_zero(proj: Path) -> None:
    _refused(proj, _render("results/runs/fsdp", "--vocab-size", "-1"), "--vocab-size -1")


def test_render_missing_config_file(proj: Path) -> None:
    _refused(proj, ["-m", "pipeline.render", "--config", "nope.yaml", "--run", "fsdp",
                    "--out", "results/runs/fsdp"], "nope.yaml")


# --- evaluate --------------------------------------------------------------------------------


@pytest.fixture
def model(proj: Path) -> Path:
    """A folder that passes evaluate's first checks (the --out check comes before loading)."""
    d = proj / "results" / "runs" / "r" / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}\n")
    (d / "zerosnake.json").write_text(json.dumps(
        {"step": 2, "checkpoint_manifest_sha256": "0" * 64}) + "\n")
    return d


def _evaluate(out: str, *, model: str = f"{RUN}/hf", run_dir: str = RUN,
              extra: tuple[str, ...] = ()) -> list[str]:
    return ["-m", "pipeline.evaluate", "--model", model, "--data-dir", DATA, "--run-dir",
            run_dir, "--out", out, *extra]


def test_evaluate_out_dot(proj: Path, model: Path) -> None:
    _refused(proj, _evaluate("."), "--out .", "not written by this command")


def test_evaluate_out_run_dir(proj: Path, model: Path) -> None:
    _refused(proj, _evaluate(RUN), f"--out {RUN}", "not written by this command")


def test_evaluate_out_data_dir(proj: Path, model: Path) -> None:
    _refused(proj, _evaluate(DATA), f"--out {DATA}", "not written by this command")


def test_evaluate_out_model_dir(proj: Path, model: Path) -> None:
    _refused(proj, _evaluate(f"{RUN}/hf"), f"--out {RUN}/hf", "not written by this command")


def test_evaluate_out_is_a_file(proj: Path, model: Path) -> None:
    _refused(proj, _evaluate("README.md"), "README.md", "not a folder this command wrote")


def test_evaluate_missing_model(proj: Path) -> None:
    _refused(proj, _evaluate(f"{RUN}/eval", model="results/runs/nope/hf"),
             "--model results/runs/nope/hf", "consolidate")


def test_evaluate_missing_run_dir(proj: Path, model: Path) -> None:
    _refused(proj, _evaluate("results/runs/nope/eval", run_dir="results/runs/nope"),
             "--run-dir results/runs/nope")


def test_evaluate_missing_lm_eval_tasks(proj: Path, model: Path) -> None:
    _refused(proj, _evaluate(f"{RUN}/eval", extra=("--lm-eval-tasks", "no-tasks")),
             "--lm-eval-tasks no-tasks")


def test_evaluate_lm_eval_task_without_tasks_dir(proj: Path, model: Path) -> None:
    _refused(proj, _evaluate(f"{RUN}/eval", extra=("--lm-eval-task", "mine")),
             "--lm-eval-task", "--lm-eval-tasks")


# --- status, train launch, consolidate -------------------------------------------------------


def test_status_missing_results(proj: Path) -> None:
    _refused(proj, ["-m", "pipeline.status", "--results", "nowhere"], "nowhere")


def test_status_results_is_a_file(proj: Path) -> None:
    _refused(proj, ["-m", "pipeline.status", "--results", "README.md"], "README.md")


def test_train_launch_run_dir_without_config(proj: Path) -> None:
    (proj / "results" / "runs" / "empty").mkdir()
    _refused(proj, ["-m", "pipeline.train", "launch", "--run-dir", "results/runs/empty",
                    "--data-dir", DATA], "config.json")


def test_consolidate_out_dot(proj: Path) -> None:
    _refused(proj, ["-m", "pipeline.consolidate", "--run-dir", RUN, "--data-dir", DATA,
                    "--out", "."], ". exists", "not written by this command")


# --- sizes and counts: bounded as the options are parsed, before any work --------------------

_PLAN = ["-m", "pipeline.plan", "--model", "tiny"]
_GATHER = ["-m", "pipeline.tokenize", "gather", "--out", DATA, "--tokenizer", TOK]
_LAUNCH = ["-m", "pipeline.train", "launch", "--run-dir", RUN, "--data-dir", DATA]

# (id, argv, needles): every count or size a command takes, past its limit (an option that
# mirrors a config key names the key).
SIZES: list[tuple[str, list[str], tuple[str, ...]]] = [
    ("shard-seq-len-1e12", _shard("--seq-len", str(10**12)),
     ("--seq-len 1000000000000", "at most 1048576", "data.seq_len")),
    ("shard-shards-1e9", _shard("--shards", str(10**9)), ("--shards 1000000000", "data.shards")),
    ("shard-index-1e9", _shard("--shard", str(10**9)), ("--shard 1000000000",)),
    ("shard-threads-1e9", _shard("--threads", str(10**9)), ("--threads 1000000000",)),
    ("shard-val-fraction-nan", _shard("--val-fraction", "nan"),
     ("--val-fraction nan", "data.val_fraction")),
    ("gather-shards-1e9", [*_GATHER, "--shards", str(10**9)], ("--shards 1000000000",)),
    ("tokenizer-vocab-1e9", _train("--vocab-size", str(10**9)),
     ("--vocab-size 1000000000", "at most 1048576", "data.tokenizer.vocab_size")),
    ("tokenizer-max-bytes-absurd", _train("--max-bytes", str(10**15)),
     ("--max-bytes", "data.tokenizer.train_max_bytes")),
    ("tokenizer-min-frequency-negative", _train("--min-frequency", "-1"),
     ("--min-frequency -1",)),
    ("plan-tp-1e9", [*_PLAN, "--tp", str(10**9)], ("--tp 1000000000", "train.tp")),
    ("plan-pp-1e9", [*_PLAN, "--pp", str(10**9)], ("--pp 1000000000", "train.pp")),
    ("plan-micro-batch-1e9", [*_PLAN, "--micro-batch", str(10**9)],
     ("--micro-batch", "train.micro_batch_size")),
    ("plan-grad-accum-zero", [*_PLAN, "--grad-accum", "0"], ("--grad-accum 0", "at least 1")),
    ("plan-global-batch-absurd", [*_PLAN, "--global-batch", str(10**12)],
     ("--global-batch", "train.global_batch_size")),
    ("plan-nodes-1e9", [*_PLAN, "--nodes", str(10**9)], ("--nodes", "cluster.nodes")),
    ("plan-gpu-mem-inf", [*_PLAN, "--gpu-mem-gb", "inf"], ("--gpu-mem-gb inf", "finite")),
    ("plan-params-1e30", ["-m", "pipeline.plan", "--params", "1e30"], ("--params",)),
    ("plan-params-nan", ["-m", "pipeline.plan", "--params", "nan"], ("--params nan",)),
    ("render-vocab-1e12", _render("results/runs/fsdp", "--vocab-size", str(10**12)),
     ("--vocab-size 1000000000000",)),
    ("launch-poll-nan", [*_LAUNCH, "--poll-s", "nan"], ("--poll-s nan", "give seconds from")),
    ("launch-time-negative", [*_LAUNCH, "--time-min", "-5"], ("--time-min -5", "give minutes from")),
    ("launch-failures-1e12", [*_LAUNCH, "--max-failures", str(10**12)], ("--max-failures",)),
]


@pytest.mark.parametrize(("argv", "needles"), [c[1:] for c in SIZES], ids=[c[0] for c in SIZES])
def test_a_size_past_its_limit_is_refused_before_any_work(proj: Path, argv: list[str],
                                                          needles: tuple[str, ...]) -> None:
    _refused(proj, argv, *needles)


def test_plan_of_a_model_file_with_absurd_numbers(proj: Path) -> None:
    shape = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 10**9, "num_attention_heads": 32}
    (proj / "model.json").write_text(json.dumps(shape))
    _refused(proj, ["-m", "pipeline.plan", "--model", "model.json"], "model.num_layers",
             "1000000000")
