"""Helpers for the pipeline-on-Slurm tests: a small corpus, tokenized data, rendered runs, and
reading what the launcher and the trainer left in a run directory.

Every stage runs through its real command line (``python -m pipeline.<stage>``, argument lists).
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

# REPO and PY are re-exported for the test module (h.REPO, h.PY).
from tests.conftest import PY as PY
from tests.conftest import REPO as REPO
from tests.conftest import subprocess_env

#: A tiny model: steps of a few tens of ms on a CPU, checkpoints of a few hundred kB.
MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
         "max_position_embeddings": 64}
SEQ_LEN = 32
VOCAB = 300


def env(**extra: str) -> dict[str, str]:
    """Environment for stage processes (and, through sbatch's export, for the jobs)."""
    return subprocess_env(**extra)


def run(cmd: list[str], *, timeout: float, cwd: Path | None = None,
        extra_env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env(**(extra_env or {})))
    if check:
        assert proc.returncode == 0, (
            f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-6000:]}")
    return proc


def write_corpus(path: Path, docs: int = 400, seed: int = 0) -> Path:
    """A synthetic corpus: sentences over a small vocabulary, documents split by blank lines."""
    rng = random.Random(seed)
    words = ["the", "cluster", "node", "job", "queue", "signal", "step", "save", "resume", "rank", "data", "model", "token", "shard", "batch", "loss", "check", "point", "time", "limit", "warning", "requeue", "slurm", "torch", "run", "train"]
    lines = []
    for _ in range(docs):
        n = rng.randint(8, 40)
        lines.append(" ".join(rng.choice(words) for _ in range(n)) + ".")
    path.write_text("\n\n".join(lines) + "\n")
    return path


def config_dict(corpus: Path, *, nodes: int = 2, gpus_per_node: int = 1, max_steps: int = 40,
                checkpoint_every: int = 10, runs: dict[str, Any] | None = None,
                backend: str = "fsdp") -> dict[str, Any]:
    return {
        "data": {
            "sources": [{"path": str(corpus), "format": "txt", "doc_split": "blank-line"}],
            "tokenizer": {"vocab_size": VOCAB},
            "seq_len": SEQ_LEN,
            "shards": 2,
            "val_fraction": 0.1,
        },
        "model": dict(MODEL),
        "cluster": {"nodes": nodes, "gpus_per_node": gpus_per_node, "device": "cpu"},
        "train": {"backend": backend, "precision": "fp32", "micro_batch_size": 4,
                  "grad_accum": 1, "max_steps": max_steps, "lr": 1e-3, "warmup_steps": 2,
                  "checkpoint_every": checkpoint_every, "keep_last": 2, "seed": 7},
        "runs": runs or {"r": {}},
    }


def prepare_data(work: Path, corpus: Path) -> Path:
    """Tokenizer, two shards and the manifest, on this host (the data stage is not under test
    here; test 4 runs it through Slurm)."""
    data = work / "data"
    run([PY, "-m", "pipeline.tokenize", "tokenizer", "train", "--input", str(corpus), "--vocab-size",
         str(VOCAB), "--max-bytes", "1000000", "--out", str(data / "tokenizer"),
         "--text-field", "text", "--doc-split", "blank-line", "--format", "txt"], timeout=120)
    for shard in ("00000", "00001"):
        run([PY, "-m", "pipeline.tokenize", "shard", "--input", str(corpus),
             "--tokenizer", str(data / "tokenizer"), "--seq-len", str(SEQ_LEN), "--shards", "2",
             "--shard", shard, "--out", str(data), "--val-fraction", "0.1",
             "--on-invalid", "skip", "--text-field", "text", "--doc-split", "blank-line", "--format", "txt"],
            timeout=120)
    run([PY, "-m", "pipeline.tokenize", "gather", "--out", str(data), "--shards", "2",
         "--tokenizer", str(data / "tokenizer")], timeout=120)
    return data


def render(run_dir: Path, cfg: dict[str, Any], name: str = "r") -> Path:
    """Render one run of a config (the real render stage)."""
    from pipeline.config.files import parse_config

    run_cfg = parse_config(cfg).run(name)
    run([PY, "-m", "pipeline.render", "--run-config-json",
         json.dumps(run_cfg.model_dump(mode="json")), "--out", str(run_dir)], timeout=180)
    return run_dir


def launch_argv(run_dir: Path, data_dir: Path, *, partition: str, time_min: int = 10,
                signal_delay_s: int = 30, job_name: str = "zs-test",
                extra: list[str] | None = None) -> list[str]:
    return [PY, "-m", "pipeline.train", "launch", "--run-dir", str(run_dir),
            "--data-dir", str(data_dir), "--launcher", "slurm", f"--partition={partition}",
            "--time-min", str(time_min), "--cpus-per-task", "1",
            "--signal-delay-s", str(signal_delay_s), "--job-name", job_name,
            "--poll-s", "1", *(extra or [])]


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def node_records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "nodes").glob("*.json"))]


def squeue(job_id: str, fmt: str) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", fmt],
                         capture_output=True, text=True, timeout=30)
    return out.stdout


def jobs_named(name: str, workdir: Path) -> list[str]:
    """Ids of every job with this name submitted from ``workdir`` that squeue still knows
    (MinJobAge keeps ended ones; other tests' jobs may share the name)."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-n", name, "-o", "%i\x1f%Z"],
                         capture_output=True, text=True, timeout=30)
    ids = set()
    for line in out.stdout.splitlines():
        jid, _, cwd = line.partition("\x1f")
        if Path(cwd) == workdir:
            ids.add(jid)
    return sorted(ids, key=int)


def wait_for(pred: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def final_weights(run_dir: Path, data_dir: Path) -> dict[str, Any]:
    """The trained weights, through the real consolidate stage (HF safetensors)."""
    from safetensors.torch import load_file

    out = run_dir / "hf"
    run([PY, "-m", "pipeline.consolidate", "--run-dir", str(run_dir), "--data-dir",
         str(data_dir), "--out", str(out)], timeout=300)
    tensors: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    assert tensors, f"no safetensors in {out}"
    return tensors


def worker_pids(run_dir: Path, rank: int) -> list[int]:
    """PIDs of `pipeline.train worker` processes of this run with RANK=rank (all nodes' processes
    are visible from the host: the test cluster shares one PID namespace)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if b"worker" not in cmd or str(run_dir).encode() not in cmd:
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            found.append(int(proc.name))
    return found
