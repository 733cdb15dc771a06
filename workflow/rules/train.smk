# Stage 3: train. Submits the run's job through submitit (local executor, or Slurm when the
# profile sets resources.launcher=slurm) and waits across requeues; on Slurm a restarted
# Snakemake reattaches to the job recorded in the run's job.json instead of submitting again.
# Checkpoints live in results/runs/{run}/checkpoints and are NOT outputs, so a killed rule keeps them and the
# rerun resumes from the newest complete one.

from pipeline.cluster.options import LAUNCH_RESOURCES, launch_argv


rule train:
    input:
        config="results/runs/{run}/config.json",
        manifest=f"{DATA}/manifest.json",
    output:
        done="results/runs/{run}/train.done",
    conda:
        "../envs/zerosnake.yaml"
    log:
        "results/logs/train/{run}.log",
    threads: lambda wildcards: CFG.run(wildcards.run).cluster.gpus_per_node
    resources:
        # One resource per launcher setting, defaults from pipeline/cluster/options.py (defined
        # there once); profiles override them by these names (set-resources: train: ...).
        **LAUNCH_RESOURCES,
    params:
        launch=lambda wildcards, resources: launch_argv(resources),
    shell:
        "python -m pipeline.train launch --run-dir results/runs/{wildcards.run:q}"
        " --data-dir results/data {params.launch:q} --job-name zs-{wildcards.run:q}"
        " > {log:q} 2>&1"
