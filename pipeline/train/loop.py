"""``python -m pipeline.train worker``: one training process under ``torchrun``.

The training itself is :class:`pipeline.train.trainer.Trainer`; this module parses the worker's
arguments and turns a :class:`PipelineError` into one line on stderr and ``EXIT_USAGE``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from pipeline.artifacts import EXIT_USAGE
from pipeline.cluster.env import ATTEMPT_ENV
from pipeline.errors import PipelineError
from pipeline.train.rank_error import write_rank_error


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m pipeline.train worker",
        description="One training process (started by torchrun on every rank).",
    )
    p.add_argument("--run-dir", type=Path, required=True, help="results/runs/<run>")
    p.add_argument("--data-dir", type=Path, required=True, help="results/data (manifest.json)")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"[rank {os.environ.get('RANK', '0')}] %(levelname)s %(message)s"
    )
    from pipeline.train.trainer import run

    try:
        return run(args.run_dir, args.data_dir)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        # For the launcher: torchrun reports only that a rank failed.
        write_rank_error(args.run_dir, os.environ.get(ATTEMPT_ENV, ""),
                         int(os.environ.get("RANK", "0")), str(err))
        return EXIT_USAGE
