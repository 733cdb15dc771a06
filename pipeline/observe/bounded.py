"""Calls to a service that may never answer (an experiment tracker's server), each waited for a
bounded time, so that the service cannot hold up the stage that calls it.

A call runs in a daemon thread and the caller waits at most ``timeout`` seconds: a call that
does not return by then is left running (it cannot be cancelled; its thread does not keep the
process alive) and counts as failed. :class:`Guarded` wraps one service: after a failure it is
not called again for :data:`RETRY_AFTER_S` seconds, nor while a call of it is still running
(calls to one service never overlap), and each outage is reported once, as one line on stderr.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: How long one tracker call (creating its run, a step's numbers, closing) may take: seconds
#: in ``ZEROSNAKE_TRACKER_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`.
TIMEOUT_ENV = "ZEROSNAKE_TRACKER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
#: After a failed call the service is left alone this long (a multi-day training run gets it
#: back when it answers again; a stalled call is never stacked on).
RETRY_AFTER_S = 300.0


def call_timeout() -> float:
    """The bound on one call (``ZEROSNAKE_TRACKER_TIMEOUT_S``; a value that is not a positive
    number is reported and the default used: a tracker setting never stops a stage)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        warn(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds above 0; using "
             f"{DEFAULT_TIMEOUT_S:g} (set it to e.g. 30, or unset it)")
        return DEFAULT_TIMEOUT_S
    return value


def warn(message: str) -> None:
    """One line on stderr (rank 0's log, or the evaluate job's)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def reason(err: BaseException, timeout: float) -> str:
    """A failure in a few words: the first line of the error (clients put the URL and cause
    there; the rest is often a server's whole reply)."""
    if isinstance(err, CallTimeout):
        return f"no answer within {timeout:g} s"
    first = (str(err).strip().splitlines() or [""])[0]
    text = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class CallTimeout(Exception):
    """A call did not return within its bound (it may still be running)."""

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__("no answer in time")
        self.thread = thread


def bounded(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """``fn(*args)``, waited for at most ``timeout`` seconds: its result, its exception, or
    :class:`CallTimeout` (the call goes on in its daemon thread)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as err:  # handed to the caller, in its thread
            box["error"] = err

    thread = threading.Thread(target=target, name=f"bounded-{getattr(fn, '__name__', 'call')}",
                              daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CallTimeout(thread)
    if "error" in box:
        err = box["error"]
        if not isinstance(err, Exception):  # SystemExit in a client's thread: not ours to obey
            raise RuntimeError(f"{type(err).__name__}: {err}") from err
        raise err
    return box.get("value")


class Guarded:
    """One service's calls, each bounded; see the module docstring.

    ``label`` names it in warnings (``tracker mlflow (http://host:5000)``)."""

    def __init__(self, label: str, timeout: float) -> None:
        self.label = label
        self.timeout = timeout
        self.running: threading.Thread | None = None  # a call that did not return in time
        self.resume_at = 0.0
        self.failing = False

    def available(self, after_pause: bool = True) -> bool:
        """No call of it still running and (``after_pause``) not in a pause after a failure."""
        if self.running is not None:
            if self.running.is_alive():
                return False
            self.running = None
        return not after_pause or time.monotonic() >= self.resume_at

    def call(self, what: str, fn: Callable[..., Any], *args: Any, after_pause: bool = True
             ) -> bool:
        """``fn(*args)`` when the service is available: True when it returned in time, False
        when it failed, timed out or was not tried (warned once per outage). A last call (a
        close) passes ``after_pause=False``: tried even in a pause, never over a running one."""
        if not self.available(after_pause):
            return False
        try:
            bounded(fn, *args, timeout=self.timeout)
        except Exception as err:
            if isinstance(err, CallTimeout):
                self.running = err.thread
            self.resume_at = time.monotonic() + RETRY_AFTER_S
            if not self.failing:
                warn(f"{self.label}: {what} failed ({reason(err, self.timeout)}); going on "
                     "without it")
            self.failing = True
            return False
        if self.failing and after_pause:  # a close says nothing of the server
            warn(f"{self.label}: answers again ({what})")
            self.failing = False
        return True
