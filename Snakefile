# zerosnake: raw text → tokenized shards → rendered plan → trained model → HF model → evaluation.
# This file is a table of contents; each stage's rules live in workflow/rules/<stage>.smk and
# call `python -m pipeline.<stage>`. Experiment settings: config/. Runtime resources: profiles/.
from snakemake.utils import min_version, validate

min_version("8.0")


configfile: "config/config.yaml"


envvars:
    "PATH",


# Typed validation first (messages name the key path, e.g. train.micro_batch_size), then the
# JSON schema generated from the same classes, as every Snakemake workflow does.
include: "workflow/rules/common.smk"


validate(config, "config/schema.json")


include: "workflow/rules/tokenize.smk"
include: "workflow/rules/render.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/consolidate.smk"
include: "workflow/rules/evaluate.smk"


localrules:
    all,
    tokenizer,
    gather,
    render,
    train,


rule all:
    input:
        expand("results/runs/{run}/eval/metrics.json", run=RUNS),
