# Stage 5: evaluate. Held-out perplexity from the consolidated HF directory, plots, report.


rule evaluate:
    input:
        model="results/runs/{run}/hf/config.json",
        manifest=f"{DATA}/manifest.json",
    output:
        metrics="results/runs/{run}/eval/metrics.json",
        plot="results/runs/{run}/eval/loss.png",
        report="results/runs/{run}/eval/report.md",
    conda:
        "../envs/zerosnake.yaml"
    log:
        "results/logs/evaluate/{run}.log",
    shell:
        "python -m pipeline.evaluate --model results/runs/{wildcards.run:q}/hf"
        " --data-dir results/data --run-dir results/runs/{wildcards.run:q}"
        " --out results/runs/{wildcards.run:q}/eval > {log:q} 2>&1"
