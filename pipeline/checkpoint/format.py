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

:class:`pipeline.checkpoint.manager.CheckpointManager` is the trainer's policy over these
folders (resume point, saves across ranks, loads). Only the RNG helpers need torch, and they
import it when called: this module stays light for the login node's commands.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.artifacts import (
    CHECKPOINTS,
    CKPT_MANIFEST,
    UNIVERSAL_SUFFIX,
    checkpoint_steps,
    fsync_dir,
    inside,
    step_name,
)
from pipeline.checkpoint.fastio import (
    ALIGN,
    BLOCK_DIGEST,
    DIGEST,
    digest_file,
    digest_file_blocks,
    manifest_entry,
)
from pipeline.errors import PipelineError
from pipeline.io import read_json, sha256_file, sha256_json, write_json_atomic

if TYPE_CHECKING:
    from pipeline.config.schema import RunConfig

log = logging.getLogger(__name__)

MANIFEST = CKPT_MANIFEST


def step_dir(root: Path, step: int) -> Path:
    """The folder name of the checkpoint of ``step``."""
    return root / step_name(step)


def tmp_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is built before it is renamed into place."""
    return root / f".tmp-{step_name(step)}"


def _manifest_entries(path: Path, meta: Any) -> dict[str, dict[str, Any]] | str:
    """The manifest's ``files`` after checking its shape, or the reason it is refused.

    Paths are data: each must be a plain relative path that stays inside the folder."""
    if not isinstance(meta, dict):
        return "manifest.json is not a JSON object"
    for key in ("step", "files"):
        if key not in meta:
            return f"manifest.json has no {key!r} key"
    if not isinstance(meta["step"], int) or isinstance(meta["step"], bool):
        return f"manifest.json: 'step' is {meta['step']!r}, not a number"
    files = meta["files"]
    if not isinstance(files, dict):
        return "manifest.json: 'files' is not an object"
    if not files:
        return "manifest.json lists no files (a manifest must account for every file)"
    for rel, info in files.items():
        parts = rel.split("/")
        if (not rel or rel.startswith("/") or "\\" in rel or "\0" in rel
                or any(p in ("", ".", "..") for p in parts)):
            return f"manifest.json: the path {rel!r} is not a plain path inside the checkpoint"
        try:
            inside(path, rel)
        except PipelineError:
            return f"manifest.json: the path {rel!r} leaves the checkpoint folder"
        if rel == MANIFEST:
            return "manifest.json lists itself"
        if not isinstance(info, dict):
            return f"manifest.json: the entry of {rel} is not an object"
        size = info.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"manifest.json: the entry of {rel} has no valid 'bytes'"
        if not isinstance(info.get(DIGEST, info.get("sha256")), str):
            return f"manifest.json: the entry of {rel} has no checksum ({DIGEST!r} or 'sha256')"
        if "blocks" in info and not block_digests(info):
            return (f"manifest.json: the entry of {rel} has malformed 'blocks' (a block size "
                    f"and one {BLOCK_DIGEST} per block of the file)")
    return files


def block_digests(info: dict[str, Any]) -> tuple[int, list[str]] | None:
    """(block size, block checksums) of a manifest entry that lists them and whose list
    covers the file exactly, else None (no block checksums: the whole file is verified)."""
    blocks = info.get("blocks")
    if not isinstance(blocks, dict):
        return None
    size, digests = blocks.get("bytes"), blocks.get(BLOCK_DIGEST)
    if (not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % ALIGN
            or not isinstance(digests, list)
            or len(digests) != -(-info["bytes"] // size)
            or not all(isinstance(d, str) and len(d) == 16 for d in digests)):
        return None
    return size, digests


def _present_files(path: Path) -> set[str] | str:
    """Every file in the checkpoint folder (relative, posix), or the reason it is refused: a
    symbolic link or anything but plain files and folders."""
    present: set[str] = set()
    for parent, dirs, names in os.walk(path, followlinks=False):
        base = Path(parent)
        for name in [*dirs, *names]:
            p = base / name
            rel = p.relative_to(path).as_posix()
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                return f"{rel} is a symbolic link (a checkpoint holds only plain files)"
            if stat.S_ISREG(st.st_mode):
                present.add(rel)
            elif not stat.S_ISDIR(st.st_mode):
                return f"{rel} is not a regular file"
    return present


def verify(path: Path, *, contents: bool = True) -> str | None:
    """None if the checkpoint verifies, else the reason it does not (naming the file).

    Verified: the manifest is well formed and lists at least one file; its paths stay inside
    the folder; it accounts for every file there (nothing present and unlisted, nothing listed
    and missing); no symbolic links; every file has its listed size and checksum. The checksum
    guards against torn, truncated and corrupted files, not against someone who can also
    rewrite the manifest: what is read from a verified checkpoint is still only ever unpickled
    through allow-lists (``pipeline.checkpoint.tensors``).

    ``contents=False``: the structure only (no file read but the manifest); a resume leaves the
    checksums to the ranks that read the files (:mod:`pipeline.checkpoint.read`)."""
    if path.is_symlink():
        return f"{path.name} is a symbolic link (a checkpoint is a plain folder)"
    manifest = path / MANIFEST
    if manifest.is_symlink():
        return "manifest.json is a symbolic link (a checkpoint holds only plain files)"
    if not manifest.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        meta = read_json(manifest)
    except (OSError, ValueError, RecursionError) as err:
        return f"manifest.json is not valid JSON ({err})"
    present = _present_files(path)
    if isinstance(present, str):
        return present
    files = _manifest_entries(path, meta)
    if isinstance(files, str):
        return files
    unlisted = sorted(present - set(files) - {MANIFEST})
    if unlisted:
        return (f"{unlisted[0]} is not listed in manifest.json (a manifest accounts for every "
                f"file{f'; {len(unlisted) - 1} more' if len(unlisted) > 1 else ''})")
    for rel, info in files.items():
        if rel not in present:
            return f"{rel} is missing"
        size = (path / rel).stat().st_size
        if size != info["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {info['bytes']}"
    if not contents:
        return None

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


#: What a checkpoint folder that failed verification is renamed to (never deleted: a person
#: looks at it; the name no longer matches ``step-NNNNNN``, so no reader takes it).
DAMAGED = ".damaged-"


def move_aside(path: Path, why: str) -> Path:
    """Rename a damaged checkpoint folder (or a link in its place: the link, not its target)
    to ``step-NNNNNN.damaged-<UTC time>`` beside it; returns the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = path.with_name(f"{path.name}{DAMAGED}{stamp}")
    n = 1
    while dest.exists() or dest.is_symlink():
        n += 1
        dest = path.with_name(f"{path.name}{DAMAGED}{stamp}-{n}")
    os.replace(path, dest)
    log.warning("checkpoint %s does not verify (%s): moved aside to %s", path, why, dest.name)
    return dest


def damaged_aside(root: Path) -> list[Path]:
    """The folders :func:`move_aside` left in ``root``, oldest step first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if DAMAGED in p.name and p.name.startswith("step-"))


def latest_valid(root: Path, *, contents: bool = True,
                 skip: frozenset[Path] = frozenset()) -> tuple[int, Path] | None:
    """The newest checkpoint whose manifest verifies (``contents``: :func:`verify`'s), other
    than those in ``skip``; broken ones are moved aside (:func:`move_aside`)."""
    for step, path in reversed(checkpoint_steps(root)):
        if path in skip:
            continue
        why = verify(path, contents=contents)
        if why is None:
            return step, path
        move_aside(path, why)
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
            files[rel] = {k: info[k] for k in (DIGEST, "bytes", "blocks") if k in info}
        else:
            todo.append(f)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for f, (d, blocks) in zip(todo, pool.map(digest_file_blocks, todo), strict=True):
            files[f.relative_to(tmp).as_posix()] = manifest_entry(d, f.stat().st_size, blocks)
    files = dict(sorted(files.items()))
    write_json_atomic(tmp / MANIFEST, {**meta, "step": step, "files": files, "time": time.time()})
    final = step_dir(root, step)
    if final.exists() or final.is_symlink():
        # A folder of this step that resume did not take: it failed verification, or it is not
        # a folder of ours (a link). A person looks at it; nothing of it is deleted.
        move_aside(final, "a folder of the same step is being saved")
    os.replace(tmp, final)
    fsync_dir(root)
    prune(root, keep_last)
    return final


def prune(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` checkpoints; returns the removed folders. Only
    a folder that verifies (its manifest lists exactly what is there: the trainer wrote it) is
    deleted; anything else (a link, a folder with a file of someone's) is moved aside."""
    old = [path for _, path in checkpoint_steps(root)[:-keep_last]] if keep_last > 0 else []
    for path in old:
        why = verify(path, contents=False)
        if why is not None:
            move_aside(path, why)
            continue
        shutil.rmtree(path, ignore_errors=True)
        # DeepSpeed's universal conversion of it (pipeline.checkpoint.universal), if any.
        shutil.rmtree(path.with_name(path.name + UNIVERSAL_SUFFIX), ignore_errors=True)
    return old


def clean_tmp(root: Path) -> None:
    """Remove half-written checkpoint folders left by a killed attempt (rank 0, at start)."""
    if root.is_dir():
        for p in root.glob(".tmp-step-*"):
            if p.is_symlink():
                p.unlink()  # the link only: a rank must never write through it
            elif p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


# RNG state is saved as tensors and plain containers so that it loads with weights_only=True.
def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, numpy, python)."""
    import numpy as np
    import torch

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
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rng(ckpt: Path, rank: int) -> None:
    """Write this rank's RNG state into a checkpoint folder."""
    import torch

    path = ckpt / "rng" / f"rank-{rank:05d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path)


def load_rng(ckpt: Path, rank: int) -> bool:
    """Restore this rank's RNG state if the checkpoint has one (not when the world size changed)."""
    import torch

    path = ckpt / "rng" / f"rank-{rank:05d}.pt"
    if not path.is_file():
        return False
    import pickle

    try:  # tensors and plain containers only: nothing in the file is code
        state = torch.load(path, weights_only=True)
        set_rng_state(state)
    except pickle.UnpicklingError as err:
        raise PipelineError(f"{path}: refused to unpickle ({str(err).splitlines()[0]})") from None
    except (OSError, RuntimeError, EOFError, KeyError, TypeError, ValueError) as err:
        raise PipelineError(f"{path}: not this project's RNG state ({err})") from None
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

    @classmethod
    def read(cls, path: Path) -> TrainerState:
        """``trainer.json`` of a checkpoint, or a :class:`PipelineError` naming it."""
        try:
            d = read_json(path)
        except (OSError, ValueError, RecursionError) as err:
            raise PipelineError(f"{path}: unreadable ({err})") from None
        keys = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or not set(d) <= keys or not isinstance(d.get("step"), int):
            raise PipelineError(f"{path}: not a trainer state (expected an object with {sorted(keys)})")
        return cls.from_json(d)


# --- the trainer's checkpoint policy ---------------------------------------------------------

#: Train keys that do not change the trained model: bookkeeping and the layout (a run resumes on
#: another world size with the same global batch).
_LAYOUT_KEYS = ("checkpoint_every", "keep_last", "micro_batch_size", "grad_accum",
                "global_batch_size", "record_samples", "tp", "pp", "pp_schedule",
                "trackers")


def config_hash(run: RunConfig) -> str:
    """Hash of what determines the trained model: not bookkeeping (checkpoint cadence) and not
    the layout (nodes, processes, micro batch × accumulation), so that a run can resume on
    another world size with the same global batch."""
    d = run.model_dump(mode="json")
    for key in _LAYOUT_KEYS:
        d["train"].pop(key, None)
    d["cluster"] = None
    d["plan"] = None
    d["global_batch_size"] = run.global_batch_size
    return sha256_json(d)


def resume_point(root: Path, chash: str, data_hash: str, *, contents: bool = True,
                 skip: frozenset[Path] = frozenset()) -> tuple[int, Path] | None:
    """The checkpoint to resume from, if any: the newest that verifies (rank 0, no collective;
    ``contents`` and ``skip`` as in :func:`latest_valid`).

    Checkpoints of another config are moved aside (Snakemake reruns a run whose config changed:
    it must start fresh, not resume the old experiment). Checkpoints over other data are an
    error: resuming would silently mix datasets."""
    found = latest_valid(root, contents=contents, skip=skip)
    if found is None:
        return None
    meta = read_json(found[1] / MANIFEST)
    if meta.get("data_manifest_sha256") != data_hash:
        raise PipelineError(
            f"the checkpoints in {root} were trained on another tokenized dataset "
            f"(data manifest {str(meta.get('data_manifest_sha256', '?'))[:12]}, now "
            f"{data_hash[:12]}); delete {root} to start over, or use a new run name"
        )
    if meta.get("config_hash") != chash:
        tag = str(meta.get("config_hash", "unknown"))[:12]
        if not re.fullmatch(r"[0-9A-Za-z_-]+", tag):  # a name made from data stays one name
            tag = "unknown"
        dest = root.with_name(f"{CHECKPOINTS}.old-{tag}")
        n = 1
        while dest.exists() or dest.is_symlink():  # an earlier move of the same config stays
            n += 1
            dest = root.with_name(f"{CHECKPOINTS}.old-{tag}-{n}")
        log.warning("config changed since %s: moving old checkpoints to %s", found[1], dest)
        os.replace(root, dest)
        return None
    return found
