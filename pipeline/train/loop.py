"""``python -m pipeline.train worker``: one training process under ``torchrun``.

The training itself is :class:`pipeline.train.trainer.Trainer`; this module parses the worker's
arguments, turns a :class:`PipelineError` into one line on stderr and ``EXIT_USAGE``, and ends
the process with the trainer's exit code without the interpreter's teardown (see the end of
:func:`main`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from pipeline.artifacts import EXIT_USAGE
from pipeline.errors import PipelineError


def main(argv: list[str] | None = None) -> NoReturn:
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
        rc = run(args.run_dir, args.data_dir)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        rc = EXIT_USAGE
    # Out without the interpreter's teardown: there, a gloo worker thread still holding the
    # last collective's work takes the GIL to free its tensors and aborts the process
    # ("terminate called without an active exception"; core dump: pthread_exit from take_gil
    # in ProcessGroupGloo::AsyncWork::~AsyncWork), which torchrun would report as a failed
    # rank after a finished run. Seen in about one in ten of bench.checkpoint's workers on the
    # development VM, whose ending (a collective, then destroy_process_group) is the trainer's;
    # not yet caught in a trainer. Everything is written and closed by now (Trainer.close:
    # trackers, events, the process group).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
