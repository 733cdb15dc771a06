"""``train.compile`` benchmark (issue 14): tokens/s of the real trainer with every decoder layer
compiled (``torch.compile``, torchtitan's per-layer approach) against the same run eager.

    python -m bench.compile [--backends fsdp ddp] [--steps 30 --skip 8 --hidden 256 --layers 4]

Per backend, two runs rendered from one config that differ only in ``train.compile`` (the
baseline: ``compile: false``, eager), each ``python -m pipeline.train worker`` under
``torchrun --nproc-per-node 2`` (gloo, CPU), on the same corpus (the Python standard library,
tokenized by this pipeline), the same global batch and AdamW. tokens/s is the global batch's
tokens over the median step time of steps ``--skip + 1``..N from rank 0's ``metrics.jsonl``:
the first steps, where Dynamo traces and Inductor compiles (or loads its on-disk cache), are
left out; that one-off cost is printed apart as the compiled run's first-step time. Eager and
compiled runs alternate (``--compiled-first`` swaps them), so a change of load on the shared
cores shows up as a ratio that moves with the order. The ratio printed is compiled / eager.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DS_ACCELERATOR="cpu",
             TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
             PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""))
    return e


def run_module(argv: list[str], cwd: Path) -> None:
    res = subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=env(), capture_output=True,
                         text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} failed:\n{res.stderr[-4000:]}")


def tokenize(work: Path, vocab: int, seq_len: int) -> Path:
    data, src = work / "data", "<stdlib>/[a-m]*.py"
    run_module(["pipeline.tokenize", "tokenizer", "train", "--input", src, "--vocab-size", str(vocab),
                "--max-bytes", "3000000", "--out", str(data / "tokenizer")], work)
    run_module(["pipeline.tokenize", "shard", "--input", src, "--tokenizer",
                str(data / "tokenizer"), "--seq-len", str(seq_len), "--shards", "1", "--shard",
                "0", "--out", str(data), "--val-fraction", "0.02", "--no-progress"], work)
    run_module(["pipeline.tokenize", "gather", "--out", str(data), "--shards", "1",
                "--tokenizer", str(data / "tokenizer")], work)
    return data


def step_times(run_dir: Path) -> list[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in sorted(recs, key=lambda r: r["step"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=["fsdp", "ddp"],
                    choices=["fsdp", "ddp", "deepspeed"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=8, help="warm-up steps left out of the median")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--compiled-first", action="store_true")
    args = ap.parse_args()
    if args.skip >= args.steps:
        raise SystemExit("--skip must be below --steps")

    import yaml

    work = Path(tempfile.mkdtemp(prefix="zs-bench-compile-"))
    results: dict[str, dict[str, list[float]]] = {}
    try:
        data = tokenize(work, args.vocab, args.seq_len)
        seqs = json.loads((data / "manifest.json").read_text())["splits"]["train"]["sequences"]
        if seqs < args.steps * 2 * args.micro:
            raise SystemExit(f"corpus has {seqs} sequences; lower --steps or --micro")
        runs = {f"{b}-{mode}": {"train": {"backend": b, "compile": mode == "compiled",
                                          **({"zero_stage": 2} if b == "deepspeed" else {})}}
                for b in args.backends for mode in ("eager", "compiled")}
        cfg = {
            # The data are tokenized above; the source only has to exist for the config.
            "data": {"sources": [{"path": "corpus.txt", "format": "txt"}],
                     "tokenizer": {"vocab_size": args.vocab}, "seq_len": args.seq_len},
            "model": {"hidden_size": args.hidden, "intermediate_size": args.inter,
                      "num_layers": args.layers, "num_heads": args.heads,
                      "max_position_embeddings": args.seq_len},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "train": {"precision": "fp32", "micro_batch_size": args.micro,
                      "max_steps": args.steps, "warmup_steps": 2,
                      "checkpoint_every": args.steps},
            "runs": runs,
        }
        (work / "corpus.txt").write_text("x")
        (work / "config.yaml").write_text(yaml.safe_dump(cfg))
        order = ("compiled", "eager") if args.compiled_first else ("eager", "compiled")
        for backend in args.backends:
            for mode in order:
                name = f"{backend}-{mode}"
                run_dir = work / "runs" / name
                run_module(["pipeline.render", "--config", "config.yaml", "--run", name,
                            "--out", str(run_dir), "--data-manifest",
                            str(data / "manifest.json")], work)
                run_module(["torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "pipeline.train", "worker", "--run-dir", str(run_dir),
                            "--data-dir", str(data)], REPO)
                results.setdefault(backend, {})[mode] = step_times(run_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = 2 * args.micro * args.seq_len
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; global batch "
          f"{2 * args.micro} x {args.seq_len} tokens on 2 processes (CPU, gloo); {args.steps} "
          f"steps, median of steps {args.skip + 1}..{args.steps}; order {' then '.join(order)}")
    for backend, modes in results.items():
        med = {mode: statistics.median(t[args.skip:]) for mode, t in modes.items()}
        for mode in ("eager", "compiled"):
            print(f"  {backend:9s} {mode:8s}: {tokens / med[mode]:8.0f} tokens/s (median step "
                  f"{med[mode] * 1e3:6.1f} ms; first step {modes[mode][0]:6.1f} s)")
        print(f"  {backend:9s} ratio compiled / eager tokens/s: {med['eager'] / med['compiled']:.3f}")


if __name__ == "__main__":
    main()
