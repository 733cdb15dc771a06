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
import tempfile
import time
from pathlib import Path

from bench.checkpoint import add_model_args, end_worker, run_bench_worker, start_engine


def worker(run_dir: Path, repeats: int) -> None:
    """One rank under torchrun: one step, then sync and background saves in turn, timed."""
    import torch
    import torch.distributed as dist

    from pipeline.checkpoint import format as ck
    from pipeline.checkpoint.manager import CheckpointManager

    run_cfg, env_, engine = start_engine(run_dir)

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
            {"bytes": nbytes, "rounds": rounds,
             **{k: statistics.median(v) for k, v in rounds.items()}}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="fsdp,deepspeed")
    ap.add_argument("--workdir", type=Path, default=None, help="parent of the temp dir (the disk)")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.repeats)
        end_worker()

    work = Path(tempfile.mkdtemp(prefix="zs-bench-async-", dir=args.workdir))
    results: dict[str, dict] = {}
    try:
        for backend in args.backends.split(","):
            r = run_bench_worker(work, args, backend, "bench.async_save", "--repeats",
                                 str(args.repeats), keep_last=2)
            results[backend] = r
            print(f"{backend:9s} checkpoint {r['bytes'] / 1e6:6.0f} MB: "
                  f"synchronous save {r['sync_s']:.3f} s; background save "
                  f"blocks {r['blocking_s']:.3f} s, done after {r['background_total_s']:.3f} s",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nratios (training blocked by a background save / by a synchronous save; "
          "goal <= 0.25):")
    for backend, r in results.items():
        print(f"  {backend:9s} {r['blocking_s'] / r['sync_s']:5.3f}x")


if __name__ == "__main__":
    main()
