"""``python -m pipeline.config {check,schema}``: check config files exactly as a workflow start
does (merge, typed parse, source expansion, every run's pre-flight), or print the JSON schema.

A module of its own, above the loaders (:mod:`pipeline.config.files`) and the pre-flight
(:mod:`pipeline.plan.preflight_cache` → :mod:`pipeline.plan.run`): the config types stay at the bottom
of the import graph.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.config.files import DEFAULT_CONFIG, config_files, parse_config, workflow_config_raw
from pipeline.config.schema import json_schema
from pipeline.errors import PipelineError
from pipeline.plan.preflight_cache import startup_checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.config", description="Validate a config or print its schema."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("schema", help="print the JSON schema generated from the config classes")
    check = sub.add_parser(
        "check",
        help="run the checks of a workflow start and print each run's config",
        description="Run exactly the checks a workflow start runs on `snakemake --configfile "
        "FILE...` in this directory: config/config.yaml (when present here) merged with each "
        "FILE in order (a file's runs: replaces the runs before it), the typed parse, the "
        "expansion of data.sources and every run's pre-flight. Writes nothing.",
    )
    check.add_argument("config", type=Path, nargs="+", help="config files, as --configfile")
    check.add_argument("--replace-workflow-config", action="store_true",
                       help=f"do not read {DEFAULT_CONFIG} first (as Snakemake's option)")
    args = parser.parse_args(argv)

    if args.cmd == "schema":
        print(json.dumps(json_schema(), indent=2, sort_keys=True))
        return 0
    try:
        files = config_files(args.config, replace_default=args.replace_workflow_config)
        cfg = parse_config(workflow_config_raw(
            args.config, replace_default=args.replace_workflow_config))
        sources = startup_checks(cfg, cache_dir=None)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"config: {' + '.join(map(str, files))}; runs: {', '.join(cfg.run_names())}; "
          f"{len(sources)} source file(s); pre-flight passed", file=sys.stderr)
    for name in cfg.run_names():
        print(json.dumps(cfg.run(name).model_dump(mode="json"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
