# Shared helpers: the validated config, run names, paths, and the python that runs stages.
import json
import sys

from pipeline.config import expand_sources, parse_config

# The interpreter running Snakemake (the project's venv) runs every stage, also on cluster
# nodes that share the file system.
PY = sys.executable
CFG = parse_config(config)
RUNS = CFG.run_names()
DATA = "results/data"
SHARDS = [f"{i:05d}" for i in range(CFG.data.shards)]
SOURCE_FILES = expand_sources(CFG.data.sources)


wildcard_constraints:
    run="|".join(RUNS),
    shard=r"\d{5}",


def data_params():
    """Everything that determines the tokenized data (a change re-tokenizes)."""
    return json.dumps(CFG.data.model_dump(mode="json"), sort_keys=True)


def run_params(wildcards):
    """A run's effective config (a change re-renders and retrains that run only)."""
    return json.dumps(CFG.run(wildcards.run).model_dump(mode="json"), sort_keys=True)


def source_args():
    return [str(p) for p in SOURCE_FILES]
