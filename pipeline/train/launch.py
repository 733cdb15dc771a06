"""``python -m pipeline.train launch``: submit a run's training and wait for it (the train rule's
entry point).

The flags are :class:`pipeline.cluster.options.LaunchOptions`'s fields (defaults and help from
there); the submission is :mod:`pipeline.train.submit`'s, the job's node task
:mod:`pipeline.train.node`'s. ``--help`` imports neither torch nor submitit.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pipeline.cluster.options import add_arguments, from_args
from pipeline.errors import PipelineError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.train launch",
        description="Submit a rendered run's training (submitit) and wait until it finishes.",
    )
    p.add_argument("--run-dir", type=Path, required=True, help="results/runs/<run> (rendered)")
    p.add_argument("--data-dir", type=Path, required=True, help="results/data (manifest.json)")
    add_arguments(p.add_argument_group(
        "job options (the train rule passes the profile's resources; empty means unset)"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        opts = from_args(args)
        from pipeline.train.submit import launch

        summary = launch(args.run_dir, args.data_dir, opts)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
