# Stage 1: tokenize. A tokenizer (trained here, or a local one imported), then one job per
# shard, then a gather step that writes manifest.json. Shard jobs write to temporary names and
# rename; a shard whose stats file is present and whose checksum matches is not redone.
# Every value from the config reaches the shell quoted (`:q`): paths are data, never commands.
# The corpus files are inputs of the one tokenizer job only, not of each shard job: every shard
# reads every source, so a changed source must redo them all, and it does through the newer
# tokenizer.json. Listing the files on each of N shard jobs cost N x files inputs in the DAG
# (1,000 shards x 94 files: +4 s on every `snakemake` start). Shard params still name the files.
# Named sources (data.sources[].name, or more than one source) are tokenized apart: K shard
# jobs per source, their own shard files, one gather that counts each source (manifest
# by_source); a run's train.mixture weighs them without re-tokenizing anything.


if CFG.data.tokenizer.path:

    rule tokenizer:
        input:
            # The sources only so that changing them re-imports (cheap) and so redoes the shards.
            SOURCE_FILES,
            path=CFG.data.tokenizer.path,
        output:
            f"{DATA}/tokenizer/tokenizer.json",
        conda:
            "../envs/zerosnake.yaml"
        log:
            "results/logs/tokenizer.log",
        shell:
            "python -m pipeline.tokenize tokenizer import --path {input.path:q} --out results/data/tokenizer"
            " > {log:q} 2>&1"

elif not NAMED_SOURCES:

    rule tokenizer:
        input:
            SOURCE_FILES,
        output:
            f"{DATA}/tokenizer/tokenizer.json",
        params:
            data=data_params(),
            fmt=format_args(),
            vocab=CFG.data.tokenizer.vocab_size,
            max_bytes=CFG.data.tokenizer.train_max_bytes,
        conda:
            "../envs/zerosnake.yaml"
        log:
            "results/logs/tokenizer.log",
        shell:
            "python -m pipeline.tokenize tokenizer train --input {input:q}"
            " --vocab-size {params.vocab:q} --max-bytes {params.max_bytes:q}"
            " --out results/data/tokenizer {params.fmt:q} > {log:q} 2>&1"

else:

    # Named sources may each read another format: the tokenizer gets every source's options.
    rule tokenizer:
        input:
            SOURCE_FILES,
        output:
            f"{DATA}/tokenizer/tokenizer.json",
        params:
            data=data_params(),
            sources=sources_json(),
            vocab=CFG.data.tokenizer.vocab_size,
            max_bytes=CFG.data.tokenizer.train_max_bytes,
        conda:
            "../envs/zerosnake.yaml"
        log:
            "results/logs/tokenizer.log",
        shell:
            "python -m pipeline.tokenize tokenizer train --sources-json {params.sources:q}"
            " --vocab-size {params.vocab:q} --max-bytes {params.max_bytes:q}"
            " --out results/data/tokenizer > {log:q} 2>&1"


if not NAMED_SOURCES:

    rule tokenize_shard:
        input:
            tokenizer=f"{DATA}/tokenizer/tokenizer.json",
        output:
            stats=f"{DATA}/shards/shard-{{shard}}.stats.json",
        params:
            data=data_params(),
            sources=[str(p) for p in SOURCE_FILES],
            fmt=format_args(),
            extra=(["--bos"] if CFG.data.bos else []),
            seq_len=CFG.data.seq_len,
            shards=CFG.data.shards,
            val_fraction=CFG.data.val_fraction,
            on_invalid=CFG.data.on_invalid,
        conda:
            "../envs/zerosnake.yaml"
        log:
            "results/logs/tokenize/shard-{shard}.log",
        shell:
            "python -m pipeline.tokenize shard --input {params.sources:q}"
            " --tokenizer results/data/tokenizer --seq-len {params.seq_len:q}"
            " --shards {params.shards:q} --shard {wildcards.shard:q} --out results/data"
            " --val-fraction {params.val_fraction:q} --on-invalid {params.on_invalid:q}"
            " {params.fmt:q} {params.extra:q} > {log:q} 2>&1"


    rule gather:
        input:
            expand(f"{DATA}/shards/shard-{{shard}}.stats.json", shard=SHARDS),
            tokenizer=f"{DATA}/tokenizer/tokenizer.json",
        output:
            f"{DATA}/manifest.json",
        params:
            shards=CFG.data.shards,
        conda:
            "../envs/zerosnake.yaml"
        log:
            "results/logs/gather.log",
        shell:
            "python -m pipeline.tokenize gather --out results/data --shards {params.shards:q}"
            " --tokenizer results/data/tokenizer > {log:q} 2>&1"

else:

    # One job per shard of each source; a source's shard params are its own entry and the
    # shared data options (source_params), so its jobs run in parallel with every other's.
    rule tokenize_shard:
        input:
            tokenizer=f"{DATA}/tokenizer/tokenizer.json",
        output:
            stats=f"{DATA}/shards/{{source}}.shard-{{shard}}.stats.json",
        params:
            data=lambda wildcards: source_params(wildcards.source),
            sources=lambda wildcards: SOURCE_FILES_BY_NAME[wildcards.source],
            fmt=lambda wildcards: format_args(wildcards.source),
            extra=(["--bos"] if CFG.data.bos else []),
            seq_len=CFG.data.seq_len,
            shards=CFG.data.shards,
            val_fraction=CFG.data.val_fraction,
            on_invalid=CFG.data.on_invalid,
        wildcard_constraints:
            source="|".join(re.escape(n) for n in SOURCES),
        conda:
            "../envs/zerosnake.yaml"
        log:
            "results/logs/tokenize/{source}.shard-{shard}.log",
        shell:
            "python -m pipeline.tokenize shard --input {params.sources:q}"
            " --tokenizer results/data/tokenizer --seq-len {params.seq_len:q}"
            " --shards {params.shards:q} --shard {wildcards.shard:q} --out results/data"
            " --val-fraction {params.val_fraction:q} --on-invalid {params.on_invalid:q}"
            " --source-name {wildcards.source:q} {params.fmt:q} {params.extra:q} > {log:q} 2>&1"

    rule gather:
        input:
            expand(f"{DATA}/shards/{{source}}.shard-{{shard}}.stats.json", source=list(SOURCES),
                   shard=SHARDS),
            tokenizer=f"{DATA}/tokenizer/tokenizer.json",
        output:
            f"{DATA}/manifest.json",
        params:
            shards=CFG.data.shards,
            sources=[a for n in SOURCES for a in ("--source", n)],
        conda:
            "../envs/zerosnake.yaml"
        log:
            "results/logs/gather.log",
        shell:
            "python -m pipeline.tokenize gather --out results/data --shards {params.shards:q}"
            " --tokenizer results/data/tokenizer {params.sources:q} > {log:q} 2>&1"
