"""Parallel layouts on CPU (issue 11, for the record): tokens/s of each layout against pure data
parallelism, and the measured pipeline bubble against the schedule's theoretical fraction.

    python -m bench.layouts [--steps 20 --skip 5 --hidden 128 --layers 4 --seq-len 128]

Every layout trains the same Llama config on the same global batch (16 sequences a step) with
the real trainer (``python -m pipeline.train worker`` under ``torchrun``, gloo):

* ``dp`` (the baseline): 2 processes, micro 4 × 2 accumulation;
* ``tp2``: 2 processes, micro 8 × 2; ``pp2-gpipe`` / ``pp2-1f1b``: 2 processes, 4 micro batches
  of 4; ``tp2xpp2``: 4 processes (2 cores: oversubscribed, the ratio says so);
* ``one``: 1 process, micro 4 × 4: pure compute, the bubble's reference.

Bubble, measured: a stage does ``1/pp`` of the one-process step's compute, so the part of a
pipelined step it spends idle is ``1 − (t_one / pp) / t_pp`` (communication counts as idle).
Theoretical for GPipe and 1F1B: ``(pp − 1) / (m + pp − 1)`` with ``m`` micro batches.

Medians over steps ``--skip``..N; the layouts run one after another (the machine is noisy: run
twice, read the ratios).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.trainer import REPO, env

#: name → (processes, run overrides); all have a global batch of 16 sequences.
LAYOUTS: dict[str, tuple[int, dict]] = {
    "dp": (2, {"train": {"grad_accum": 2}}),
    "one": (1, {"cluster": {"gpus_per_node": 1}, "train": {"grad_accum": 4}}),
    "tp2": (2, {"train": {"tp": 2, "micro_batch_size": 8, "grad_accum": 2}}),
    "pp2-gpipe": (2, {"train": {"pp": 2, "grad_accum": 4, "pp_schedule": "gpipe"}}),
    "pp2-1f1b": (2, {"train": {"pp": 2, "grad_accum": 4}}),
    "tp2xpp2": (4, {"cluster": {"gpus_per_node": 4},
                    "train": {"tp": 2, "pp": 2, "grad_accum": 4}}),
    "ds-autotp2": (2, {"train": {"backend": "deepspeed", "zero_stage": 1, "tp": 2,
                                 "micro_batch_size": 8, "grad_accum": 2}}),
    "ds-pp2": (2, {"train": {"backend": "deepspeed", "zero_stage": 1, "pp": 2,
                             "grad_accum": 4}}),
}


def prepare(work: Path, args: argparse.Namespace) -> Path:
    data, src = work / "data", "<stdlib>/[a-m]*.py"
    for cmd in (
        ["pipeline.tokenize", "tokenizer", "train", "--input", src, "--vocab-size", str(args.vocab),
         "--max-bytes", "2000000", "--out", str(data / "tokenizer")],
        ["pipeline.tokenize", "shard", "--input", src, "--tokenizer", str(data / "tokenizer"),
         "--seq-len", str(args.seq_len), "--shards", "1", "--shard", "0", "--out", str(data),
         "--val-fraction", "0.02", "--no-progress"],
        ["pipeline.tokenize", "gather", "--out", str(data), "--shards", "1", "--tokenizer",
         str(data / "tokenizer")],
    ):
        subprocess.run([sys.executable, "-m", *cmd], cwd=work, env=env(), check=True,
                       capture_output=True)
    return data


def train(work: Path, data: Path, name: str, nproc: int, over: dict,
          args: argparse.Namespace) -> list[float]:
    import yaml

    (work / "corpus.txt").write_text("x")
    cfg = {
        "data": {"sources": [{"path": "corpus.txt", "format": "txt"}],
                 "tokenizer": {"vocab_size": args.vocab}, "seq_len": args.seq_len},
        "model": {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
                  "num_layers": args.layers, "num_heads": 4,
                  "max_position_embeddings": args.seq_len},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "train": {"micro_batch_size": 4, "max_steps": args.steps, "warmup_steps": 2,
                  "checkpoint_every": 10 * args.steps},
        "runs": {name: over},
    }
    (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    run = work / "runs" / name
    subprocess.run([sys.executable, "-m", "pipeline.render", "--config", f"{name}.yaml",
                    "--run", name, "--out", str(run), "--data-manifest",
                    str(data / "manifest.json")], cwd=work, env=env(), check=True,
                   capture_output=True)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(nproc), "-m", "pipeline.train", "worker",
                          "--run-dir", str(run), "--data-dir", str(data)], cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed:\n{res.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in recs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--only", nargs="*", default=None, help="layouts to run (dp always runs)")
    args = ap.parse_args()
    names = [n for n in LAYOUTS if args.only is None or n in args.only or n in ("dp", "one")]
    work = Path(tempfile.mkdtemp(prefix="zs-bench-layouts-"))
    try:
        data = prepare(work, args)
        step = {}
        for name in names:
            nproc, over = LAYOUTS[name]
            step[name] = statistics.median(train(work, data, name, nproc, over, args)[args.skip:])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = 16 * args.seq_len
    print(f"model: hidden {args.hidden}, {args.layers} layers, seq {args.seq_len}; global batch "
          f"16 sequences; median step of steps {args.skip + 1}..{args.steps}")
    print(f"{'layout':12} {'procs':>5} {'tokens/s':>10} {'vs dp':>7}")
    for name in names:
        print(f"{name:12} {LAYOUTS[name][0]:5d} {tokens / step[name]:10.0f} "
              f"{step['dp'] / step[name]:7.2f}")
    for name in (n for n in names if n.startswith("pp2")):
        pp, m = 2, 4
        measured = 1 - (step["one"] / pp) / step[name]
        print(f"bubble {name}: measured {measured:.2f}, theoretical (p-1)/(m+p-1) = "
              f"{(pp - 1) / (m + pp - 1):.2f}")


if __name__ == "__main__":
    main()
