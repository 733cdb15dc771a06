"""Services that do not answer, a tracker package that is missing, and text the tokenizer's BPE
trainer would stall on: the stage's real output comes in bounded time with one warning, or the
stage is refused with one clear line; never a traceback.

Cases, per class:

- A tracker that does not answer (5 cases): MLflow at a server that accepts connections and
  never answers, at a listener that never accepts, at a port that refuses connections and at a
  host that does not resolve: ``python -m pipeline.evaluate`` writes its results (exit 0) with
  one warning naming the tracker and its URI, and ``trackers.json`` stays as it was; and a
  training worker whose MLflow never answers trains to the end, with ``trackers.json``
  recording its other tracker and not MLflow (the next attempt tries MLflow again).
- A tracker package that is missing (4 cases): ``train.trackers: [wandb]`` without wandb is
  refused by ``python -m pipeline.config check`` and by ``python -m pipeline.render`` (the key
  and how to install it; nothing written); a worker whose ``import wandb`` fails stops before
  its first step with the same line; evaluate warns and goes on.
- Text with nowhere to split (4 cases), trained on by ``python -m pipeline.tokenize tokenizer
  train``: megabytes of one letter, a JSON Lines value of one punctuation character repeated, a
  run of whitespace megabytes long, and a small ``.gz`` of zeros that inflates to 1 GiB. Each
  trains (exit 0) and no learned token is longer than ``TRAIN_MAX_RUN``: before the cut, such
  a run reached the trainer as one word and training did not end within minutes.

The tracker bound is set to 2 s (``ZEROSNAKE_TRACKER_TIMEOUT_S``); MLflow's own retries would
take minutes, past the subprocess's limit.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.text.tokenizer import TRAIN_MAX_RUN
from tests.bad_input.conftest import REPO, assert_refused, run, snapshot
from tests.bad_input.tiny_data import SEQ_LEN, VOCAB, build_hf

BOUND = {"ZEROSNAKE_TRACKER_TIMEOUT_S": "2"}
#: Past this a command counts as stalled (MLflow's default retries alone take minutes).
STALLED_S = 120
UNRESOLVABLE = "http://zerosnake-no-such-host.invalid:5000"  # .invalid never resolves (RFC 2606)

# A Python start-up hook that makes wandb look uninstalled: importlib.util.find_spec gives None
# and ``import wandb`` raises ModuleNotFoundError, as without the package (an import hook that
# raised instead would break transformers' own look-ups).
_BLOCK_WANDB = 'import sys\nsys.modules["wandb"] = None\n'


# --- servers that do not answer ----------------------------------------------------------------


@pytest.fixture
def accepting_uri() -> Iterator[str]:
    """A server that accepts every connection and never sends a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:  # the accept timeout: look at stop again
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    srv.close()


@pytest.fixture
def backlog_uri() -> Iterator[str]:
    """A listener that never accepts: the kernel queues the connection, no one reads it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


@pytest.fixture
def refused_uri() -> str:
    """A port nothing listens on (bound, then released): connections are refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


# --- the stages --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(ws: Path) -> Path:
    """A tiny consolidated model (evaluate only needs it to load)."""
    return build_hf(ws / "hf", ws / "data" / "tokenizer")


def _tracked_run(ws: Path, dest: Path, runs: dict) -> Path:
    """A copy of the module's run dir whose training recorded the tracker runs ``runs``."""
    run_dir = Path(shutil.copytree(ws / "runs" / "r", dest / "runs" / "r"))
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg["train"]["trackers"] = list(runs)
    (run_dir / "config.json").write_text(json.dumps(cfg) + "\n")
    (run_dir / "trackers.json").write_text(json.dumps({"config_hash": "0" * 16, "runs": runs}))
    return run_dir


def _evaluate(cwd: Path, ws: Path, hf: Path, run_dir: Path, **env: str):
    return run(["-m", "pipeline.evaluate", "--model", str(hf), "--data-dir", str(ws / "data"),
                "--run-dir", str(run_dir), "--out", str(run_dir / "eval")], cwd,
               timeout=STALLED_S, **BOUND, **env)


def _assert_went_on(res, *needles: str) -> None:
    """Exit 0, no traceback, and the warning's words in the output."""
    text = res.stderr + res.stdout
    assert res.returncode == 0, text[-3000:]
    assert "Traceback (most recent call last)" not in text, text[-3000:]
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text[-3000:]}"


def _config(ws: Path, path: Path, trackers: list[str]) -> Path:
    """A one-run config of a tiny model on the module's corpus, trained on the CPU."""
    cfg = {
        "data": {"sources": [{"path": str(ws / "corpus"), "format": "txt"}],
                 "tokenizer": {"vocab_size": VOCAB}, "seq_len": SEQ_LEN},
        "model": {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2,
                  "max_position_embeddings": SEQ_LEN, "attn_implementation": "eager"},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cpu"},
        "train": {"backend": "ddp", "micro_batch_size": 2, "grad_accum": 1, "max_steps": 2,
                  "warmup_steps": 1, "checkpoint_every": 2, "record_samples": False,
                  "trackers": trackers},
        "runs": {"r": {}},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _render(ws: Path, config: Path, out: Path, **env: str):
    return run(["-m", "pipeline.render", "--config", str(config), "--run", "r", "--out", str(out),
                "--data-manifest", str(ws / "data" / "manifest.json")], config.parent, **env)


def _worker(ws: Path, run_dir: Path, **env: str):
    """A bare ``python -m pipeline.train worker``: rank 0 of 1 (port 0: the store picks one)."""
    return run(["-m", "pipeline.train", "worker", "--run-dir", str(run_dir), "--data-dir",
                str(ws / "data")], run_dir.parent, timeout=STALLED_S, RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
               **env)


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]' has it)")


def _mlflow_entry(uri: str) -> dict:
    return {"tracking_uri": uri, "experiment_id": "1", "run_id": "0" * 32, "since_attempt": 1}


# --- a tracker that does not answer (5 cases) --------------------------------------------------


@pytest.mark.parametrize("server", ["accepting_uri", "backlog_uri", "refused_uri", "unresolvable"])
def test_evaluate_goes_on_when_mlflow_does_not_answer(tmp_path, ws, hf, server, request) -> None:
    _need("mlflow")
    uri = UNRESOLVABLE if server == "unresolvable" else request.getfixturevalue(server)
    run_dir = _tracked_run(ws, tmp_path, {"mlflow": _mlflow_entry(uri)})
    before = (run_dir / "trackers.json").read_bytes()
    res = _evaluate(tmp_path, ws, hf, run_dir)
    _assert_went_on(res, f"warning: tracker mlflow ({uri}): logging the evaluation failed")
    assert json.loads((run_dir / "eval" / "metrics.json").read_text())["step"] == 2
    assert (run_dir / "trackers.json").read_bytes() == before


def test_training_goes_on_when_mlflow_never_answers(tmp_path, ws, accepting_uri) -> None:
    _need("mlflow")
    run_dir = tmp_path / "r"
    res = _render(ws, _config(ws, tmp_path / "config.yaml", ["tensorboard", "mlflow"]), run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _worker(ws, run_dir, MLFLOW_TRACKING_URI=accepting_uri, **BOUND)
    _assert_went_on(res, f"warning: tracker mlflow ({accepting_uri}): creating its run failed")
    assert json.loads((run_dir / "train.done").read_text())["step"] == 2
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    state = json.loads((run_dir / "trackers.json").read_text())
    assert set(state["runs"]) == {"tensorboard"}  # MLflow is tried again by the next attempt
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


# --- a tracker package that is missing (4 cases) -----------------------------------------------


@pytest.fixture
def no_wandb(tmp_path: Path) -> dict[str, str]:
    """Environment in which ``wandb`` cannot be found (a start-up hook refuses it)."""
    hook = tmp_path / "no-wandb"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_BLOCK_WANDB)
    return {"PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}


def test_config_check_refuses_wandb_when_it_is_not_installed(tmp_path, ws, no_wandb) -> None:
    cfg = _config(ws, tmp_path / "config.yaml", ["tensorboard", "wandb"])
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.config", "check", str(cfg)], tmp_path, **no_wandb)
    assert_refused(res, "runs.r", "train.trackers names wandb", "pip install 'zerosnake[trackers]'",
                   before=before, roots=[tmp_path])


def test_render_refuses_wandb_when_it_is_not_installed(tmp_path, ws, no_wandb) -> None:
    cfg = _config(ws, tmp_path / "config.yaml", ["wandb"])
    before = snapshot(tmp_path)
    res = _render(ws, cfg, tmp_path / "out", **no_wandb)
    assert_refused(res, "train.trackers names wandb", "pip install wandb", before=before,
                   roots=[tmp_path])
    assert not (tmp_path / "out").exists()


def test_worker_stops_before_its_first_step_when_wandb_fails_to_import(tmp_path, ws) -> None:
    _need("wandb")  # render's check finds the package; the worker's import fails
    run_dir = tmp_path / "r"
    res = _render(ws, _config(ws, tmp_path / "config.yaml", ["wandb"]), run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "wandb.py").write_text("raise ImportError('wandb is broken here')\n")
    res = _worker(ws, run_dir, PYTHONPATH=f"{broken}{os.pathsep}{REPO}")
    assert_refused(res, "error: train.trackers names wandb", "pip install 'zerosnake[trackers]'")
    assert not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "trackers.json").exists()


def test_evaluate_goes_on_when_wandb_is_not_installed(tmp_path, ws, hf, no_wandb) -> None:
    entry = {"id": "r-0", "project": "p", "name": "r", "dir": None, "since_attempt": 1}
    run_dir = _tracked_run(ws, tmp_path, {"wandb": entry})
    res = _evaluate(tmp_path, ws, hf, run_dir, **no_wandb)
    _assert_went_on(res, "warning: tracker wandb (project p", "wandb package is not installed")
    assert (run_dir / "eval" / "metrics.json").is_file()


# --- text with nowhere to split (4 cases) ------------------------------------------------------


def _train_tokenizer(cwd: Path, source: Path, *extra: str):
    return run(["-m", "pipeline.tokenize", "tokenizer", "train", "--input", str(source),
                "--vocab-size", str(VOCAB), "--out", str(cwd / "tok"), *extra], cwd,
               timeout=STALLED_S)


def _longest_token(tok: Path) -> int:
    """Bytes of the longest learned token (byte-level: one character per byte)."""
    vocab = json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) > 256 + 1, "no merge was learned"
    return max(len(t) for t in vocab)


@pytest.mark.parametrize("name,content", [
    ("letters.txt", b"a" * (4 << 20)),
    ("spaces.txt", b"left" + b" " * (4 << 20) + b"right"),
], ids=["letters", "spaces"])
def test_tokenizer_trains_on_one_long_run(tmp_path, name, content) -> None:
    src = tmp_path / name
    src.write_bytes(content)
    res = _train_tokenizer(tmp_path, src)
    _assert_went_on(res, '"vocab_size"')
    assert _longest_token(tmp_path / "tok") <= TRAIN_MAX_RUN


def test_tokenizer_trains_on_a_long_punctuation_value(tmp_path) -> None:
    src = tmp_path / "rule.jsonl"
    src.write_text(json.dumps({"text": "=" * (4 << 20)}) + "\n")  # one line, held whole
    res = _train_tokenizer(tmp_path, src)
    _assert_went_on(res, '"vocab_size"')
    assert _longest_token(tmp_path / "tok") <= TRAIN_MAX_RUN


def test_tokenizer_trains_on_a_gzip_of_zeros(tmp_path) -> None:
    src = tmp_path / "zeros.txt.gz"
    member = gzip.compress(bytes(16 << 20), compresslevel=9)
    src.write_bytes(member * 64)  # gzip members back to back: 1 GiB inflated, 1 MB on disk
    res = _train_tokenizer(tmp_path, src, "--max-bytes", str(4 << 20))
    _assert_went_on(res, '"vocab_size"')
    assert _longest_token(tmp_path / "tok") <= TRAIN_MAX_RUN
