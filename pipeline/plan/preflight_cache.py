"""The workflow's start-up pre-flight, with its verdict cached.

The Snakefile checks every run before any job is queued (batch arithmetic, divisibility, the
memory plan, DeepSpeed keys: ``pipeline.plan.run.render_run``). That costs the planner and, for a
DeepSpeed run, an import of DeepSpeed and torch (~2 s). A run that passed once passes again as
long as nothing that decides the verdict changed, so a pass is recorded under
``.snakemake/zerosnake/preflight/`` keyed by the sha256 of:

- the run's effective config (model, cluster, train, plan, data) and the vocabulary size;
- the installed versions of DeepSpeed, torch and pydantic, and Python's;

and the marker lists the sha256 of every ``pipeline`` module that was loaded when the run
passed (the checks are code): a hit whose modules changed since is checked again.

A failure is never cached: it is recomputed and raised every time, with its message. The
cache is on unless ``ZEROSNAKE_PREFLIGHT_CACHE=0``. Nothing here imports the planner, torch or
DeepSpeed unless a run has to be checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from functools import cache, lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

#: Where passes are recorded, relative to the workflow's working directory.
CACHE_DIR = Path(".snakemake") / "zerosnake" / "preflight"
#: Installed distributions whose version can change a verdict.
_DISTRIBUTIONS = ("deepspeed", "torch", "pydantic")
_PACKAGE = Path(__file__).resolve().parent.parent  # pipeline/, this module being in plan/


@lru_cache(maxsize=1)
def environment_fingerprint() -> dict[str, str]:
    """Versions that can change a verdict, read from metadata (nothing imported); once."""
    versions = {"python": sys.version}
    for dist in _DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "absent"
    return versions


def run_key(run_dump: dict[str, Any], *, vocab_size: int | None) -> str:
    """The cache key of one run's verdict: its effective config, vocabulary and versions."""
    blob = json.dumps({"run": run_dump, "vocab_size": vocab_size,
                       "env": dict(environment_fingerprint())},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


@cache
def _sha(path: Path) -> str:
    """sha256 of a source file, once per process (every run's marker names the same files)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def loaded_pipeline_sources() -> dict[str, str]:
    """Relative path → sha256 of every ``pipeline`` module loaded now (after a check: the code
    the verdict came from, whatever the planner imports today)."""
    sources = {}
    for name, module in list(sys.modules.items()):
        if name != "pipeline" and not name.startswith("pipeline."):
            continue
        file = getattr(module, "__file__", None)
        if not file:
            continue
        path = Path(file).resolve()
        try:
            sources[str(path.relative_to(_PACKAGE))] = _sha(path)
        except (ValueError, OSError):
            continue
    return dict(sorted(sources.items()))


def _still_valid(marker: Path) -> bool:
    """The marker exists and the pipeline source it was checked with is unchanged."""
    try:
        recorded = json.loads(marker.read_text())["code"]
        return bool(recorded) and all(_sha(_PACKAGE / rel) == sha for rel, sha in recorded.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def cache_enabled() -> bool:
    return os.environ.get("ZEROSNAKE_PREFLIGHT_CACHE", "1") not in ("0", "false", "no", "")


def preflight_runs(cfg: Any, *, names: Iterable[str] | None = None,
                   cache_dir: Path | None = CACHE_DIR) -> dict[str, str]:
    """Pre-flight every run of ``cfg`` (a ``pipeline.config.schema.Config``) not already passed.

    Returns run name → ``"cached"`` or ``"checked"``. Raises ``PipelineError`` (from
    ``render_run``) for the first run that fails; failures are not recorded.
    ``cache_dir=None`` (or ``ZEROSNAKE_PREFLIGHT_CACHE=0``) checks every run.
    """
    if cache_dir is not None and not cache_enabled():
        cache_dir = None
    vocab_size = cfg.data.tokenizer.vocab_size
    verdicts: dict[str, str] = {}
    for name in names if names is not None else cfg.run_names():
        run = cfg.run(name)
        marker = None
        if cache_dir is not None:
            key = run_key(run.model_dump(mode="json"), vocab_size=vocab_size)
            marker = Path(cache_dir) / f"{key}.ok"
            if _still_valid(marker):
                verdicts[name] = "cached"
                continue
        from pipeline.errors import PipelineError
        from pipeline.plan.run import render_run  # the planner (and DeepSpeed) only on a miss

        try:
            render_run(run, vocab_size=vocab_size)
        except PipelineError as err:  # name the run: a batch config has many
            raise PipelineError(f"run {name!r} (runs.{name}): {err}") from None
        verdicts[name] = "checked"
        if marker is not None:
            _record(marker, name)
    return verdicts


def startup_checks(cfg: Any, *, preflight: bool = True,
                   cache_dir: Path | None = CACHE_DIR) -> list[Path]:
    """Everything a workflow start checks after the typed parse, in one place for the
    Snakefile (``workflow/rules/common.smk``) and ``python -m pipeline.config check``: the
    expansion of ``data.sources`` (a source matching no file is an error) and, with
    ``preflight``, that every run's ``train.trackers`` are installed and every run's
    pre-flight (:func:`preflight_runs`). Returns the source files."""
    from pipeline.config.files import expand_sources

    files = expand_sources(cfg.data.sources)
    if preflight:
        check_trackers(cfg)
        preflight_runs(cfg, cache_dir=cache_dir)
    return files


def check_trackers(cfg: Any) -> None:
    """Every run's ``train.trackers`` packages are installed (looked up, not imported; never
    cached: installing or removing a package changes no key), so a run that would stop at its
    first step for a missing ``wandb`` is refused before anything is queued."""
    from pipeline.errors import PipelineError
    from pipeline.observe.packages import check_packages

    for name in cfg.run_names():
        try:
            check_packages(cfg.run(name).train.trackers)
        except PipelineError as err:
            raise PipelineError(f"run {name!r} (runs.{name}): {err}") from None


def _record(marker: Path, name: str) -> None:
    """Write a pass marker atomically; a read-only or racing directory only loses the cache."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"run": name, "code": loaded_pipeline_sources()},
                                  indent=1) + "\n")
        os.replace(tmp, marker)
    except OSError:
        pass
