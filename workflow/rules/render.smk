# Stage 2: render. One run's typed config → ds_config.json, fsdp.json, topology.json, plan.md,
# launch.json; pre-flight checks run here, on the login node, before anything is queued.


rule render:
    input:
        manifest=f"{DATA}/manifest.json",
    output:
        config="results/runs/{run}/config.json",
        topology="results/runs/{run}/topology.json",
        plan="results/runs/{run}/plan.md",
    params:
        cfg=run_params,
    conda:
        "../envs/zerosnake.yaml"
    log:
        "results/logs/render/{run}.log",
    shell:
        "python -m pipeline.render --run-config-json {params.cfg:q}"
        " --data-manifest {input.manifest:q}"
        " --out results/runs/{wildcards.run:q} > {log:q} 2>&1"
