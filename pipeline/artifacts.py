"""The contract between stages: every file they exchange, its name, and one reader/writer each.

Stages talk only through files under the results tree (docs/ARCHITECTURE.md describes each
one). This module is where those names live and where they are read and written, so that a
name is spelled once and a torn line, a half-written folder or a missing file is treated the
same way by every stage. It imports no torch: the login node's commands (status, launch,
plan) use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.io import write_json_atomic

# --- exit codes ------------------------------------------------------------------------------
EXIT_OK = 0
#: A user's mistake (bad config, bad path): one line on stderr, no traceback.
EXIT_USAGE = 2
#: "Stopped at a checkpoint on request; requeue me" (EX_TEMPFAIL from sysexits.h).
EXIT_REQUEUE = 75

# --- the data directory (tokenize → render, train, consolidate, evaluate) ---------------------
#: The largest sequence and vocabulary a data manifest may claim: a number read from a file
#: sizes the model and the loader's buffers, so it is bounded before anything is built. The
#: config's ``data.seq_len`` and ``data.tokenizer.vocab_size`` share these
#: (``pipeline.config.types`` imports them: the manifest's reader sits below the config).
MAX_SEQ_LEN = 1 << 20
MAX_VOCAB_SIZE = 1 << 20
DATA_MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SHARDS_DIR = "shards"

# --- a run directory -------------------------------------------------------------------------
RUN_CONFIG = "config.json"  # render: the run's effective config
DS_CONFIG = "ds_config.json"  # render
FSDP_CONFIG = "fsdp.json"  # render
TOPOLOGY = "topology.json"  # render
PLAN_MD = "plan.md"  # render
PLAN_JSON = "plan.json"  # render: the planner's figures, machine-readable
LAUNCH = "launch.json"  # render: the launch command and the sbatch submission it makes
JOB = "job.json"  # train launcher: the submitted job (reattach reads it)
EVENTS = "events.jsonl"  # train: launcher and rank-0 events, one JSON object per line
METRICS = "metrics.jsonl"  # train: one JSON object per optimizer step
TRACKERS = "trackers.json"  # train → evaluate: the experiment trackers' run ids (one run per run dir)
TB_DIR = "tb"  # train, evaluate: TensorBoard event files
WANDB_DIR = "wandb"  # train, evaluate: W&B's local files (offline runs), unless WANDB_DIR is set
TRAIN_DONE = "train.done"  # train: written last when training finished (the rule's output)
STOPPED = "stopped.json"  # train: rank 0 stopped at a checkpoint on request
STOP = "STOP"  # launcher → ranks: stop at the next agreed step and save
LOCK = "train.lock"  # train: rank 0 holds it while training (one trainer per run dir)
PROBE_LOGITS = "probe_logits.safetensors"  # train → consolidate: logits of the final model
CHECKPOINTS = "checkpoints"
NODES = "nodes"  # launcher: one record per node and attempt
#: rank → launcher: a rank's user-facing error (a refused checkpoint, a bad file), so that the
#: launcher ends with that one line, not torchrun's wrapper around the rank's traceback.
RANK_ERROR = "rank_error.json"
HEARTBEAT_DIR = "heartbeat"  # train → launcher: rank-NNNNN, each rank's latest step and phase
SUBMITIT = "submitit"
HF_DIR = "hf"  # consolidate
HF_PROVENANCE = "zerosnake.json"  # consolidate: which checkpoint the HF dir came from
#: In a folder a command replaces as a whole (the tokenizer dir): "this command wrote me".
OUTPUT_MARKER = ".zerosnake-output"
EVAL_DIR = "eval"  # evaluate: metrics.json, loss.png, report.md
#: In the eval folder (evaluate replaces it as a whole): "evaluate wrote me".
EVAL_MARKER = ".zerosnake-eval"
EVAL_METRICS = "metrics.json"

#: Everything a run directory may hold (besides dotfiles and ``checkpoints.old-*``): what
#: render may write beside without littering a folder that is not a run's.
RUN_DIR_NAMES = frozenset({
    RUN_CONFIG, DS_CONFIG, FSDP_CONFIG, TOPOLOGY, PLAN_MD, PLAN_JSON, LAUNCH, JOB, EVENTS,
    METRICS, TRAIN_DONE, STOPPED, STOP, LOCK, PROBE_LOGITS, CHECKPOINTS, NODES, SUBMITIT, HF_DIR,
    EVAL_DIR, TB_DIR, HEARTBEAT_DIR, TRACKERS, WANDB_DIR, RANK_ERROR,
})

# --- a checkpoint folder ---------------------------------------------------------------------
CKPT_MANIFEST = "manifest.json"  # written last: the checkpoint is complete once it exists
#: ``step-N`` + this: DeepSpeed's universal conversion of step N, beside it (another world size).
UNIVERSAL_SUFFIX = ".universal"
CKPT_TRAINER = "trainer.json"
#: ASCII digits to the very end (``$`` would match before a trailing newline, ``\d`` other
#: scripts' digits: a folder name is data).
STEP_RE = re.compile(r"^step-([0-9]{6,})\Z")


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    """A rank's heartbeat file (``pipeline.train.watchdog``): step, phase, host, pid, time."""
    return run_dir / HEARTBEAT_DIR / f"rank-{rank:05d}"


def step_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"step-{step:06d}"


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (``results/runs/<run>``)."""

    path: Path

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def train_done(self) -> Path:
        return self.path / TRAIN_DONE

    @property
    def stopped(self) -> Path:
        return self.path / STOPPED

    @property
    def stop(self) -> Path:
        return self.path / STOP

    @property
    def events(self) -> Path:
        return self.path / EVENTS

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def job(self) -> Path:
        return self.path / JOB

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def hf(self) -> Path:
        return self.path / HF_DIR

    @property
    def eval(self) -> Path:
        return self.path / EVAL_DIR


# --- JSON and JSON lines ---------------------------------------------------------------------


def read_json_or_none(path: Path) -> Any:
    """A JSON file's content, or None when it is missing or unreadable (a status display's
    view; stages that need the file use :func:`read_artifact`)."""
    if not path.is_file():  # absent, or a folder or FIFO (opening a FIFO would hang)
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None


def read_artifact(path: Path, what: str, *, hint: str = "") -> dict[str, Any]:
    """A JSON object a stage needs, or a :class:`PipelineError` naming the file and what to do."""
    try:
        if path.exists() and not path.is_file():  # a folder or FIFO (opening it would hang)
            raise OSError("not a regular file")
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PipelineError(f"{path}: no {what}{'; ' + hint if hint else ''}") from None
    except (OSError, ValueError, RecursionError) as err:
        raise PipelineError(
            f"{path}: {what} is unreadable ({err}){'; ' + hint if hint else ''}"
        ) from None
    if not isinstance(data, dict):
        raise PipelineError(f"{path}: {what} is not a JSON object")
    return data


def read_jsonl(path: Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a line cut by a crash (or the first, cut line of a
    tail read) is skipped, the rest still count. ``tail_bytes``: read only the end (metrics
    grow with the run). A missing file has no records."""
    if not path.is_file():  # absent, or a folder or FIFO (opening a FIFO would hang)
        return []
    try:
        with path.open("rb") as f:
            if tail_bytes is not None:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - tail_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def append_jsonl(path: Path, rec: dict[str, Any]) -> None:
    """Append one record as one line. One write of a whole line stays whole on a local
    filesystem; readers skip a line cut by a crash."""
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def append_event(run_dir: Path, name: str, **kw: Any) -> None:
    """One line in the run's events.jsonl."""
    append_jsonl(run_dir / EVENTS, {"event": name, "time": time.time(), **kw})


def read_events(run_dir: Path, name: str | None = None) -> list[dict[str, Any]]:
    """The run's events (only those called ``name`` when given)."""
    events = read_jsonl(run_dir / EVENTS)
    return events if name is None else [e for e in events if e.get("event") == name]


def read_metrics(run_dir: Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The run's per-step metrics (records without a step are skipped)."""
    return [m for m in read_jsonl(run_dir / METRICS, tail_bytes) if "step" in m]


def attempts(run_dir: Path) -> int:
    """How many times the training loop started on this run (rank 0's ``start`` events)."""
    return len(read_events(run_dir, "start"))


# --- checkpoints -----------------------------------------------------------------------------


def checkpoint_steps(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-NNNNNN`` folder under ``root``, oldest first
    (complete or not: see :func:`latest_checkpoint`)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run: its manifest (written last) exists. Cheap, no
    checksums: what status and the launcher report. The trainer and consolidate resume from
    or read the newest one that also *verifies* (``pipeline.checkpoint.format.latest_valid``)."""
    for _, path in reversed(checkpoint_steps(run_dir / CHECKPOINTS)):
        if (path / CKPT_MANIFEST).is_file():
            return path
    return None


def latest_checkpoint_name(run_dir: Path) -> str | None:
    """:func:`latest_checkpoint`'s folder name (what events and messages show)."""
    found = latest_checkpoint(run_dir)
    return found.name if found else None


# --- typed records ---------------------------------------------------------------------------


def read_train_done(run_dir: Path) -> dict[str, Any]:
    """``train.done``: the summary training wrote when it finished."""
    return read_artifact(run_dir / TRAIN_DONE, "train.done",
                         hint="training has not finished; run the train rule")


def write_train_done(run_dir: Path, summary: dict[str, Any]) -> None:
    write_json_atomic(run_dir / TRAIN_DONE, summary)


def read_job(run_dir: Path) -> dict[str, Any] | None:
    """``job.json`` (the submitted job), or None when absent or unreadable."""
    rec = read_json_or_none(run_dir / JOB)
    return rec if isinstance(rec, dict) else None


def write_job(run_dir: Path, rec: dict[str, Any]) -> None:
    write_json_atomic(run_dir / JOB, rec)


def read_data_manifest(data_dir: Path) -> dict[str, Any]:
    """The tokenized data's ``manifest.json`` (gather writes it), checked to hold every key
    the stages read (:func:`check_data_manifest`)."""
    path = data_dir / DATA_MANIFEST
    manifest = read_artifact(path, "data manifest", hint="run the tokenize stage first")
    check_data_manifest(manifest, path)
    return manifest


def _int(v: Any) -> bool:
    return type(v) is int and v >= 0


def check_data_manifest(m: dict[str, Any], path: Path) -> None:
    """Raise naming the first missing or mistyped key of a data manifest (docs/ARCHITECTURE.md):
    a manifest cut short or edited by hand is an error, not a KeyError deep inside a stage."""
    def need(ok: bool, key: str) -> None:
        if not ok:
            raise PipelineError(f"{path}: the data manifest has no valid {key!r}: it is "
                                "incomplete or was edited; rerun the gather step "
                                "(python -m pipeline.tokenize gather)")

    need(_int(m.get("seq_len")) and m["seq_len"] >= 2, "seq_len")
    tok = m.get("tokenizer")
    need(isinstance(tok, dict), "tokenizer")
    need(isinstance(tok.get("path"), str), "tokenizer.path")
    need(_int(tok.get("vocab_size")) and tok["vocab_size"] > 0, "tokenizer.vocab_size")
    # In range, or the planner would size a model for it and blame the GPU's memory.
    for what, value, limit in (("sequence length (seq_len)", m["seq_len"], MAX_SEQ_LEN),
                               ("vocabulary (tokenizer.vocab_size)", tok["vocab_size"],
                                MAX_VOCAB_SIZE)):
        if value > limit:
            raise PipelineError(f"{path}: the data manifest's {what} is {value:,}, more than "
                                f"the {limit:,} the pipeline allows: the manifest was edited or "
                                "is not the tokenize stage's; tokenize again (python -m "
                                "pipeline.tokenize gather)")
    for key in ("eos_id", "bos_id"):
        v = tok.get(key)
        ok = (_int(v) and v < tok["vocab_size"]) or (key == "bos_id" and v is None)
        need(ok, f"tokenizer.{key}")
    splits = m.get("splits")
    need(isinstance(splits, dict), "splits")
    for split in ("train", "validation"):
        entry = splits.get(split)
        need(isinstance(entry, dict) and isinstance(entry.get("shards"), list), f"splits.{split}")
        for k, shard in enumerate(entry["shards"]):
            where = f"splits.{split}.shards[{k}]"
            need(isinstance(shard, dict), where)
            need(isinstance(shard.get("path"), str), f"{where}.path")
            need(isinstance(shard.get("sha256"), str), f"{where}.sha256")
            need(_int(shard.get("bytes")), f"{where}.bytes")
            need(_int(shard.get("sequences")), f"{where}.sequences")


def read_run_config_json(run_dir: Path) -> dict[str, Any]:
    """The rendered run's ``config.json`` as plain JSON (``pipeline.config.files.load_run_config``
    parses and validates it)."""
    return read_artifact(run_dir / RUN_CONFIG, "rendered run config",
                         hint="run the render stage first")


# --- shapes: what a reader checks of a JSON artifact before it uses a field -------------------


@dataclass(frozen=True)
class Kind:
    """The type one field of a :data:`Shape` must have: a test and its name in messages. A
    field that is absent or null passes unless ``required``."""

    test: Callable[[Any], bool]
    name: str
    required: bool = False


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: A number (NaN and infinities too: a diverged model's loss is still a figure).
NUMBER = Kind(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
COUNT = Kind(_int, "a non-negative integer")
POSITIVE = Kind(lambda v: _int(v) and v > 0, "a positive integer")
TEXT = Kind(lambda v: isinstance(v, str), "a string")
OBJECT = Kind(lambda v: isinstance(v, dict), "a JSON object")
TEXTS = Kind(lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
             "a list of strings")
NUMBERS = Kind(lambda v: isinstance(v, dict) and all(_finite(x) for x in v.values()),
               "an object of finite numbers")
#: Dotted field names (``*``: every key of an object) → their kind.
Shape = dict[str, Kind]


def must(kind: Kind) -> Kind:
    """``kind``, and the field must be there (when its parent is)."""
    return Kind(kind.test, kind.name, required=True)


def _fields(node: Any, parts: list[str], prefix: str) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every field ``parts`` names under ``node`` (``None`` where
    the field is absent); a parent that is not an object yields itself with ``OBJECT``'s
    failure."""
    if not parts:
        yield prefix, node
        return
    if not isinstance(node, dict):
        yield prefix, _NOT_OBJECT
        return
    head, rest = parts[0], parts[1:]
    for key in (list(node) if head == "*" else [head]):
        full = f"{prefix}.{key}" if prefix else str(key)
        value = node.get(key)
        if value is None:
            if not rest:
                yield full, None
        else:
            yield from _fields(value, rest, full)


_NOT_OBJECT = object()


def check_shape(data: dict[str, Any], shape: Shape, path: Path, what: str, hint: str) -> None:
    """Raise naming the file and the first field of ``data`` that is not of its kind (a file
    edited, cut or written by something else is an error, not a TypeError deep inside a
    stage); the value is shown escaped (it is data, maybe hostile)."""
    for dotted, kind in shape.items():
        for key, value in _fields(data, dotted.split("."), ""):
            if value is _NOT_OBJECT:
                problem = f"{key!r} is not a JSON object"
            elif value is None:
                if not kind.required:
                    continue
                problem = f"{key!r} is missing"
            elif kind.test(value):
                continue
            else:
                shown = ascii(value)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                problem = f"{key!r} is not {kind.name} (got {shown})"
            raise PipelineError(f"{path}: the {what} is malformed: {problem}; {hint}")


def read_shaped(path: Path, what: str, shape: Shape, *, hint: str) -> dict[str, Any] | None:
    """A JSON artifact that may be absent (None), checked against ``shape`` when present."""
    if not path.exists() and not path.is_symlink():
        return None
    data = read_artifact(path, what, hint=hint)
    check_shape(data, shape, path, what, hint)
    return data


#: ``config.json`` as the login node's readers use it (report, status, evaluate); the trainer
#: validates all of it (``pipeline.config.files.load_run_config``).
RUN_CONFIG_SHAPE: Shape = {
    "name": TEXT, "cluster": OBJECT, "cluster.nodes": POSITIVE, "cluster.gpus_per_node": POSITIVE,
    "train": OBJECT, "train.backend": TEXT, "train.max_steps": POSITIVE, "train.trackers": TEXTS,
    "train.mixture": NUMBERS,
}
#: ``eval/metrics.json`` (evaluate → report, status).
EVAL_METRICS_SHAPE: Shape = {
    **{k: NUMBER for k in ("loss", "perplexity", "bits_per_byte", "final_train_loss")},
    "tokens": COUNT, "step": COUNT, "lm_eval": OBJECT, "lm_eval.skipped": TEXT,
    "lm_eval.results": OBJECT, "lm_eval.results.*": OBJECT, "mixture": OBJECT,
    "mixture.*": OBJECT, "mixture.*.target": NUMBER, "mixture.*.consumed": NUMBER,
}
#: ``trackers.json`` (train → train on resume, evaluate): each tracker's run ids.
TRACKERS_SHAPE: Shape = {
    "config_hash": must(TEXT), "runs": must(OBJECT), "runs.*": OBJECT,
    "runs.*.since_attempt": must(COUNT),
    **{f"runs.mlflow.{k}": must(TEXT) for k in ("tracking_uri", "experiment_id", "run_id")},
    **{f"runs.wandb.{k}": must(TEXT) for k in ("id", "project", "name")}, "runs.wandb.dir": TEXT,
}


def read_run_config_view(run_dir: Path) -> dict[str, Any] | None:
    """The rendered ``config.json`` (None when absent), its fields of :data:`RUN_CONFIG_SHAPE`
    checked."""
    return read_shaped(run_dir / RUN_CONFIG, "rendered run config", RUN_CONFIG_SHAPE,
                       hint="render the run again (snakemake --forcerun render)")


def read_eval_metrics(run_dir: Path) -> dict[str, Any] | None:
    """``eval/metrics.json`` (None when absent), checked against :data:`EVAL_METRICS_SHAPE`."""
    return read_shaped(run_dir / EVAL_DIR / EVAL_METRICS, "evaluation", EVAL_METRICS_SHAPE,
                       hint="evaluate the run again (snakemake --forcerun evaluate)")


def read_trackers(run_dir: Path) -> dict[str, Any] | None:
    """``trackers.json`` (None when absent), checked against :data:`TRACKERS_SHAPE`."""
    return read_shaped(run_dir / TRACKERS, "trackers record", TRACKERS_SHAPE,
                       hint="move it aside to start new tracker runs (the old runs stay in "
                       "the trackers)")


def inside(base: Path, rel: str, source: Path | None = None) -> Path:
    """``base / rel`` when it stays inside ``base`` (paths read from artifacts are data);
    ``source``: the file ``rel`` was read from, named in the error."""
    path = (base / rel).resolve()
    root = base.resolve()
    if path != root and root not in path.parents:
        where = f"{source}: " if source is not None else ""
        raise PipelineError(f"{where}path {rel!r} read from an artifact leaves {base}: the "
                            "file was edited or is not this folder's; rewrite it with the "
                            "stage that made it")
    return path


# --- atomic file and folder replacement ------------------------------------------------------

_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False when unsupported."""
    # The process's own symbols (libc is loaded already): ctypes.util.find_library would run
    # ldconfig/gcc in a subprocess on every call.
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (fsync of the folder itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(dest: Path, marker: str, own_names: Collection[str] = (),
                      owner: Mapping[str, Any] | None = None) -> None:
    """Raise unless ``dest`` is absent or is what this command wrote before: it holds
    ``marker`` (a JSON object holding ``owner``'s values, e.g. ``{"run": name}``, where it
    records them: another run's output carries the same marker), or (folders written before
    markers existed) nothing but ``own_names``. A command never replaces what it did not make."""
    if not dest.exists() and not dest.is_symlink():
        return
    if dest.is_symlink() or not dest.is_dir():
        raise PipelineError(f"{dest} exists and is not a folder this command wrote: choose "
                            "another output path")
    if (dest / marker).is_file() and not (dest / marker).is_symlink():
        if owner is None:
            return
        found = read_json_or_none(dest / marker)
        found = found if isinstance(found, dict) else {k: object() for k in owner}
        wrong = {k: found[k] for k, v in owner.items() if k in found and found[k] != v}
        if not wrong:
            return
        theirs = ", ".join(f"{k} {v!r}" for k, v in wrong.items()
                           if isinstance(v, (str, int, float)))
        raise PipelineError(
            f"{dest} holds the output of "
            + (theirs if theirs else f"another run (its {marker} names none)")
            + ", not of " + ", ".join(f"{k} {v!r}" for k, v in owner.items())
            + ": nothing was changed; write each run's output into its own folder"
        )
    if not {p.name for p in dest.iterdir()} <= set(own_names):
        raise PipelineError(
            f"{dest} exists and was not written by this command (no {marker} inside): "
            "nothing was changed; choose another output path or remove it yourself"
        )


@contextlib.contextmanager
def replacing_dir(dest: Path, marker: str, own_names: Collection[str] = (),
                  owner: Mapping[str, Any] | None = None) -> Iterator[Path]:
    """Build a folder beside ``dest`` and put it in place atomically when the block succeeds.

    The block writes into the yielded folder, ``marker`` included. ``dest`` may be absent or
    hold ``marker`` (written by the same command before); anything else is refused before the
    block runs (``own_names``, ``owner``: see :func:`check_replaceable`). The old folder is swapped out in one step (renameat2 RENAME_EXCHANGE where the
    kernel has it, else rename aside then in) and removed; on failure nothing at ``dest``
    changes and the half-built folder is removed."""
    dest = Path(dest)
    check_replaceable(dest, marker, own_names, owner)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        assert (tmp / marker).is_file(), f"{marker} was not written into {tmp}"
        check_replaceable(dest, marker, own_names, owner)  # again: it may have appeared meanwhile
        if dest.exists() and _exchange(tmp, dest):
            shutil.rmtree(tmp)  # tmp now holds the old folder
        elif dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
        fsync_dir(dest.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
