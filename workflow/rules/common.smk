# Shared helpers: the validated config, run names, paths, and the python that runs stages.
import json
import os
import re
import sys

from pipeline.config.files import expand_sources, parse_config, workflow_config_raw
from pipeline.plan.preflight_cache import startup_checks

# Rules call `python -m pipeline.<stage>`: make `python` the interpreter running Snakemake
# (the project's venv) even when the venv is not activated; Slurm jobs inherit this PATH.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# The config is read again here, from the same files Snakemake read (config/config.yaml unless
# --replace-workflow-config, each --configfile in order, then --config values), with the
# project's merge and loader instead of Snakemake's: a file's `runs:` replaces the runs before
# it (Snakemake's deep merge could never drop the default runs), and a duplicate YAML key is an
# error naming the key and line (Snakemake's loader keeps the last one silently).
# `python -m pipeline.config check FILE...` runs exactly this (workflow_config_raw,
# parse_config, startup_checks). Snakemake's own `config` is set to the result.
_settings = workflow.config_settings
_raw = workflow_config_raw(
    [str(f) for f in _settings.configfiles],
    dict(_settings.config),
    replace_default=bool(getattr(_settings, "replace_workflow_config", False)),
)
config.clear()
config.update(_raw)
CFG = parse_config(config)
RUNS = CFG.run_names()
DATA = "results/data"
SHARDS = [f"{i:05d}" for i in range(CFG.data.shards)]
# Source expansion (a source matching no file is an error) in every process; the pre-flight of
# every run (batch arithmetic, divisibility, memory plan, DeepSpeed keys) before
# any job is queued, in the main Snakemake process only: every cluster job of the executor
# plugin (and every `run:` subprocess) parses this file again, and the main process has already
# checked the same config. A pass is cached under .snakemake/zerosnake/preflight/, keyed by the
# run's effective config, the pipeline's source and the DeepSpeed/torch versions, so a restart
# with nothing changed runs neither the planner nor DeepSpeed (pipeline/plan/preflight_cache.py).
# The render rule repeats the check with the tokenizer's real vocabulary size.
SOURCE_FILES = startup_checks(CFG, preflight=workflow.is_main_process)


wildcard_constraints:
    run="|".join(re.escape(r) for r in RUNS),
    shard=r"\d{5}",


def data_params():
    """Everything that determines the tokenized data (a change re-tokenizes)."""
    return json.dumps(CFG.data.model_dump(mode="json"), sort_keys=True)


def run_params(wildcards):
    """A run's effective config (a change re-renders and retrains that run only)."""
    return json.dumps(CFG.run(wildcards.run).model_dump(mode="json"), sort_keys=True)


# One unnamed source keeps the plain layout (shards/shard-NNNNN.*); named sources, or more than
# one, are each tokenized by their own shard jobs into shards/<name>.shard-NNNNN.*.
NAMED_SOURCES = len(CFG.data.sources) > 1 or CFG.data.sources[0].name is not None
SOURCES = {name: src for name, src in zip(CFG.data.source_names, CFG.data.sources)}
# Each named source's files (shard params); the flat SOURCE_FILES above are their union.
SOURCE_FILES_BY_NAME = {
    name: [str(p) for p in expand_sources([src])] for name, src in SOURCES.items()
} if NAMED_SOURCES else {}


def format_args(source=None):
    """Reader flags of a source (the first one: the one unnamed source)."""
    src = SOURCES[source] if source is not None else CFG.data.sources[0]
    args = ["--text-field", src.text_field, "--doc-split", src.doc_split]
    if src.format != "auto":
        args += ["--format", src.format]
    return args


def sources_json():
    """Every source's reading options, for the tokenizer trained on all of them."""
    return json.dumps([s.model_dump(mode="json", exclude={"name"}) for s in CFG.data.sources])


def source_params(source):
    """What determines one source's shards: its entry and the options all sources share (a
    change to another source redoes this one only through a new tokenizer)."""
    shared = CFG.data.model_dump(mode="json", exclude={"sources"})
    return json.dumps({"source": SOURCES[source].model_dump(mode="json"), **shared},
                      sort_keys=True)
