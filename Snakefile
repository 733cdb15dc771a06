# zerosnake: raw text → tokenized shards → rendered plan → trained model → HF model → evaluation.
# This file is a table of contents; each stage's rules live in workflow/rules/<stage>.smk and
# call `python -m pipeline.<stage>`. Experiment settings: config/. Runtime resources: profiles/.
from snakemake.utils import min_version

min_version("8.0")


# The default config. common.smk reads it again with every --configfile (pipeline.config.files:
# a later file's `runs:` replaces the earlier runs, a duplicate YAML key is an error) and sets
# `config` to the result; `python -m pipeline.config check FILE` does the same.
configfile: "config/config.yaml"


envvars:
    "PATH",


# The typed parse (pipeline/config/schema.py, in common.smk) is the only validation: it rejects unknown
# keys, wrong types and impossible values, naming the key path (train.micro_batch_size). No
# `snakemake.utils.validate(config, "config/schema.json")` after it: the schema is generated from
# the same classes (a test keeps it in sync), so it could never fail where the parse passed, and
# it would not fill defaults either (the rules read the parsed CFG, not the raw dict). The schema
# stays for editors and docs: `python -m pipeline.config schema > config/schema.json`.
include: "workflow/rules/common.smk"
include: "workflow/rules/tokenize.smk"
include: "workflow/rules/render.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/consolidate.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


localrules:
    all,
    tokenizer,
    gather,
    render,
    train,
    report,


rule all:
    input:
        expand("results/runs/{run}/eval/metrics.json", run=RUNS),
        "results/report.html",
