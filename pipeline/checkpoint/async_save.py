"""Checkpoints that do not stop training: stage now, write and commit in the background.

A save has two parts. The *blocking* part runs on the training thread: the engine's state is
copied into host memory (DCP's ``DefaultStager``: pinned on GPUs, its buffers reused from one
save to the next, as torchtitan's ``async_with_pinned_mem``), so the next optimizer step may
change the live tensors. The *background* part writes those copies (through
:mod:`pipeline.checkpoint.fastio`, checksummed and fsynced as written), then every rank reports its
checksums or its error to rank 0 on a dedicated gloo group, and rank 0 alone writes the
manifest, renames the folder into place and prunes (:func:`pipeline.checkpoint.format.finalize`, the
same commit as a synchronous save). Until that manifest exists the folder is ``.tmp-step-N``,
which no resume ever reads: a job killed mid-write loses that checkpoint, never the previous
one.

At most one save is in flight: the next save (and a stop, the last step, the end of the
process) first waits for it. A failed background write is raised by that wait, on every rank
alike, naming the step; the checkpoints already committed stay.

fsdp and ddp use DCP's own ``async_save`` (the staging and write thread of
``torch.distributed.checkpoint``). DeepSpeed 0.19's asynchronous engines do not fit: the
``DecoupledCheckpointEngine`` needs the compiled ``async_io`` op (libaio) and hands the live
tensors to its writer process (committed before the next optimizer step, so training waits for
the write after all), and ``Nebula`` is Azure-only. So for deepspeed, ``save_checkpoint`` runs
as usual with the checkpoint engine's ``save`` replaced by a stager (a host copy of each state
dict, through the same ``StateDictStager``), and :class:`BackgroundWriter` writes them.

Fault injection for tests: ``ZEROSNAKE_FAULT_SLOW_SAVE_S`` delays each background commit by
that many seconds (a slow disk on demand: the only way to hold a save in flight long enough to
kill the job in the middle of it, deterministically).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SLOW_SAVE_ENV = "ZEROSNAKE_FAULT_SLOW_SAVE_S"


def make_stager() -> Any:
    """DCP's stager for this machine: pinned host buffers and non-blocking copies on an
    accelerator, plain host copies on CPU (pinning needs one). Staging itself is synchronous:
    the optimizer step that follows may change the tensors only after their copy exists."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    accel = torch.accelerator.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=accel, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=accel))


def dcp_writer(ckpt: Path, digests: Any) -> Any:
    """The DCP writer of ``ckpt/dcp``: several threads per rank (one leaves the disk idle),
    files through fastio's O_DIRECT writer, which checksums and fsyncs them itself."""
    import torch.distributed.checkpoint as dcp

    from pipeline.checkpoint import fastio

    writer = dcp.FileSystemWriter(str(ckpt / "dcp"), thread_count=4, sync_files=False)
    writer.fs = fastio.dcp_filesystem(digests)
    return writer


def dcp_save_async(state: dict[str, Any], ckpt: Path, pg: Any, stager: Any) -> Future:
    """Stage ``state`` (blocking) and write it with DCP's ``async_save`` on process group ``pg``;
    the future's result is ``{"digests": ...}`` relative to ``ckpt``."""
    import torch.distributed.checkpoint as dcp

    from pipeline.checkpoint import fastio

    digests = fastio.Digests()
    upload = dcp.async_save(state, storage_writer=dcp_writer(ckpt, digests), process_group=pg,
                            async_stager=stager)
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            f.result()
            out.set_result({"digests": digests.relative_to(ckpt)})
        except BaseException as err:  # handed to the waiter, raised on the training thread
            out.set_exception(err)

    upload.add_done_callback(done)
    return out


def run_in_background(fn: Callable[[], Any], name: str) -> Future:
    """``fn()`` in a daemon thread; its result or exception in the returned future. A daemon:
    a process ending on an error does not hang on a write whose peers are gone."""
    out: Future = Future()

    def target() -> None:
        try:
            out.set_result(fn())
        except BaseException as err:
            out.set_exception(err)

    threading.Thread(target=target, name=name, daemon=True).start()
    return out


class BackgroundWriter:
    """The deepspeed half: ``stage(state_dict, path)`` is the checkpoint engine's ``save`` during
    ``save_checkpoint`` (a host copy, kept for the writer); :meth:`start` then writes every
    staged file in a background thread (fastio's checksumming writer)."""

    def __init__(self, stager: Any, serialization: bool) -> None:
        self.stager = stager
        self.serialization = serialization
        self.items: list[tuple[Any, str]] = []

    def stage(self, state_dict: Any, path: str) -> None:
        self.items.append((self.stager.stage(state_dict), path))

    def start(self, ckpt: Path) -> Future:
        from pipeline.checkpoint import fastio

        items, self.items = self.items, []

        def write() -> dict[str, Any]:
            digests = fastio.Digests()
            with fastio.no_torch_crc32():
                for state_dict, path in items:
                    fastio.torch_save(state_dict, path, digests,
                                      _use_new_zipfile_serialization=self.serialization)
            return {"digests": digests.relative_to(ckpt)}

        return run_in_background(write, "zerosnake-ds-writer")


class InFlight:
    """The one save in flight on this rank: the engine's write, then the commit."""

    def __init__(self, step: int, started: float, future: Future) -> None:
        self.step = step
        self.started = started
        self.future = future


def commit_in_background(
    write: Future, *, step: int, rank: int, world_size: int, pg: Any,
    finalize: Callable[[dict[str, dict[str, Any]]], Any],
) -> Future:
    """After ``write`` (this rank's files): every rank sends rank 0 its checksums or its error
    over ``pg``; rank 0 commits with ``finalize(known_digests)`` if no rank failed; every rank
    learns the outcome. The future's result is the seconds from the start to the commit."""
    import torch.distributed as dist

    from pipeline.errors import PipelineError

    t0 = time.perf_counter()
    delay = float(os.environ.get(SLOW_SAVE_ENV, "0") or 0)

    def commit() -> float:
        err, digests = None, {}
        try:
            digests = write.result().get("digests", {})
        except BaseException as e:  # every rank still joins the gather below
            err = f"rank {rank}: {type(e).__name__}: {e}"
        if delay > 0:
            time.sleep(delay)
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object((err, digests), gathered, dst=0, group=pg)
        outcome: list[Any] = [None]
        if rank == 0:
            assert gathered is not None
            errors = [e for e, _ in gathered if e]
            if errors:
                outcome = [errors[0]]
            else:
                try:
                    finalize({k: v for _, d in gathered for k, v in (d or {}).items()})
                except BaseException as e:
                    outcome = [f"rank 0: {type(e).__name__}: {e}"]
        dist.broadcast_object_list(outcome, src=0, group=pg)
        if outcome[0] is not None:
            raise PipelineError(
                f"the checkpoint of step {step} was not saved ({outcome[0]}); the checkpoints "
                "committed before it are intact")
        return time.perf_counter() - t0

    return run_in_background(commit, f"zerosnake-commit-{step}")
