# The batch's one page: every run's loss curves overlaid, a table of its evaluation, throughput,
# goodput and GPU-hours, each run linked to its own report (pipeline/report.py). Reads files
# only (no model, no torch): cheap, so a local rule even on Slurm.


rule report:
    input:
        expand("results/runs/{run}/eval/metrics.json", run=RUNS),
    output:
        "results/report.html",
    params:
        runs=[a for run in RUNS for a in ("--run", run)],
    conda:
        "../envs/zerosnake.yaml"
    log:
        "results/logs/report.log",
    shell:
        "python -m pipeline.report --results results {params.runs:q} --out {output:q}"
        " > {log:q} 2>&1"
