# Stage 4: consolidate. The final sharded checkpoint → an HF model directory (safetensors).


rule consolidate:
    input:
        done="results/runs/{run}/train.done",
        manifest=f"{DATA}/manifest.json",
    output:
        config="results/runs/{run}/hf/config.json",
    conda:
        "../envs/zerosnake.yaml"
    log:
        "results/logs/consolidate/{run}.log",
    shell:
        "python -m pipeline.consolidate --run-dir results/runs/{wildcards.run:q}"
        " --data-dir results/data --out results/runs/{wildcards.run:q}/hf > {log:q} 2>&1"
