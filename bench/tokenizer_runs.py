"""Tokenizer training on text with nowhere to split: wall time and peak memory of the real command.

    python -m bench.tokenizer_runs [--mb 50] [--cases letters,base64,words,zeros_gz] [--timeout 900]

Each case writes its input into a temporary folder and times ``python -m pipeline.tokenize
tokenizer train --input FILE --vocab-size 1024 --max-bytes <size + 1 MB>`` in a subprocess:

* ``letters``: ``--mb`` MB of ``a``, no whitespace (one word per piece before the cut);
* ``base64``: ``--mb`` MB of base64 of random bytes (whitespace-free, every piece different);
* ``words``: ``--mb`` MB of space-separated words (the ordinary case, for reference);
* ``zeros_gz``: a 4 MB ``.gz`` of 4 GiB of zeros, at the default ``--max-bytes`` (20 MB).

Printed: one line per case with the exit status, seconds and peak resident memory (MB).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("letters", "base64", "words", "zeros_gz")


def write_input(case: str, folder: Path, size: int) -> tuple[Path, list[str]]:
    """The case's input file and the extra arguments it is trained with."""
    budget = ["--max-bytes", str(size + (1 << 20))]
    if case == "letters":
        path = folder / "letters.txt"
        path.write_bytes(b"a" * size)
    elif case == "base64":
        path = folder / "base64.txt"
        path.write_bytes(base64.b64encode(os.urandom(size * 3 // 4)))
    elif case == "words":
        rng = random.Random(0)
        vocab = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
                 for _ in range(5000)]
        path = folder / "words.txt"
        with path.open("w") as f:
            written = 0
            while written < size:
                line = " ".join(rng.choices(vocab, k=12)) + "\n"
                written += f.write(line)
    else:
        path = folder / "zeros.txt.gz"
        member = gzip.compress(bytes(16 << 20), compresslevel=9)
        path.write_bytes(member * 256)  # 4 GiB inflated
        budget = []
    return path, budget


def time_case(case: str, folder: Path, size: int, timeout: float) -> str:
    path, extra = write_input(case, folder, size)
    argv = [sys.executable, "-m", "pipeline.tokenize", "tokenizer", "train", "--input", str(path),
            "--vocab-size", "1024", "--out", str(folder / f"tok-{case}"), *extra]
    start = time.perf_counter()
    try:
        rc: int | str = subprocess.run(argv, cwd=REPO, capture_output=True, timeout=timeout,
                                       env={**os.environ, "PYTHONPATH": str(REPO)}).returncode
    except subprocess.TimeoutExpired:
        rc = f"killed after {timeout:g} s"
    seconds = time.perf_counter() - start
    # ru_maxrss of the children (KiB on Linux): the largest so far, so run one case per call
    # for exact figures.
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    path.unlink()
    return f"{case:9s} rc={rc} {seconds:8.1f} s  peak {peak_mb:6.0f} MB  ({path.name})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=50, help="input size of the text cases (MB)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {CASES}")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a case is killed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            print(time_case(case, Path(tmp), args.mb << 20, args.timeout), flush=True)


if __name__ == "__main__":
    main()
