# Shared helpers: the validated config, run names, paths, and the python that runs stages.
import json
import os
import sys

from pipeline.config import expand_sources, parse_config
from pipeline.render import render_run

# Rules call `python -m pipeline.<stage>`: make `python` the interpreter running Snakemake
# (the project's venv) even when the venv is not activated; Slurm jobs inherit this PATH.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
CFG = parse_config(config)
RUNS = CFG.run_names()
DATA = "results/data"
SHARDS = [f"{i:05d}" for i in range(CFG.data.shards)]
SOURCE_FILES = expand_sources(CFG.data.sources)
# Pre-flight of every run (batch arithmetic, divisibility, memory plan, DeepSpeed keys) before
# any job is queued. The render rule repeats it with the tokenizer's real vocabulary size.
for _run in RUNS:
    render_run(CFG.run(_run), vocab_size=CFG.data.tokenizer.vocab_size)


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
