"""One rank of ``python -m bench.gpu`` (issue 15), started by torchrun: the project's
:class:`pipeline.train.trainer.Trainer` for ``--steps`` steps on the GPU, no checkpoint; writes
``bench.json`` (peak and per-phase allocated memory, device, versions) and, with ``--profile``,
a kernel table of two more steps.

    torchrun --standalone --nproc-per-node=1 -m bench.gpu_worker --run-dir R --data-dir D --steps N
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_worker",
                                description="The project's Trainer for N steps, no checkpoint.")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True, help="train_step() calls (warm-up included)")
    p.add_argument("--profile", type=Path, default=None,
                   help="after the measured steps, profile 2 more and write the kernel table here")
    return p


def memory_phases(torch: Any, dev: Any, phase: str) -> dict[str, Any]:
    """Allocated now and the peak so far: after the build (model states in place), after the
    first steps (gradients and optimizer states exist) - what the planner's parts predict."""
    torch.cuda.synchronize(dev)
    return {"phase": phase, "allocated": torch.cuda.memory_allocated(dev),
            "peak": torch.cuda.max_memory_allocated(dev)}


#: Kernel name fragments → category, for the profile's summary (first match wins).
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
                ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "matmul")),
                ("nccl", ("nccl",)), ("copy", ("memcpy", "memset", "copy")))


def profile_steps(torch: Any, trainer: Any, out: Path, steps: int = 2) -> None:
    """Profile ``steps`` more train steps; write the top kernels and the share of GPU time by
    kind (matmul, attention, the rest) and the GPU's idle share of the wall time: where MFU
    goes."""
    from torch.profiler import ProfilerActivity, profile

    dev = trainer.device
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        torch.cuda.synchronize(dev)
        wall_us = (time.perf_counter() - t0) * 1e6
    averages = prof.key_averages()
    key = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") \
        else "self_cuda_time_total"
    kinds: dict[str, float] = {}
    total = 0.0
    for ev in averages:
        t = float(getattr(ev, key, 0) or 0)
        if t <= 0 or ev.key.startswith("aten::"):
            continue  # only kernels carry self device time; aten ops would count them twice
        total += t
        name = ev.key.lower()
        kind = next((k for k, frags in KERNEL_KINDS if any(f in name for f in frags)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + t
    lines = [f"# {steps} profiled steps: wall {wall_us / 1e3:.1f} ms, GPU kernels "
             f"{total / 1e3:.1f} ms (busy {100 * total / wall_us:.1f} %)"]
    lines += [f"#   {k:10s} {v / 1e3:9.1f} ms  {100 * v / max(total, 1):5.1f} % of kernel time"
              for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    lines.append(averages.table(sort_by=key, row_limit=40, max_name_column_width=90))
    out.write_text("\n".join(lines) + "\n")


def worker(argv: list[str]) -> int:
    import logging

    import torch

    from pipeline.train.trainer import Trainer

    args = worker_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[worker] %(levelname)s %(message)s")
    trainer = Trainer(args.run_dir, args.data_dir)
    try:
        dev = trainer.device
        if dev.type != "cuda":
            raise SystemExit(f"the trainer would run on {dev}, not on a GPU")
        trainer.build()
        if trainer.state.step != 0:
            raise SystemExit(f"{args.run_dir} resumed at step {trainer.state.step}: use a new one")
        phases = [memory_phases(torch, dev, "after build")]
        for i in range(args.steps):
            trainer.train_step()
            if i < 2:
                phases.append(memory_phases(torch, dev, f"after step {i + 1}"))
        torch.cuda.synchronize(dev)
        props = torch.cuda.get_device_properties(dev)
        if trainer.env.rank == 0:
            (args.run_dir / "bench.json").write_text(json.dumps({
                "max_memory_allocated": torch.cuda.max_memory_allocated(dev),
                "max_memory_reserved": torch.cuda.max_memory_reserved(dev),
                "phases": phases,
                "device": props.name, "device_mem_bytes": props.total_memory,
                "torch": torch.__version__, "cuda": torch.version.cuda,
                "n_params": trainer.n_params, "peak_flops": trainer.peak_flops,
            }))
        if args.profile is not None:
            try:  # the measured figures are written: a profiler failure must not lose them
                profile_steps(torch, trainer, args.profile)
            except Exception as err:  # reported; the row stands
                print(f"[worker] profile failed: {type(err).__name__}: {err}", file=sys.stderr)
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
