"""The trainer's checkpoint policy over the folders of :mod:`pipeline.checkpoint.format`: which one to
resume from, how a save runs across ranks (synchronously, or staged and written in the
background: :mod:`pipeline.checkpoint.async_save`), what a load restores after every rank verified
what it reads (:mod:`pipeline.checkpoint.read`). Collective methods import torch when called."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.artifacts import CHECKPOINTS, CKPT_TRAINER
from pipeline.checkpoint.format import (
    MANIFEST,
    TrainerState,
    clean_tmp,
    config_hash,
    damaged_aside,
    finalize,
    load_rng,
    move_aside,
    prune,
    resume_point,
    save_rng,
    step_dir,
    tmp_dir,
)
from pipeline.errors import PipelineError
from pipeline.io import read_json, write_json_atomic

if TYPE_CHECKING:
    from pipeline.config.schema import RunConfig

log = logging.getLogger(__name__)


class CheckpointManager:
    """One run's checkpoints as the trainer sees them: resume point, load, save, prune.

    ``resume``, ``save`` and ``load`` are collective (every rank calls them, in the same order);
    rank 0 alone chooses, writes manifests and prunes. The engine is anything with
    ``save(folder) -> {"scheduler"?, "digests"?}`` and ``load(folder, extra)``
    (``pipeline.train.engines.Engine``)."""

    def __init__(self, root: Path, *, config_hash: str, data_hash: str, keep_last: int,
                 backend: str, zero_stage: int | None, rank: int, world_size: int,
                 background: bool = False) -> None:
        self.root = root
        self.background = background  # train.checkpoint_async: pipeline.checkpoint.async_save
        self.inflight: Any = None  # the save whose files or manifest are still being written
        self._pg: Any = None  # the gloo group of background commits (made at the first one)
        self.config_hash = config_hash
        self.data_hash = data_hash
        self.keep_last = keep_last
        self.backend = backend
        self.zero_stage = zero_stage if backend == "deepspeed" else None
        self.rank = rank
        self.world_size = world_size
        self._verified: Any = None  # what resume's verification kept for load
        self._skipped: set[Path] = set()  # checkpoints found damaged by this resume
        self._reuse: Callable[[], Any] | None = None
        self.loaded: Path | None = None
        """The checkpoint the last :meth:`load` restored (an older one than asked, if that one
        turned out damaged)."""
        self.read_into_engine = 0
        """How many of the engine's tensors that load read straight into (its ``reuse``
        targets, :mod:`pipeline.checkpoint.reuse`), not into fresh memory."""

    @classmethod
    def for_run(cls, run_dir: Path, run: RunConfig, *, data_hash: str, rank: int,
                world_size: int) -> CheckpointManager:
        """The manager of ``run_dir/checkpoints`` for the rendered ``run``."""
        return cls(run_dir / CHECKPOINTS, config_hash=config_hash(run), data_hash=data_hash,
                   keep_last=run.train.keep_last, backend=run.train.backend,
                   zero_stage=run.train.zero_stage, rank=rank, world_size=world_size,
                   background=run.train.checkpoint_async)

    def resume(self, reuse: Callable[[], Any] | None = None) -> Path | None:
        """Collective: the checkpoint every rank resumes from. Rank 0 removes half-written
        folders, chooses with :func:`resume_point` (structure, config and data only) and
        broadcasts its choice; every rank then verifies its share and the ranks agree
        (:func:`pipeline.checkpoint.read.verify_collective`) before any engine reads anything
        (the large files a rank reads itself and that have block checksums are verified block
        by block as they are read, :meth:`load`). A checkpoint that fails is skipped for the
        next older one, with a warning. The verified bytes wait for :meth:`load`.

        ``reuse`` (the engine's ``load_targets``): the engine's tensors, by their place in what
        it will load, that the load may be read into instead of fresh memory
        (:mod:`pipeline.checkpoint.reuse`), and the optimizer state a requeued job's engine
        makes for the load from the resume's start on."""
        if self.rank == 0:
            clean_tmp(self.root)
        self._skipped = set()
        self._reuse = reuse
        return self._choose()

    def _choose(self) -> Path | None:
        """Collective: :meth:`resume`'s choice among the checkpoints not in ``_skipped``. A
        checkpoint that fails is moved aside by rank 0 (never deleted); when folders were
        moved aside and none is left to resume from, every rank raises the same
        :class:`~pipeline.errors.PipelineError` naming them (a silent start from step 0 would
        throw the run's progress away unnoticed)."""
        import torch.distributed as dist

        from pipeline.checkpoint.read import verify_collective

        self._verified = None
        skip = self._skipped
        while True:
            box: list[Any] = [None]
            if self.rank == 0:
                try:
                    found = resume_point(self.root, self.config_hash, self.data_hash,
                                         contents=False, skip=frozenset(skip))
                    box = [None if found is None else str(found[1])]
                    if found is None and damaged_aside(self.root):
                        box = [("error", self._none_left())]
                except PipelineError as err:  # every rank stops with it, none waits
                    box = [("error", str(err))]
            dist.broadcast_object_list(box, src=0)
            if isinstance(box[0], tuple):
                raise PipelineError(box[0][1])
            if box[0] is None:
                return None
            path = Path(box[0])
            verified, why = verify_collective(path, self.rank, self.world_size, self._reuse)
            if why is None:
                self._verified = verified
                return path
            if self.rank == 0:
                move_aside(path, why)
            dist.barrier()  # moved before rank 0 lists the folders again
            skip.add(path)

    def _none_left(self) -> str:
        aside = damaged_aside(self.root)
        shown = ", ".join(p.name for p in aside[-5:]) + (" ..." if len(aside) > 5 else "")
        return (f"no checkpoint in {self.root} verifies: {len(aside)} damaged folder(s) moved "
                f"aside there ({shown}); inspect them (the job log says why each failed), then "
                "move or delete them and start the stage again to train from step 0")

    def load(self, path: Path, engine: Any, loader: Any) -> TrainerState:
        """Restore the engine, the loader and (same world size only) this rank's RNG from
        ``path``, a folder that :meth:`resume` chose; returns the trainer's state saved with
        it (``loaded`` is the folder it came from). The engine reads only verified bytes: the
        small files this rank verified from memory (``extra["verified"]``), the large ones
        block by block as it reads them (:mod:`pipeline.checkpoint.read`). The engines
        unpickle nothing but through allow-lists.

        A block found damaged while the engine reads (DCP fails on every rank together) means
        the engine holds part of that checkpoint: the next older one that verifies is loaded
        over it, with a warning (every tensor the engine loads is in each checkpoint of the
        run). With none left, a :class:`~pipeline.errors.PipelineError` says what to do: a
        fresh start would need a fresh engine."""
        from pipeline.checkpoint.stream import CheckpointDamaged

        while True:
            try:
                state = self._load(path, engine, loader)
                self.loaded = path
                return state
            except CheckpointDamaged as err:
                if self.rank == 0:
                    move_aside(path, str(err))
                self._skipped.add(path)
                older = self._choose()
                if older is None:
                    raise PipelineError(
                        f"{err}. No older checkpoint of this run verifies, and the engine had "
                        f"already loaded part of this one (moved aside in {self.root} for "
                        "inspection): start the stage again to train from step 0"
                    ) from None
                path = older

    def _load(self, path: Path, engine: Any, loader: Any) -> TrainerState:
        verified = self._verified
        self._verified = None
        if verified is not None and verified.root != path:
            verified = None
        saved_world = read_json(path / MANIFEST).get("world_size")
        extra: dict[str, Any] = {}
        if self.backend == "deepspeed" and saved_world != self.world_size:
            # ZeRO partitions do not reshard: load DeepSpeed's universal form of it instead.
            if verified is not None:
                verified.release()
            extra["universal"] = self._universal(path, saved_world)
        elif verified is not None:
            extra["verified"] = verified
        state = TrainerState.read(path / CKPT_TRAINER)
        targets = getattr(verified, "targets", None) if "verified" in extra else None
        try:
            engine.load(path, {"scheduler": state.scheduler, **extra})
        finally:
            if verified is not None:
                verified.release()
        self.read_into_engine = 0 if targets is None else targets.claimed
        loader.load_state_dict(state.loader)
        if saved_world == self.world_size:
            load_rng(path, self.rank)
        return state

    def _universal(self, path: Path, saved_world: Any) -> Path:
        """Collective: rank 0 converts ``path`` to (or verifies) its universal sibling; every
        rank gets the folder, or the same error."""
        import torch.distributed as dist

        from pipeline.checkpoint.universal import ensure_universal, universal_dir

        box: list[Any] = [None]
        if self.rank == 0:
            log.info("checkpoint %s was saved by %s DeepSpeed ranks, this job has %d: loading "
                     "its universal conversion", path.name, saved_world, self.world_size)
            try:
                ensure_universal(path)
            except PipelineError as err:
                box = [str(err)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise PipelineError(box[0])
        return universal_dir(path)

    def save(self, engine: Any, state: TrainerState) -> Path:
        """Collective: every rank writes into the tmp folder (engine files, its RNG), rank 0
        the trainer state; rank 0 then gathers the writers' checksums and finalizes (manifest
        last, rename into place, prune). ``state.scheduler`` is updated from the engine.

        In the background (``train.checkpoint_async`` and an engine with ``save_async``): the
        previous save is waited for first, then only the staging blocks; the files and the
        commit follow in :mod:`pipeline.checkpoint.async_save` (:meth:`wait` for them). The folder
        returned is where the checkpoint will be once committed."""
        import torch.distributed as dist

        if self.background and hasattr(engine, "save_async"):
            return self._save_in_background(engine, state)
        tmp = tmp_dir(self.root, state.step)
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        extra = engine.save(tmp)
        state.scheduler = extra.get("scheduler")
        save_rng(tmp, self.rank)
        if self.rank == 0:
            write_json_atomic(tmp / CKPT_TRAINER, state.to_json())
        # Every rank's files are on disk (fsynced by the writer) before the manifest vouches
        # for them; the checksums taken while writing travel to rank 0 with this gather.
        digests: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(extra.get("digests", {}), digests, dst=0)
        if self.rank == 0:
            assert digests is not None
            known = {k: v for d in digests for k, v in (d or {}).items()}
            finalize(self.root, state.step, self._meta(state), self.keep_last, known)
        dist.barrier()
        return step_dir(self.root, state.step)

    def _save_in_background(self, engine: Any, state: TrainerState) -> Path:
        import torch.distributed as dist

        from pipeline.checkpoint.async_save import InFlight, commit_in_background

        self.wait()  # at most one save in flight: its staging buffers are reused
        if self._pg is None:  # collective: every rank's first save, in the same order
            self._pg = dist.new_group(backend="gloo")
        step, started = state.step, time.perf_counter()
        tmp = tmp_dir(self.root, step)
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        now, write = engine.save_async(tmp, self._pg)
        state.scheduler = now.get("scheduler")
        save_rng(tmp, self.rank)
        if self.rank == 0:
            write_json_atomic(tmp / CKPT_TRAINER, state.to_json())
        meta = self._meta(state)
        commit = commit_in_background(
            write, step=step, rank=self.rank, world_size=self.world_size, pg=self._pg,
            finalize=lambda known: finalize(self.root, step, meta, self.keep_last, known))
        self.inflight = InFlight(step, started, commit)
        return step_dir(self.root, step)

    def wait(self) -> tuple[int, float] | None:
        """Collective when a save is in flight: wait until it is committed; returns its step and
        the seconds from its start to the commit (None if none was in flight). Its failure is
        raised here, as the same error on every rank."""
        if self.inflight is None:
            return None
        done, self.inflight = self.inflight, None
        return done.step, done.future.result()

    def poll(self) -> tuple[int, float] | None:
        """:meth:`wait` if the save in flight has finished, else None (never blocks)."""
        if self.inflight is None or not self.inflight.future.done():
            return None
        return self.wait()

    def _meta(self, state: TrainerState) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "zero_stage": self.zero_stage,
            "world_size": self.world_size,
            "config_hash": self.config_hash,
            "data_manifest_sha256": self.data_hash,
            "tokens_seen": state.tokens_seen,
        }

    def step_dir(self, step: int) -> Path:
        """The folder of ``step``'s checkpoint."""
        return step_dir(self.root, step)

    def prune(self) -> list[Path]:
        """Keep the newest ``keep_last`` checkpoints (rank 0; ``save`` does it after each)."""
        return prune(self.root, self.keep_last) if self.rank == 0 else []
