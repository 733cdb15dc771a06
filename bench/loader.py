"""Loader benchmark (issue 3): tokens/s delivered by BatchLoader vs a numpy memmap read.

    python -m bench.loader [--seq-len 2048] [--micro 8] [--steps 3000]

Tokenizes the Python standard library (one document per ``.py`` file) with this pipeline, then
reads the same sequences in the same shuffled order two ways:

* this loader: ``BatchLoader.next_batch()`` over the memory-mapped, checksum-verified Arrow
  shards (torch int64 tensors, what training consumes);
* baseline: the same tokens in a flat int32 ``.bin`` file read through ``np.memmap`` with the
  same indices, converted to the same torch int64 tensors (and, for reference, without it).

Goal (issue 14): loader / baseline >= 0.9, for the plain loader (no ``train.mixture``: the
default) and, for reference, with a mixture over the same data (``{source0: 1}``: every entry
goes through :class:`pipeline.data.loader.Mixture`, same rows in another order). The page cache is
warm for all; runs alternate and each keeps its best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch

    from pipeline.data.loader import BatchLoader, PackedDataset
    from pipeline.text.readers import iter_texts
    from pipeline.text.tokenizer import train_tokenizer
    from pipeline.tokenize import SourceSpec, gather, tokenize_shard

    work = Path(tempfile.mkdtemp(prefix="zs-bench-loader-"))
    try:
        spec = SourceSpec.from_args(["<stdlib>/**/*.py"])
        tok = train_tokenizer(iter_texts(spec, max_bytes=4_000_000), 4096, work / "tokenizer")
        for i in range(4):
            tokenize_shard(
                spec,
                tok,
                seq_len=args.seq_len,
                shards=4,
                shard=i,
                out=work,
                val_fraction=0.0,
                progress=False,
            )
        gather(work, 4, tok)

        t = time.perf_counter()
        ds = PackedDataset(work)
        ds.open_all()  # sha256 of every shard
        t_open = time.perf_counter() - t
        n = len(ds)
        flat = np.memmap(work / "flat.bin", dtype=np.int32, mode="w+", shape=(n, args.seq_len))
        flat[:] = ds.get_rows(np.arange(n))
        flat.flush()
        del flat
        mm = np.memmap(work / "flat.bin", dtype=np.int32, mode="r", shape=(n, args.seq_len))
        size_mb = n * args.seq_len * 4 / 1e6

        def run_loader(mixture: dict[str, float] | None = None) -> float:
            ld = BatchLoader(
                ds, micro_batch_size=args.micro, dp_rank=0, dp_size=1, seed=0, mixture=mixture
            )
            t0 = time.perf_counter()
            for _ in range(args.steps):
                ld.next_batch()
            return time.perf_counter() - t0

        def run_memmap(order: np.ndarray, to_torch: bool) -> float:
            t0 = time.perf_counter()
            for s in range(args.steps):
                rows = mm[order[s * args.micro : (s + 1) * args.micro]]
                if to_torch:
                    torch.from_numpy(rows).long()
            return time.perf_counter() - t0

        # The same sequences in the same order for the baseline (computed outside the timing).
        ld = BatchLoader(ds, micro_batch_size=args.micro, dp_rank=0, dp_size=1, seed=0)
        order = np.concatenate([ld.next_indices() for _ in range(args.steps)])
        # Shared machine: alternate the runs and keep each one's best of --repeats.
        dt_loader = dt_mix = dt_mm_torch = dt_mm_raw = float("inf")
        for _ in range(args.repeats):
            dt_loader = min(dt_loader, run_loader())
            dt_mix = min(dt_mix, run_loader({"source0": 1.0}))
            dt_mm_torch = min(dt_mm_torch, run_memmap(order, True))
            dt_mm_raw = min(dt_mm_raw, run_memmap(order, False))
        tokens = args.steps * args.micro * args.seq_len
        print(
            f"data: {n} sequences x {args.seq_len} ({size_mb:.0f} MB, {len(ds.entries)} shards); "
            f"open + sha256 of all shards {t_open:.2f}s ({size_mb / t_open:.0f} MB/s)"
        )
        print(
            f"loader {tokens / dt_loader / 1e6:.1f} M tok/s | memmap+torch {tokens / dt_mm_torch / 1e6:.1f} M tok/s"
            f" | memmap raw {tokens / dt_mm_raw / 1e6:.1f} M tok/s"
        )
        print(
            f"   loader / (memmap + same torch conversion) = {dt_mm_torch / dt_loader:.2f} (goal >= 0.9)"
            f"   loader / raw memmap = {dt_mm_raw / dt_loader:.2f}"
        )
        print(
            f"   with a mixture: loader / (memmap + same torch conversion) = "
            f"{dt_mm_torch / dt_mix:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
