"""Trainer benchmark (issue 5): tokens/s of the real trainer vs a bare hand-written FSDP2 loop.

    python -m bench.trainer [--steps 40 --hidden 256 --layers 4 --seq-len 256 --micro 8]

Both run under ``torchrun --nproc-per-node 2`` (gloo, CPU) on the same Llama config, the same
global batch and AdamW:

* trainer: ``python -m pipeline.train worker`` on a rendered run over a corpus tokenized by this
  pipeline (the Python standard library); tokens/s from its ``metrics.jsonl`` (rank 0's step
  time: loading the batch, the engine's step, the loss all-reduce);
* bare: this module's ``--bare`` worker: ``LlamaForCausalLM`` from the same config,
  ``fully_shard`` per decoder layer then the root, ``torch.optim.AdamW``, and per step
  forward, backward, ``clip_grad_norm_``, ``step``, ``zero_grad`` on the same token batches
  (read once up front), timed the same way.

The median step time over steps ``--skip``..N-1 (warm-up excluded; the last step also saves a
checkpoint in the trainer, which is outside its step time anyway). Goal: trainer ≥ 0.95× bare.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DS_ACCELERATOR="cpu",
             TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
             PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""))
    return e


def bare(run_dir: Path, data_dir: Path, steps: int) -> None:
    """The hand-written baseline loop (one rank under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.config.files import load_run_config
    from pipeline.data.loader import PackedDataset

    run = load_run_config(run_dir / "config.json")
    m, t = run.model, run.train
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = PackedDataset(data_dir, split="train")
    tok = ds.manifest["tokenizer"]
    cfg = LlamaConfig(vocab_size=tok["vocab_size"], hidden_size=m.hidden_size,
                      intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                      num_attention_heads=m.num_heads, max_position_embeddings=m.max_position_embeddings,
                      use_cache=False, tie_word_embeddings=m.tie_word_embeddings)
    cfg._attn_implementation = m.attn_implementation
    torch.manual_seed(t.seed)
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps,
                            weight_decay=t.weight_decay)
    mb = t.micro_batch_size
    batches = [
        torch.from_numpy(ds.get_rows(list(range((s * world + rank) * mb, (s * world + rank + 1) * mb)))
                         .astype("int64"))
        for s in range(steps)
    ]
    times = []
    for ids in batches:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        (run_dir / "bare.json").write_text(json.dumps({"step_times": times}))
    dist.destroy_process_group()


def torchrun(args: list[str], cwd: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", *args], cwd=cwd, env=env(),
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"torchrun {args} failed:\n{res.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--trainer-first", action="store_true", help="run the trainer before bare")
    ap.add_argument("--bare", nargs=2, type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare is not None:
        bare(args.bare[0], args.bare[1], args.steps)
        from bench.checkpoint import end_worker

        end_worker()

    import yaml

    work = Path(tempfile.mkdtemp(prefix="zs-bench-trainer-"))
    try:
        data = work / "data"
        src = "<stdlib>/[a-m]*.py"
        for cmd in (
            ["pipeline.tokenize", "tokenizer", "train", "--input", src, "--vocab-size", str(args.vocab),
             "--max-bytes", "3000000", "--out", str(data / "tokenizer")],
            ["pipeline.tokenize", "shard", "--input", src, "--tokenizer", str(data / "tokenizer"),
             "--seq-len", str(args.seq_len), "--shards", "1", "--shard", "0", "--out", str(data),
             "--val-fraction", "0.02", "--no-progress"],
            ["pipeline.tokenize", "gather", "--out", str(data), "--shards", "1", "--tokenizer",
             str(data / "tokenizer")],
        ):
            subprocess.run([sys.executable, "-m", *cmd], cwd=work, env=env(), check=True,
                           capture_output=True)
        seqs = json.loads((data / "manifest.json").read_text())["splits"]["train"]["sequences"]
        need = args.steps * 2 * args.micro
        if seqs < need:
            raise SystemExit(f"corpus has {seqs} sequences, {need} needed; lower --steps/--micro")
        (work / "corpus.txt").write_text("x")
        cfg = {
            "data": {"sources": [{"path": "corpus.txt", "format": "txt"}],
                     "tokenizer": {"vocab_size": args.vocab}, "seq_len": args.seq_len},
            "model": {"hidden_size": args.hidden, "intermediate_size": args.inter,
                      "num_layers": args.layers, "num_heads": args.heads,
                      "max_position_embeddings": args.seq_len},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "train": {"backend": "fsdp", "precision": "fp32", "micro_batch_size": args.micro,
                      "max_steps": args.steps, "warmup_steps": 2,
                      "checkpoint_every": args.steps},
            "runs": {"bench": {}},
        }
        (work / "config.yaml").write_text(yaml.safe_dump(cfg))
        run = work / "runs" / "bench"
        subprocess.run([sys.executable, "-m", "pipeline.render", "--config", "config.yaml", "--run",
                        "bench", "--out", str(run)], cwd=work, env=env(), check=True,
                       capture_output=True)
        # The machine's cores are shared: a change of load between the two runs shows up as a
        # ratio away from 1 either way; --trainer-first swaps the order to check for that.
        def run_bare() -> float:
            t0 = time.perf_counter()
            torchrun(["-m", "bench.trainer", "--steps", str(args.steps), "--bare", str(run),
                      str(data)], REPO)
            return time.perf_counter() - t0

        def run_trainer() -> float:
            t0 = time.perf_counter()
            torchrun(["-m", "pipeline.train", "worker", "--run-dir", str(run), "--data-dir",
                      str(data)], REPO)
            return time.perf_counter() - t0

        if args.trainer_first:
            t_trainer = run_trainer()
            t_bare = run_bare()
        else:
            t_bare = run_bare()
            t_trainer = run_trainer()
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        trainer_times = [r["step_time_s"] for r in recs]
        bare_times = json.loads((run / "bare.json").read_text())["step_times"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = 2 * args.micro * args.seq_len
    med_t = statistics.median(trainer_times[args.skip:])
    med_b = statistics.median(bare_times[args.skip:])
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"global batch {2 * args.micro} x {args.seq_len} tokens; {args.steps} steps, median of "
          f"steps {args.skip + 1}..{args.steps}")
    print(f"  trainer (pipeline.train worker): {tokens / med_t:8.0f} tokens/s  "
          f"(median step {med_t * 1e3:.0f} ms; torchrun wall {t_trainer:.0f} s)")
    print(f"  bare FSDP2 loop:                 {tokens / med_b:8.0f} tokens/s  "
          f"(median step {med_b * 1e3:.0f} ms; torchrun wall {t_bare:.0f} s)")
    print(f"\nratio trainer / bare: {med_b / med_t:.3f} (goal >= 0.95)")


if __name__ == "__main__":
    main()
