"""The hang watchdog: ranks beat, the node task watches (torch-free).

A rank that stops making progress (frozen by SIGSTOP, stuck in a collective, spinning) does not
end its process, so torchrun would wait for it until the job's time limit. Instead every rank
touches a heartbeat file, ``<run_dir>/heartbeat/rank-NNNNN`` (:func:`pipeline.artifacts.
heartbeat_path`), holding its step, phase, host and pid: at start-up, after every step (at most
once a second unless the phase changes), before and after a checkpoint save. The node task that runs
torchrun watches the heartbeats of *its own* ranks (torchrun's children, whose ``RANK`` it reads
from ``/proc``) with its own monotonic clock, so clock skew between nodes and stale files of
earlier attempts do not matter. A rank whose heartbeat has not changed for longer than its
phase allows is named (rank, host, pid, step, process state) and the whole torchrun tree is
killed with SIGKILL (a stopped process ignores SIGTERM until it is continued); the launcher
then counts a failure and retries from the last complete checkpoint.

Phases and their allowances (:class:`Limits`, from the launch options):

* ``start``: from torchrun's start through process-group set-up, checkpoint load and the first
  step (``hang_startup_s``);
* ``train``: between two steps (``hang_timeout_s``);
* ``save``: a checkpoint save (``hang_save_s``); after it, ``train`` again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import heartbeat_path

#: A rank rewrites an unchanged phase at most this often (a step can take a few ms).
BEAT_INTERVAL_S = 1.0

#: /proc/<pid>/stat's state letter, as the event names it.
PROC_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O",
               "T": "stopped (SIGSTOP)", "t": "stopped by a tracer", "Z": "zombie"}


class Heartbeat:
    """A rank's heartbeat file (every rank writes its own). Writing is best effort: a full or
    read-only disk must not fail the training step (the watchdog then names the rank)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = heartbeat_path(run_dir, rank)
        self.rank = rank
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._last: tuple[str, float] = ("", 0.0)
        self.beat(0, "start")

    def beat(self, step: int, phase: str) -> None:
        now = time.monotonic()
        if phase == self._last[0] and now - self._last[1] < BEAT_INTERVAL_S:
            return
        self._last = (phase, now)
        rec = {"rank": self.rank, "step": step, "phase": phase, "host": self.host,
               "pid": self.pid, "time": time.time()}
        tmp = self.path.with_name(f".{self.path.name}.{self.pid}")
        try:
            self.path.parent.mkdir(exist_ok=True)
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, self.path)  # whole or not at all: the reader never sees half
        except OSError:
            pass


@dataclass(frozen=True)
class Limits:
    """Seconds without a new heartbeat each phase allows (0 disables the watchdog)."""

    train_s: float
    startup_s: float
    save_s: float

    @property
    def on(self) -> bool:
        return self.train_s > 0

    def of(self, phase: str) -> float:
        return {"start": self.startup_s, "save": self.save_s}.get(phase, self.train_s)


@dataclass
class Stale:
    """A rank that made no progress for longer than its phase allows."""

    rank: int | None
    pid: int
    host: str
    step: int | None
    phase: str
    stale_s: float
    limit_s: float
    state: str
    #: The likely cause among the stale ranks: a stopped process, else the ones furthest behind
    #: (the others are waiting for it in a collective).
    suspect: bool = True

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        if not self.suspect:
            who += " (waiting for the others)"
        at = f"step {self.step}" if self.step is not None else "no heartbeat yet"
        return (f"{who} on {self.host} (pid {self.pid}) made no progress for "
                f"{self.stale_s:.0f} s (phase {self.phase}, {at}, limit {self.limit_s:.0f} s; "
                f"process {self.state})")


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, from /proc; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    rest = text[text.rfind(")") + 2:].split()
    return int(rest[1]), rest[0]


def children(pid: int) -> list[int]:
    """The direct children of a process (torchrun's workers are its direct children)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[0] == pid:
                out.append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (one /proc scan)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                parent[int(entry.name)] = st[0]
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything below it. The tree is listed first: killing the parent
    first would reparent its children out of reach. SIGKILL also ends a stopped process."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):  # already gone
            os.kill(p, signal.SIGKILL)


def _rank_of(pid: int) -> int | None:
    """The RANK torchrun gave a worker (its environment), or None if unreadable."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            try:
                return int(item[5:])
            except ValueError:
                return None
    return None


@dataclass
class Watch:
    """The node task's view of its ranks' heartbeats while one torchrun runs.

    ``poll()`` returns the ranks that are past their phase's limit (empty while all progress).
    A worker that has written no heartbeat (yet) is in the ``start`` phase since the watch
    began; a heartbeat file whose pid is not one of this torchrun's workers (an earlier
    attempt's, another node's) is ignored.

    ``defer_s`` (jobs of several nodes): when none of this node's stale ranks is stopped, they
    are most likely blocked in a collective on a rank of another node, and that rank's node
    should name it. Heartbeats are throttled (:data:`BEAT_INTERVAL_S`), so the blocked ranks'
    last beat can be older than the frozen one's and their node would see the limit pass
    first; waiting ``defer_s`` more lets the culprit's node report (its kill then ends this
    node's torchrun too). A stopped rank is reported at once."""

    run_dir: Path
    torchrun_pid: int
    limits: Limits
    defer_s: float = 0.0
    host: str = field(default_factory=socket.gethostname)
    _seen: dict[int, tuple[Any, float]] = field(default_factory=dict)
    _ranks: dict[int, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.began = time.monotonic()

    def _heartbeat(self, pid: int) -> dict[str, Any] | None:
        rank = self._ranks.get(pid)
        if rank is None:
            rank = self._ranks[pid] = _rank_of(pid)
        if rank is None:
            return None
        try:
            rec = json.loads(heartbeat_path(self.run_dir, rank).read_text())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) and rec.get("pid") == pid else None

    def poll(self) -> list[Stale]:
        if not self.limits.on:
            return []
        now = time.monotonic()
        stale, fresh = [], []
        for pid in children(self.torchrun_pid):
            rec = self._heartbeat(pid)
            key = None if rec is None else (rec.get("step"), rec.get("phase"), rec.get("time"))
            seen = self._seen.get(pid)
            if seen is None or seen[0] != key:
                # A change (or the first sight of this worker): progress, as of now. A worker
                # seen for the first time without a heartbeat counts from the watch's start.
                self._seen[pid] = seen = (key, now if rec is not None else self.began)
            phase = "start" if rec is None else str(rec.get("phase", "train"))
            limit = self.limits.of(phase)
            st = _stat(pid)
            entry = Stale(rank=self._ranks.get(pid), pid=pid, host=self.host,
                          step=None if rec is None else rec.get("step"), phase=phase,
                          stale_s=now - seen[1], limit_s=limit,
                          state=PROC_STATES.get(st[1], st[1]) if st else "gone")
            (stale if now - seen[1] > limit else fresh).append(entry)
        if stale:
            # A stopped rank is frozen however recent its last heartbeat (heartbeats are
            # throttled, so the rank blocked waiting for it may look older): name it too.
            stale += [f for f in fresh if f.state.startswith("stopped")]
            waiting = not any(s.state.startswith("stopped") for s in stale)
            if waiting and max(s.stale_s - s.limit_s for s in stale) <= self.defer_s:
                return []
        return _suspects(stale)


def _suspects(stale: list[Stale]) -> list[Stale]:
    """Mark the likely culprits and list them first."""
    stopped = [s for s in stale if s.state.startswith("stopped")]
    if not stopped:
        steps = [s.step if s.step is not None else -1 for s in stale]
        stopped = [s for s, k in zip(stale, steps, strict=True) if k == min(steps, default=-1)]
    culprits = {id(s) for s in stopped}
    for s in stale:
        s.suspect = id(s) in culprits
    return sorted(stale, key=lambda s: (not s.suspect, s.rank if s.rank is not None else -1))
