"""A rank's user-facing error, for the launcher: torchrun reports only that a rank failed (and
wraps its traceback), so a rank that refuses something (a damaged checkpoint, a file outside
the allow-list, a bad trainer state) records its one line in the run folder
(:data:`pipeline.artifacts.RANK_ERROR`), and the launcher ends with it."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from pipeline.artifacts import RANK_ERROR, read_json_or_none
from pipeline.io import write_json_atomic


def write_rank_error(run_dir: Path, attempt: str, rank: int, message: str) -> None:
    """Record a rank's :class:`PipelineError` for the launcher (:func:`rank_error`)."""
    with contextlib.suppress(OSError):  # the message is on the rank's stderr too
        write_json_atomic(Path(run_dir) / RANK_ERROR,
                          {"attempt": attempt, "rank": rank, "error": message,
                           "time": time.time()})


def rank_error(run_dir: Path, attempt_prefix: str) -> str | None:
    """``rank R: <message>`` when a rank of an attempt whose name starts with
    ``attempt_prefix`` (the launcher's attempt, or ``<job id>.``) recorded a user-facing
    error; else None. The message is data: control characters are shown escaped."""
    rec = read_json_or_none(Path(run_dir) / RANK_ERROR)
    if not isinstance(rec, dict) or not isinstance(rec.get("error"), str) \
            or not str(rec.get("attempt", "")).startswith(attempt_prefix) or not attempt_prefix:
        return None
    text = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in rec["error"])
    rank = rec.get("rank")
    return f"rank {rank}: {text}" if type(rank) is int else text
