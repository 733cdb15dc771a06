# Stage 3: train. Submits the run's job through submitit (local executor, or Slurm when the
# profile sets resources.launcher=slurm) and waits across requeues; on Slurm a restarted
# Snakemake reattaches to the job recorded in the run's job.json instead of submitting again.
# Checkpoints live in results/runs/{run}/checkpoints and are NOT outputs, so a killed rule keeps them and the
# rerun resumes from the newest complete one.


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
        launcher="local",
        slurm_partition="",
        slurm_account="",
        slurm_qos="",
        constraint="",
        slurm_exclude="",
        runtime=60,
        cpus_per_task=2,
        signal_delay_s=90,
        max_requeues=3,
        max_preemptions=10,
        max_failures=2,
        slurm_mem_gb=0,
        job_env="",
        sbatch_extra="",
        poll_s=5,
    shell:
        "python -m pipeline.train launch --run-dir results/runs/{wildcards.run:q}"
        " --data-dir results/data --launcher {resources.launcher:q}"
        " --partition={resources.slurm_partition:q} --account={resources.slurm_account:q}"
        " --qos={resources.slurm_qos:q} --constraint={resources.constraint:q}"
        " --exclude={resources.slurm_exclude:q} --time-min {resources.runtime}"
        " --cpus-per-task {resources.cpus_per_task} --signal-delay-s {resources.signal_delay_s}"
        " --max-requeues {resources.max_requeues} --max-preemptions {resources.max_preemptions}"
        " --max-failures {resources.max_failures} --mem-gb {resources.slurm_mem_gb}"
        " --job-env={resources.job_env:q} --sbatch-extra={resources.sbatch_extra:q}"
        " --poll-s {resources.poll_s} --job-name zs-{wildcards.run:q}"
        " > {log:q} 2>&1"
