"""Async checkpoint benchmark (issue 14): how long a save blocks training, background vs not.

    python -m bench.async_save [--hidden 768 --layers 12 --vocab 32000] [--backends fsdp,deepspeed]

For each engine, ``torchrun --nproc-per-node 2`` runs this module's worker: the real engine on a
random-weight Llama takes one optimizer step (Adam's moments exist), then saves the same state
alternately through the trainer's ``CheckpointManager``

* synchronously (``train.checkpoint_async: false``): the call returns once the files are
  fsynced and the manifest is committed — training is blocked for all of it (the baseline);
* in the background (``train.checkpoint_async: true``): the call returns after staging (the host
  copy); the write and the commit follow in the background, and the bench then waits for them
  (as the next save would) to time the whole save too.

Each figure is the slowest rank's, the median of ``--repeats`` rounds. Printed: blocking seconds
of each, and the ratio background/synchronous (goal <= 0.25), plus the background save's full
duration for reference.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.checkpoint import REPO, env


def worker(run_dir: Path, repeats: int) -> None:
    """One rank under torchrun: one step, then sync and background saves in turn, timed."""
    import os

    import torch
    import torch.distributed as dist

    from pipeline import checkpoint as ck
    from pipeline.checkpoint_manager import CheckpointManager
    from pipeline.config_files import load_run_config
    from pipeline.distenv import RankEnv
    from pipeline.io import read_json
    from pipeline.model import build_model

    run_cfg = load_run_config(run_dir / "config.json")
    env_ = RankEnv.from_env()
    dist.init_process_group("gloo")
    vocab = int(os.environ["BENCH_VOCAB"])
    model = build_model(run_cfg.model, vocab_size=vocab, eos_id=0, bos_id=None, seed=0)
    if run_cfg.train.backend == "deepspeed":
        from pipeline.train.engines import DeepSpeedEngine

        engine = DeepSpeedEngine(model, run_cfg, read_json(run_dir / "ds_config.json"))
    else:
        from pipeline.train.engines import FSDPEngine

        engine = FSDPEngine(model, run_cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(env_.rank)
    ids = torch.randint(0, vocab, (run_cfg.train.micro_batch_size, run_cfg.data.seq_len),
                        generator=g)
    t0 = time.perf_counter()
    engine.train_step([ids])
    step_s = time.perf_counter() - t0

    def manager(background: bool) -> CheckpointManager:
        m = CheckpointManager.for_run(run_dir, run_cfg, data_hash="bench-data",
                                         rank=env_.rank, world_size=env_.world_size)
        m.background = background
        return m

    sync_m, bg_m = manager(False), manager(True)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    rounds: dict[str, list[float]] = {"sync_s": [], "blocking_s": [], "background_total_s": []}
    step = 0
    for _ in range(repeats):
        step += 1
        dist.barrier()
        t0 = time.perf_counter()
        sync_m.save(engine, ck.TrainerState(step=step, loader={"bench": True}))
        rounds["sync_s"].append(slowest(time.perf_counter() - t0))
        step += 1
        dist.barrier()
        t0 = time.perf_counter()
        bg_m.save(engine, ck.TrainerState(step=step, loader={"bench": True}))
        rounds["blocking_s"].append(slowest(time.perf_counter() - t0))
        done = bg_m.wait()
        assert done is not None and done[0] == step
        rounds["background_total_s"].append(slowest(time.perf_counter() - t0))
    assert ck.verify(bg_m.step_dir(step)) is None, "the background save does not verify"
    if env_.rank == 0:
        path = bg_m.step_dir(step)
        nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        (run_dir / "bench.json").write_text(json.dumps(
            {"bytes": nbytes, "step_s": step_s, "rounds": rounds,
             **{k: statistics.median(v) for k, v in rounds.items()}}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="fsdp,deepspeed")
    ap.add_argument("--workdir", type=Path, default=None, help="parent of the temp dir (the disk)")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.repeats)
        return

    import yaml

    work = Path(tempfile.mkdtemp(prefix="zs-bench-async-", dir=args.workdir))
    results: dict[str, dict] = {}
    try:
        (work / "corpus.txt").write_text("x")
        for backend in args.backends.split(","):
            cfg = {
                "data": {"sources": [{"path": "corpus.txt", "format": "txt"}],
                         "tokenizer": {"vocab_size": args.vocab}, "seq_len": 64},
                "model": {"hidden_size": args.hidden, "intermediate_size": args.inter,
                          "num_layers": args.layers, "num_heads": args.heads,
                          "max_position_embeddings": 64},
                "cluster": {"nodes": 1, "gpus_per_node": 2},
                "train": {"backend": backend, "zero_stage": 2, "micro_batch_size": 1,
                          "max_steps": 10, "warmup_steps": 1, "keep_last": 2},
                "runs": {backend: {}},
            }
            (work / f"{backend}.yaml").write_text(yaml.safe_dump(cfg))
            run = work / "runs" / backend
            subprocess.run([sys.executable, "-m", "pipeline.render", "--config", f"{backend}.yaml",
                            "--run", backend, "--out", str(run)], cwd=work, env=env(), check=True,
                           capture_output=True)
            res = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                 "2", "-m", "bench.async_save", "--worker", str(run), "--repeats",
                 str(args.repeats)],
                cwd=REPO, env={**env(), "BENCH_VOCAB": str(args.vocab)}, capture_output=True,
                text=True, timeout=1200,
            )
            if res.returncode != 0:
                raise SystemExit(f"{backend} worker failed:\n{res.stderr[-4000:]}")
            r = json.loads((run / "bench.json").read_text())
            results[backend] = r
            print(f"{backend:9s} checkpoint {r['bytes'] / 1e6:6.0f} MB (one step: "
                  f"{r['step_s']:.2f} s): synchronous save {r['sync_s']:.3f} s; background save "
                  f"blocks {r['blocking_s']:.3f} s, done after {r['background_total_s']:.3f} s",
                  flush=True)
            shutil.rmtree(run / "checkpoints", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nratios (training blocked by a background save / by a synchronous save; "
          "goal <= 0.25):")
    for backend, r in results.items():
        print(f"  {backend:9s} {r['blocking_s'] / r['sync_s']:5.3f}x")


if __name__ == "__main__":
    main()
