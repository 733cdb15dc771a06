# Shared helpers: the validated config, run names, paths, and the python that runs stages.
import json
import os
import sys

from pipeline.config import expand_sources, parse_config

# Rules call `python -m pipeline.<stage>`: make `python` the interpreter running Snakemake
# (the project's venv) even when the venv is not activated; Slurm jobs inherit this PATH.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
CFG = parse_config(config)
RUNS = CFG.run_names()
DATA = "results/data"
SHARDS = [f"{i:05d}" for i in range(CFG.data.shards)]
SOURCE_FILES = expand_sources(CFG.data.sources)
# Pre-flight of every run (batch arithmetic, divisibility, memory plan, DeepSpeed keys) before
# any job is queued, in the main Snakemake process only: every cluster job of the executor
# plugin (and every `run:` subprocess) parses this file again, and the main process has already
# checked the same config. A pass is cached under .snakemake/zerosnake/preflight/, keyed by the
# run's effective config, the pipeline's source and the DeepSpeed/torch versions, so a restart
# with nothing changed imports neither the planner nor DeepSpeed (pipeline/preflight_cache.py).
# The render rule repeats the check with the tokenizer's real vocabulary size.
if workflow.is_main_process:
    from pipeline.preflight_cache import preflight_runs

    preflight_runs(CFG)


wildcard_constraints:
    run="|".join(RUNS),
    shard=r"\d{5}",


def data_params():
    """Everything that determines the tokenized data (a change re-tokenizes)."""
    return json.dumps(CFG.data.model_dump(mode="json"), sort_keys=True)


def run_params(wildcards):
    """A run's effective config (a change re-renders and retrains that run only)."""
    return json.dumps(CFG.run(wildcards.run).model_dump(mode="json"), sort_keys=True)


def format_args():
    """Reader flags shared by the tokenizer and tokenize rules (all sources share them)."""
    src = CFG.data.sources[0]
    args = ["--text-field", src.text_field, "--doc-split", src.doc_split]
    if src.format != "auto":
        args += ["--format", src.format]
    return args
