"""Rank 0's record of a training run: ``metrics.jsonl`` (one line per step), ``events.jsonl``
and the experiment trackers of ``train.trackers`` (``pipeline.observe.trackers``: TensorBoard, MLflow,
W&B; one tracker run per run dir across requeues, every step logged once). Every rank's
recorder keeps its heartbeat (the node task's hang watchdog); other ranks write nothing else.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

from pipeline.artifacts import METRICS, append_event, append_jsonl, attempts
from pipeline.checkpoint.format import config_hash
from pipeline.config.schema import RunConfig
from pipeline.observe.trackers import Trackers
from pipeline.train.watchdog import Heartbeat

log = logging.getLogger("pipeline.train")


class Recorder:
    """Rank 0's logs (see the module docstring); ``run`` chooses the trackers (none without
    it: metrics.jsonl and events only)."""

    def __init__(self, run_dir: Path, rank: int, run: RunConfig | None = None) -> None:
        self.run_dir = run_dir
        self.on = rank == 0
        self.attempt = attempts(run_dir) + 1 if self.on else 1
        self.heartbeat = Heartbeat(run_dir, rank)  # every rank: the node task's hang watchdog
        self.trackers: Trackers | None = None
        if self.on and run is not None and run.train.trackers:
            self.trackers = Trackers.for_training(
                run_dir, list(run.train.trackers), run.model_dump(mode="json"),
                config_hash(run), self.attempt)

    def event(self, name: str, **kw: Any) -> None:
        if self.on:
            append_event(self.run_dir, name, attempt=self.attempt, **kw)

    def step(self, rec: dict[str, Any]) -> None:
        self.heartbeat.beat(rec["step"], "train")
        # The trackers first: a step in metrics.jsonl is one they hold (their mark after a
        # kill is read from it; a step they hold but metrics.jsonl lacks would be logged again).
        if self.trackers is not None:
            self.trackers.log_step(rec)
        if self.on:
            append_jsonl(self.run_dir / METRICS, {**rec, "attempt": self.attempt})

    def close(self) -> None:
        if self.trackers is not None:
            # When a rank exits (75 after a stop, or a failure), torchrun SIGTERMs the others:
            # rank 0 may still be flushing its trackers (W&B's finish takes a second). The
            # signal waits until they are closed, then takes effect (the process still ends).
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                self.trackers.close()
            finally:
                self.trackers = None
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
