"""Checkpoint folders: atomic, verified, pruned.

Layout of one checkpoint::

    checkpoints/step-000050/
        dcp/ or ds/          the engine's sharded files (DCP for fsdp, DeepSpeed's own)
        trainer.json         step, tokens seen, loader and scheduler state (rank-independent)
        rng/rank-00000.pt    torch / numpy / python RNG states of each rank
        manifest.json        written LAST: xxh3-128 and size of every file, config and data hashes

Every rank writes into ``checkpoints/.tmp-step-000050`` (the engines' files through
``fastio``, which checksums them as they are written); after a barrier, rank 0 gathers those
checksums, hashes whatever else is there, writes the manifest and renames the folder into place
(OLMo-core's tmp-then-rename). Manifests of older checkpoints with sha256 still verify.
A folder without a manifest that verifies is never resumed from.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.artifacts import CKPT_MANIFEST, checkpoint_steps, step_name
from pipeline.fastio import DIGEST, digest_file
from pipeline.io import read_json, sha256_file, write_json_atomic

log = logging.getLogger(__name__)

MANIFEST = CKPT_MANIFEST


def step_dir(root: Path, step: int) -> Path:
    """The folder name of the checkpoint of ``step``."""
    return root / step_name(step)


def tmp_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is built before it is renamed into place."""
    return root / f".tmp-{step_name(step)}"


def verify(path: Path) -> str | None:
    """None if the checkpoint's manifest verifies, else the reason it does not."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        meta = read_json(manifest)
    except ValueError as err:
        return f"manifest.json is not valid JSON ({err})"
    files = meta.get("files", {})
    for rel, info in files.items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != info["bytes"]:
            return f"{rel} has {f.stat().st_size} bytes, the manifest says {info['bytes']}"

    def check(item: tuple[str, dict[str, Any]]) -> str | None:
        rel, info = item
        if DIGEST in info:
            ok = digest_file(path / rel) == info[DIGEST]
        else:  # manifests written before the switch to xxh3
            ok = sha256_file(path / rel) == info.get("sha256")
        return None if ok else f"{rel} does not match its checksum"

    # Several files read at once keep the disk busier than one stream (and leave the pages
    # cached for the engine's load that follows).
    with ThreadPoolExecutor(max_workers=8) as pool:
        for why in pool.map(check, files.items()):
            if why is not None:
                return why
    return None


def latest_valid(root: Path) -> tuple[int, Path] | None:
    """The newest checkpoint whose manifest verifies; broken ones are skipped with a warning."""
    for step, path in reversed(checkpoint_steps(root)):
        why = verify(path)
        if why is None:
            return step, path
        log.warning("skipping checkpoint %s: %s", path, why)
    return None


def finalize(root: Path, step: int, meta: dict[str, Any], keep_last: int,
             known: dict[str, dict[str, Any]] | None = None) -> Path:
    """Rank 0, after every rank wrote into the tmp folder: manifest last, rename, prune.

    ``known``: checksums taken as the files were written (``{rel: {DIGEST, "bytes"}}``); any
    other file, or one whose size no longer matches, is hashed here."""
    tmp = tmp_dir(root, step)
    known = known or {}
    files: dict[str, dict[str, Any]] = {}
    todo: list[Path] = []
    for f in sorted(tmp.rglob("*")):
        if not f.is_file() or f.name == MANIFEST:
            continue
        rel = f.relative_to(tmp).as_posix()
        info = known.get(rel)
        if info is not None and info.get("bytes") == f.stat().st_size:
            files[rel] = {DIGEST: info[DIGEST], "bytes": info["bytes"]}
        else:
            todo.append(f)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for f, d in zip(todo, pool.map(digest_file, todo), strict=True):
            files[f.relative_to(tmp).as_posix()] = {DIGEST: d, "bytes": f.stat().st_size}
    files = dict(sorted(files.items()))
    write_json_atomic(tmp / MANIFEST, {**meta, "step": step, "files": files, "time": time.time()})
    final = step_dir(root, step)
    if final.exists():  # a checkpoint of the same step from an attempt that died after renaming
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for _, old in checkpoint_steps(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def clean_tmp(root: Path) -> None:
    """Remove half-written checkpoint folders left by a killed attempt (rank 0, at start)."""
    if root.is_dir():
        for p in root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# RNG state is saved as tensors and plain containers so that it loads with weights_only=True.
def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, numpy, python)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rng(ckpt: Path, rank: int) -> None:
    """Write this rank's RNG state into a checkpoint folder."""
    path = ckpt / "rng" / f"rank-{rank:05d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path)


def load_rng(ckpt: Path, rank: int) -> bool:
    """Restore this rank's RNG state if the checkpoint has one (not when the world size changed)."""
    path = ckpt / "rng" / f"rank-{rank:05d}.pt"
    if not path.is_file():
        return False
    set_rng_state(torch.load(path, weights_only=True))
    return True


@dataclass(kw_only=True)
class TrainerState:
    """What the loop needs besides the engine's state to continue exactly."""

    step: int = 0
    """Optimizer steps done."""
    tokens_seen: int = 0
    """Tokens consumed by all ranks together."""
    loader: dict[str, Any] | None = None
    """The data loader's state_dict."""
    scheduler: dict[str, Any] | None = None
    """The LR scheduler's state_dict (fsdp; DeepSpeed keeps its own)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "loader": self.loader,
            "scheduler": self.scheduler,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainerState:
        return cls(**d)
