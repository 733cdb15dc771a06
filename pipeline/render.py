"""The render stage: one run's typed config → everything the train stage reads.

``python -m pipeline.render --config-json JSON --run NAME --out results/runs/NAME`` writes
``config.json``, ``ds_config.json`` (deepspeed runs), ``fsdp.json`` (fsdp runs),
``topology.json``, ``plan.md`` and ``launch.json``: what the planner's pure
:func:`pipeline.plan.run.render_run` returns (golden-tested); this command only checks ``--out``
and writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline import artifacts as af
from pipeline.config.files import in_range, load_config, parse_run_config
from pipeline.errors import PipelineError
from pipeline.io import write_json_atomic, write_text_atomic
from pipeline.observe.packages import check_packages
from pipeline.plan.run import render_run


def check_run_out(out: Path, run: str) -> None:
    """Refuse an ``--out`` that is not this run's directory: a file, a folder holding anything a
    run directory does not (``.``, ``/``, the data directory), or another run's rendered
    config. Absent and empty folders are fine; nothing is written when refused."""
    if not out.exists():
        if out.is_symlink():
            raise PipelineError(f"--out {out} is a dangling symbolic link: choose another folder")
        return
    if not out.is_dir():
        raise PipelineError(f"--out {out} is not a folder: name a run directory "
                            "(results/runs/NAME)")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in af.RUN_DIR_NAMES
                     and not p.name.startswith((".", f"{af.CHECKPOINTS}.old-", "samples-rank")))
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise PipelineError(
            f"--out {out} is not a run directory (it holds {shown}): nothing was written; "
            f"render into results/runs/{run} or a new, empty folder"
        )
    cfg = out / af.RUN_CONFIG
    if cfg.exists():
        old = af.read_json_or_none(cfg)
        name = old.get("name") if isinstance(old, dict) else None
        if name != run:
            raise PipelineError(
                f"--out {out} holds the rendered config of "
                + (f"run {name!r}" if isinstance(name, str) else "another run (unreadable)")
                + f", not of run {run!r}: nothing was written; render each run into its own "
                "folder (results/runs/NAME)"
            )


def write_rendered(files: dict[str, Any], out: Path) -> None:
    """Write what ``render_run`` returned, each file atomically."""
    for name, content in files.items():
        if isinstance(content, str):
            write_text_atomic(out / name, content)
        else:
            write_json_atomic(out / name, content)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.render",
        description="Render one run's engine configs, topology and plan from the config.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help="a config YAML file (with --run)")
    src.add_argument(
        "--run-config-json", help="one run's effective config as JSON (what Snakemake passes)"
    )
    p.add_argument("--run", help="run name (a key of runs:), with --config")
    p.add_argument("--out", type=Path, required=True, help="output dir, e.g. results/runs/NAME")
    vocab = p.add_mutually_exclusive_group()
    vocab.add_argument("--data-manifest", type=Path,
                       help="results/data/manifest.json (vocab size, per-source counts)")
    vocab.add_argument("--vocab-size", type=int, help="vocabulary size, without a manifest",
                       **in_range(1, af.MAX_VOCAB_SIZE, "a vocabulary size"))
    args = p.parse_args(argv)
    try:
        if args.config is not None:
            if not args.run:
                raise PipelineError("--config needs --run NAME (one of the config's runs:)")
            run = load_config(args.config).run(args.run)
        else:
            try:
                data = json.loads(args.run_config_json)
            except (ValueError, RecursionError) as err:
                raise PipelineError(f"--run-config-json is not valid JSON ({err})") from None
            run = parse_run_config(data)
        if args.data_manifest is not None:
            manifest = af.read_artifact(args.data_manifest, "data manifest",
                                        hint="run the tokenize stage first")
            af.check_data_manifest(manifest, args.data_manifest)
            vocab_size = manifest["tokenizer"]["vocab_size"]
        else:
            manifest = None
            vocab_size = args.vocab_size or run.data.tokenizer.vocab_size
        check_packages(run.train.trackers)  # the train job would stop at its start without them
        files = render_run(run, vocab_size=vocab_size, manifest=manifest)
        check_run_out(args.out, run.name)
        try:
            write_rendered(files, args.out)
        except OSError as err:
            raise PipelineError(f"--out {args.out}: cannot write the rendered files ({err})") from err
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(files["plan.md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
