"""Checkpoint benchmark (issue 5): the trainer's save and load MB/s against ``dd`` on the same disk.

    python -m bench.checkpoint [--hidden 768 --layers 12 --vocab 32000] [--backends fsdp,deepspeed]

For each engine, ``torchrun --nproc-per-node 2`` runs this module's worker: the real engine
(``pipeline.train.engines``) on a random-weight Llama takes one optimizer step (so Adam's
moments exist), then

* save: the trainer's own checkpoint path, ``CheckpointManager.save`` (engine files: DCP
  for fsdp, ``save_checkpoint`` for deepspeed; RNG states; ``trainer.json``; the xxh3
  manifest; the rename into place), timed from the first rank's start to the last rank's end;
* load: what a resume does, ``CheckpointManager.resume`` (rank 0 checks the structure, every
  rank verifies its share, ``pipeline.checkpoint.read``: DeepSpeed's partitions deserialized
  there, block-checked) and ``CheckpointManager.load`` (the engine reads: DCP's shards
  block-checked as they are read, straight into the model and optimizer; DeepSpeed's model
  states memory-mapped), after the checkpoint's pages were evicted from the page cache
  (``posix_fadvise(DONTNEED)``), so it reads the disk as ``dd`` does, and with the
  optimizer's state cleared (a requeued job's fresh engine has none: the load makes it); the
  weights, DeepSpeed's fp32 masters and Adam's moments are checked against xxh3 digests of
  those saved.
  These loads find memory that the process freed moments before, which a VM whose free
  memory goes back to the host (free page reporting) hands out faster than memory it has to
  fault in from the host; so
* the same load again, ``--reps`` times, each in a new ``torchrun`` (a requeued job: the
  engine built without a step, no optimizer state; the load makes it, in new memory), checked
  the same way. Both medians are printed; the new process's is the one a user waits for.
  Beside it, what that load costs on this machine done one after the other: ``dd``'s time plus
  the time two new processes at once take to fault in the new memory the load makes (its
  optimizer state, per rank; ``MADV_POPULATE_WRITE`` as the trainer's prefault), measured after
  the loads (the load overlaps the two, so it can beat their sum).

``dd`` in the same run, on the same bytes: right before *each* of ``--reps`` loads, and again
right after it, ``dd iflag=direct`` reads the checkpoint's own files (every file of at least
1 MiB, one after the other: one stream, as the issue's baseline), so that the load and its
baseline meet the same disk, the same places on it and the same state of the host's cache;
nothing is written between them. (An earlier version read a copy written just before each
load: on the development VM the host's cache served such a copy at 2.5-4 GB/s while the disk
itself read 1.6-1.7, and the copy's write-back slowed the load that followed.) ``dd`` writes a
file of the checkpoint's size (``oflag=direct conv=fsync``) after the loads, for the save's
ratio. MB/s = bytes / seconds; the load ratio printed is the median over the repetitions,
against the ``dd`` just before (and, in brackets, against the mean of the two). Goal: >= 0.7x
``dd``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DS_ACCELERATOR="cpu",
             OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""))
    return e


def evict(root: Path) -> None:
    """Drop the clean page-cache pages of every file under ``root`` (no root privileges needed)."""
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _Loader:
    """The data loader's part of a resume (the bench has no data)."""

    def load_state_dict(self, state: Any) -> None:
        assert state == {"bench": True}


def start_engine(run_dir: Path, step: bool = True) -> tuple[Any, Any, Any]:
    """Under torchrun: the process group, the run's engine on a random-weight Llama of
    ``BENCH_VOCAB`` tokens, one optimizer step taken if ``step`` (Adam's moments exist; without
    it, the engine a requeued job builds before its resume). Returns
    ``(run config, RankEnv, engine)``; shared with ``bench.async_save``."""
    import torch
    import torch.distributed as dist

    from pipeline.cluster.env import RankEnv
    from pipeline.config.files import load_run_config
    from pipeline.io import read_json
    from pipeline.model.build import build_model

    run_cfg = load_run_config(run_dir / "config.json")
    env_ = RankEnv.from_env()
    dist.init_process_group("gloo")
    vocab = int(os.environ["BENCH_VOCAB"])
    model = build_model(run_cfg.model, vocab_size=vocab, eos_id=0, bos_id=None, seed=0)
    if run_cfg.train.backend == "deepspeed":
        from pipeline.train.engines import DeepSpeedEngine

        engine: Any = DeepSpeedEngine(model, run_cfg, read_json(run_dir / "ds_config.json"))
    else:
        from pipeline.train.engines import FSDPEngine

        engine = FSDPEngine(model, run_cfg, torch.device("cpu"))
    if step:
        g = torch.Generator().manual_seed(env_.rank)
        ids = torch.randint(0, vocab, (run_cfg.train.micro_batch_size, run_cfg.data.seq_len),
                            generator=g)
        engine.train_step([ids])
    return run_cfg, env_, engine


def replaced_state(engine: Any) -> list[Any]:
    """DeepSpeed's fp32 master partitions (a resume reads into them; not through its
    ``load_targets``, which makes the moments a load reads into: the timed load does that)."""
    opt = getattr(getattr(engine, "engine", None), "optimizer", None)
    return list(getattr(opt, "single_partition_of_fp32_groups", []))


def restored_digests(engine: Any) -> list[str]:
    """xxh3 of every tensor a resume restores on this rank, in a fixed order: the weights
    (local shards), DeepSpeed's fp32 masters, the optimizer's moments (not ``step``)."""
    import torch
    import xxhash

    masters = replaced_state(engine)
    inner = _optimizer(engine)
    moments = [v for g in inner.param_groups for p in g["params"]
               for k, v in sorted(inner.state.get(p, {}).items())
               if k != "step" and isinstance(v, torch.Tensor)]
    out = []
    for t in list(_params(engine)()) + masters + moments:
        t = (t.to_local() if hasattr(t, "to_local") else t).detach().contiguous()
        out.append(xxhash.xxh3_64_hexdigest(t.view(-1).view(torch.uint8).numpy()))
    return out


def all_restored(engine: Any, saved: list[str]) -> bool:
    """Collective: whether every rank's :func:`restored_digests` equal those it saved."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([0.0 if restored_digests(engine) == saved else 1.0])
    dist.all_reduce(flag)
    return flag.item() == 0


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The benchmark model's shape (a Llama of ~134 M parameters by default)."""
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)


def run_bench_worker(work: Path, args: argparse.Namespace, backend: str, module: str,
                     *extra: str, **train: Any) -> dict[str, Any]:
    """Render a run of ``backend`` for the model of ``args`` in ``work``, run ``module``'s
    worker on it under ``torchrun --nproc-per-node 2``, return its ``bench.json`` (the run's
    checkpoints are removed)."""
    run = render_bench_run(work, args, backend, **train)
    try:
        return torchrun_worker(run, args, module, *extra)
    finally:
        shutil.rmtree(run / "checkpoints", ignore_errors=True)


def render_bench_run(work: Path, args: argparse.Namespace, backend: str, **train: Any) -> Path:
    """The run folder of ``backend`` for the model of ``args``, rendered in ``work``."""
    import yaml

    cfg = {
        "data": {"sources": [{"path": "corpus.txt", "format": "txt"}],
                 "tokenizer": {"vocab_size": args.vocab}, "seq_len": 64},
        "model": {"hidden_size": args.hidden, "intermediate_size": args.inter,
                  "num_layers": args.layers, "num_heads": args.heads,
                  "max_position_embeddings": 64},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "train": {"backend": backend, "zero_stage": 2, "micro_batch_size": 1,
                  "max_steps": 10, "warmup_steps": 1, **train},
        "runs": {backend: {}},
    }
    (work / "corpus.txt").write_text("x")
    (work / f"{backend}.yaml").write_text(yaml.safe_dump(cfg))
    run = work / "runs" / backend
    subprocess.run([sys.executable, "-m", "pipeline.render", "--config", f"{backend}.yaml",
                    "--run", backend, "--out", str(run)], cwd=work, env=env(), check=True,
                   capture_output=True)
    return run


def torchrun_worker(run: Path, args: argparse.Namespace, module: str, *extra: str,
                    result: str = "bench.json") -> dict[str, Any]:
    """``module``'s worker on ``run`` under ``torchrun --nproc-per-node 2``: its ``result``."""
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", module, "--worker", str(run), *extra],
        cwd=REPO, env={**env(), "BENCH_VOCAB": str(args.vocab)}, capture_output=True,
        text=True, timeout=1200,
    )
    if res.returncode != 0:
        raise SystemExit(f"{run.name} worker failed:\n{res.stderr[-4000:]}")
    return json.loads((run / result).read_text())


def _params(engine: Any) -> Any:
    """The engine's model parameters, as a function (DeepSpeed's load may re-bind them)."""
    if hasattr(engine, "engine"):
        return lambda: engine.engine.module.parameters()
    return lambda: engine.model.parameters()


def _optimizer(engine: Any) -> Any:
    """The engine's ``torch.optim`` optimizer (DeepSpeed's: the one inside its ZeRO wrapper)."""
    return engine.engine.optimizer.optimizer if hasattr(engine, "engine") else engine.opt


def worker(run_dir: Path) -> None:
    """One rank under torchrun: one step, then the trainer's save and a resume's load, timed."""
    import torch.distributed as dist

    from pipeline.checkpoint import format as ck
    from pipeline.checkpoint.manager import CheckpointManager

    run_cfg, env_, engine = start_engine(run_dir)
    params = _params(engine)
    # What every load must bring back (here and in fresh_load_worker): the weights, DeepSpeed's
    # fp32 masters, Adam's moments, as digests (no second copy of the state in memory).
    saved = restored_digests(engine)
    (run_dir / f"digests{env_.rank}.json").write_text(json.dumps(saved))
    root = run_dir / "checkpoints"
    state = ck.TrainerState(step=1, tokens_seen=0, loader={"bench": True})
    # Where the save's time goes: the engine's files, then rank 0's manifest (checksums).
    parts = {"engine_s": 0.0, "manifest_s": 0.0}

    def timed(key: str, fn: Any) -> Any:
        def wrapped(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                parts[key] += time.perf_counter() - t
        return wrapped

    engine.save = timed("engine_s", engine.save)
    ck.finalize = timed("manifest_s", ck.finalize)
    dist.barrier()
    t0 = time.perf_counter()
    manager = CheckpointManager.for_run(run_dir, run_cfg, data_hash="bench-data",
                                           rank=env_.rank, world_size=env_.world_size)
    # The whole save, timed as disk throughput: synchronous (bench.async_save measures what a
    # background save blocks; its resume() would also clear a save still in flight).
    manager.background = False
    manager.save(engine, state)
    t_save = time.perf_counter() - t0
    dist.barrier()
    nbytes = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    reps = []
    restored = True
    for _ in range(int(os.environ.get("BENCH_REPS", "1"))):
        reps.append(_timed_load(manager, engine, params, root, env_.rank))
        restored = all_restored(engine, saved)
        if not restored:
            break
    dist.barrier()
    if env_.rank == 0:
        # After the loads: a write of this size just before them would still be on its way
        # out of the host's cache while they read.
        probe = run_dir / "dd.bin"
        dd_write = dd_write_file(probe, nbytes)
        probe.unlink()
        (run_dir / "bench.json").write_text(json.dumps(
            {"save_s": t_save, "bytes": nbytes, "restored": restored, "reps": reps,
             "dd_write": dd_write, **parts}))
    dist.destroy_process_group()


def fresh_load_worker(run_dir: Path, index: int) -> None:
    """One rank of a requeued job: a new process builds the engine (no step, so no optimizer
    state: the load makes it, in memory this process never touched) and makes one cold load,
    as :func:`_timed_load`; every restored tensor is checked against the save's digests."""
    import torch.distributed as dist

    from pipeline.checkpoint.manager import CheckpointManager

    run_cfg, env_, engine = start_engine(run_dir, step=False)
    manager = CheckpointManager.for_run(run_dir, run_cfg, data_hash="bench-data",
                                           rank=env_.rank, world_size=env_.world_size)
    rep = _timed_load(manager, engine, _params(engine), run_dir / "checkpoints", env_.rank)
    restored = all_restored(engine, json.loads((run_dir / f"digests{env_.rank}.json").read_text()))
    if env_.rank == 0:
        (run_dir / f"fresh{index}.json").write_text(json.dumps(
            {**rep, "restored": restored, "new_bytes": state_bytes(engine)}))
    dist.destroy_process_group()


def state_bytes(engine: Any) -> int:
    """Bytes of this rank's optimizer state tensors: the memory a requeued job's load makes."""
    total = 0
    for state in _optimizer(engine).state.values():
        for t in state.values():
            local = t.to_local() if hasattr(t, "to_local") else t
            if hasattr(local, "untyped_storage") and local.numel() > 1:
                total += local.untyped_storage().nbytes()
    return total


#: One new process faulting in ``argv[1]`` bytes of new memory with the advice and steps of
#: ``pipeline.checkpoint.stream.prefault`` (``argv[2]``, ``argv[3]``); prints seconds. Its own
#: loop, not ``prefault``: that one gives up silently where the kernel refuses the advice.
_TOUCH = """
import ctypes, mmap, sys, time
n, advice, step = (int(a) for a in sys.argv[1:4])
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
m = mmap.mmap(-1, n)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
t0 = time.perf_counter()
for off in range(0, n, step):
    if libc.madvise(addr + off, min(step, n - off), advice):
        raise SystemExit("MADV_POPULATE_WRITE refused")
print(time.perf_counter() - t0)
"""


def first_touch_s(nbytes: int, procs: int = 2) -> float | None:
    """Seconds for ``procs`` new processes at once to fault in ``nbytes`` of new memory each:
    what a requeued job's ranks pay for the optimizer state their load makes, on this machine
    (on a VM that hands free memory back to its host, each page is the host's fault too).
    None where the advice is refused (not Linux 5.14+)."""
    from pipeline.checkpoint.stream import MADV_POPULATE_WRITE, PREFAULT_BYTES

    argv = [str(nbytes), str(MADV_POPULATE_WRITE), str(PREFAULT_BYTES)]
    runs = [subprocess.Popen([sys.executable, "-c", _TOUCH, *argv],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for _ in range(procs)]
    outs = [p.communicate()[0] for p in runs]
    if any(p.returncode for p in runs):
        return None
    return max(float(out) for out in outs)


def _timed_load(manager: Any, engine: Any, params: Any, root: Path,
                rank: int) -> dict[str, float]:
    """One cold resume: rank 0 reads the checkpoint with ``dd`` (direct I/O) and evicts its
    pages; the weights are scribbled over; then the manager's resume and load, timed."""
    import gc

    import torch
    import torch.distributed as dist

    gc.collect()  # no tensor of an earlier load may keep the checkpoint's pages mapped
    dist.barrier()
    dd_read = dd_read_files(root) if rank == 0 else 0.0
    if rank == 0:
        evict(root)
    for p in params():  # scribble over the weights: the load must bring them back
        with torch.no_grad():
            (p.to_local() if hasattr(p, "to_local") else p).data.add_(1.0)
    with torch.no_grad():
        for t in replaced_state(engine):
            t.add_(1.0)
    # A requeued job's engine has no optimizer state yet (torch.optim makes it at the first
    # step): the load makes the moments, as there.
    _optimizer(engine).state.clear()
    gc.collect()
    dist.barrier()
    # The trainer's resume: the manager's resume (rank 0's structural choice, then every rank
    # verifies its share) and load (the engine reads the files).
    t0 = time.perf_counter()
    path = manager.resume(reuse=getattr(engine, "load_targets", None))
    verify_s = time.perf_counter() - t0
    assert path is not None, "the checkpoint just saved does not verify"
    manager.load(path, engine, _Loader())
    dist.barrier()
    load_s = time.perf_counter() - t0
    # And right after: a load between two dd reads that disagree met a change of the disk.
    dd_after = dd_read_files(root) if rank == 0 else 0.0
    return {"load_s": load_s, "verify_s": verify_s, "dd_read": dd_read, "dd_after": dd_after}


def end_worker() -> NoReturn:
    """End a benchmark's torchrun worker (its results written) without the interpreter's
    teardown, where a gloo worker thread that still held the last collective's work aborted the
    process now and then ("terminate called without an active exception": it took the GIL
    during finalization; 3 times in ~30 workers on the development VM, core dump in
    ``ProcessGroupGloo::AsyncWork::~AsyncWork``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


DD_BS = 4 * 2**20


def _dd(args: list[str], count: int | None = None) -> tuple[int, float]:
    """Run ``dd`` (``bs=DD_BS``, ``count`` blocks or to the end): (bytes copied, seconds), as
    it reports them."""
    t0 = time.perf_counter()
    res = subprocess.run(["dd", *args, f"bs={DD_BS}", *([f"count={count}"] if count else [])],
                         capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", res.stderr)
    return (int(m.group(1)), float(m.group(2))) if m else ((count or 0) * DD_BS, wall)


def dd_write_file(path: Path, nbytes: int) -> float:
    """MB/s of ``dd`` writing ``path`` (``nbytes``, direct I/O, fsync)."""
    done, seconds = _dd(["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"],
                        max(1, nbytes // DD_BS))
    return done / seconds / 1e6


def dd_read_files(root: Path) -> float:
    """MB/s of ``dd`` reading the files of at least 1 MiB under ``root`` one after the other
    (direct I/O, never through the page cache): the checkpoint's own bytes, in one stream."""
    every = sorted(f for f in root.rglob("*") if f.is_file())
    files = [f for f in every if f.stat().st_size >= 2**20] or every  # a tiny model's: all
    runs = [_dd([f"if={f}", "of=/dev/null", "iflag=direct"]) for f in files]
    return sum(b for b, _ in runs) / sum(t for _, t in runs) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--backends", default="fsdp,deepspeed")
    ap.add_argument("--reps", type=int, default=5, help="cold loads per engine (median)")
    ap.add_argument("--workdir", type=Path, default=None, help="parent of the temp dir (the disk)")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fresh-load", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        if args.fresh_load is None:
            worker(args.worker)
        else:
            fresh_load_worker(args.worker, args.fresh_load)
        end_worker()

    work = Path(tempfile.mkdtemp(prefix="zs-bench-ckpt-", dir=args.workdir))
    results: dict[str, dict] = {}
    try:
        for backend in args.backends.split(","):
            os.environ["BENCH_REPS"] = str(args.reps)
            run = render_bench_run(work, args, backend)
            r = torchrun_worker(run, args, "bench.checkpoint")
            r["fresh"] = [torchrun_worker(run, args, "bench.checkpoint", "--fresh-load", str(i),
                                          result=f"fresh{i}.json") for i in range(args.reps)]
            shutil.rmtree(run / "checkpoints", ignore_errors=True)
            touches = [first_touch_s(r["fresh"][0]["new_bytes"]) for _ in range(3)]
            r["touch_s"] = None if None in touches else statistics.median(touches)
            results[backend] = r
            mb = r["bytes"] / 1e6
            print(f"{backend:9s} checkpoint {mb:7.0f} MB: save {r['save_s']:5.1f} s "
                  f"({mb / r['save_s']:5.0f} MB/s; dd write {r['dd_write']:5.0f} MB/s), "
                  f"saved state (weights, masters, moments) restored: {r['restored']}\n"
                  f"{'':10s}save = engine files {r['engine_s']:.2f} s + manifest (checksums, "
                  f"rename) {r['manifest_s']:.2f} s + rest", flush=True)
            for label, reps in (("in the saving process", r["reps"]),
                                ("each in a new process (a requeued job)", r["fresh"])):
                print(f"{'':10s}loads {label}:")
                for i, rep in enumerate(reps):
                    print(f"{'':10s}load {i + 1}: {rep['load_s']:5.2f} s "
                          f"({mb / rep['load_s']:5.0f} MB/s; verify {rep['verify_s']:.2f} s + "
                          f"engine {rep['load_s'] - rep['verify_s']:.2f} s); dd read just "
                          f"before {rep['dd_read']:5.0f} MB/s: "
                          f"{mb / rep['load_s'] / rep['dd_read']:4.2f}x (dd just after "
                          f"{rep['dd_after']:5.0f} MB/s)"
                          + ("" if rep.get("restored", True) else "  STATE NOT RESTORED"),
                          flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nratios (trainer / dd, cold page cache; load: median over the repetitions, each "
          "against the dd read just before it; goal >= 0.7):")
    for backend, r in results.items():
        mb = r["bytes"] / 1e6

        def median(reps: list[dict], around: bool = False, mb: float = mb) -> float:
            return statistics.median(
                mb / rep["load_s"] / ((rep["dd_read"] + rep["dd_after"]) / 2 if around
                                      else rep["dd_read"]) for rep in reps)

        restored = r["restored"] and all(rep["restored"] for rep in r["fresh"])
        print(f"  {backend:9s} save {mb / r['save_s'] / r['dd_write']:4.2f}x   load in a new "
              f"process (a requeued job) {median(r['fresh']):4.2f}x, in the saving process "
              f"{median(r['reps']):4.2f}x   (against the mean of the dd reads before and after: "
              f"{median(r['fresh'], True):4.2f}x, {median(r['reps'], True):4.2f}x); every "
              f"load restored the saved state: {restored}")
        # What a requeued job's load costs on this machine done one after the other: the disk at
        # dd's rate, then the new memory its load makes (Adam's moments) first touched by two
        # new processes at once. The load overlaps the two (the prefault), so it can beat this.
        new_mb = r["fresh"][0]["new_bytes"] / 1e6
        if r["touch_s"] is None:
            print(f"  {'':9s} (first touch of new memory not measured: MADV_POPULATE_WRITE "
                  "needs Linux 5.14+)")
            continue
        serial = statistics.median(mb / rep["dd_read"] + r["touch_s"] for rep in r["fresh"])
        load = statistics.median(rep["load_s"] for rep in r["fresh"])
        print(f"  {'':9s} new memory a requeued load makes: {new_mb:.0f} MB per rank, first "
              f"touched by 2 new processes at once in {r['touch_s']:.2f} s "
              f"({new_mb / r['touch_s'] / 1e3:.1f} GB/s each); dd and that one after the "
              f"other: {serial:.2f} s, the new-process load {load:.2f} s (sum / load: "
              f"{serial / load:4.2f}x)")


if __name__ == "__main__":
    main()
