# Stage 1: tokenize. A tokenizer (trained here, or a local one), then one job per shard, then a
# gather step that writes manifest.json. Shard jobs write to temporary names and rename.


def _format_args():
    src = CFG.data.sources[0]
    args = ["--text-field", src.text_field, "--doc-split", src.doc_split]
    if src.format != "auto":
        args += ["--format", src.format]
    return args


rule tokenizer:
    input:
        SOURCE_FILES,
    output:
        f"{DATA}/tokenizer/tokenizer.json",
    params:
        data=data_params(),
        tok=CFG.data.tokenizer.path or "",
        inputs=source_args(),
        fmt=_format_args(),
    log:
        "results/logs/tokenizer.log",
    run:
        # An argument list (never a shell string built from config): paths with spaces, quotes
        # or `;` reach the program as data.
        import subprocess

        out = str(Path(output[0]).parent)
        if params.tok:
            argv = [PY, "-m", "pipeline.tokenizer", "import", "--path", params.tok, "--out", out]
        else:
            argv = [PY, "-m", "pipeline.tokenizer", "train", "--input", *params.inputs,
                    "--vocab-size", str(CFG.data.tokenizer.vocab_size), "--out", out,
                    "--max-bytes", str(CFG.data.tokenizer.train_max_bytes), *params.fmt]
        with open(log[0], "w") as f:
            subprocess.run(argv, check=True, stdout=f, stderr=subprocess.STDOUT)


rule tokenize_shard:
    input:
        SOURCE_FILES,
        tokenizer=f"{DATA}/tokenizer/tokenizer.json",
    output:
        stats=f"{DATA}/shards/shard-{{shard}}.stats.json",
    params:
        data=data_params(),
        inputs=source_args(),
        fmt=_format_args(),
    log:
        "results/logs/tokenize/shard-{shard}.log",
    run:
        import subprocess

        d = CFG.data
        argv = [PY, "-m", "pipeline.tokenize", "shard", "--input", *params.inputs,
                "--tokenizer", str(Path(input.tokenizer).parent), "--seq-len", str(d.seq_len),
                "--shards", str(d.shards), "--shard", str(int(wildcards.shard)),
                "--out", DATA, "--val-fraction", str(d.val_fraction),
                "--on-invalid", d.on_invalid, *params.fmt] + (["--bos"] if d.bos else [])
        with open(log[0], "w") as f:
            subprocess.run(argv, check=True, stdout=f, stderr=subprocess.STDOUT)


rule gather:
    input:
        expand(f"{DATA}/shards/shard-{{shard}}.stats.json", shard=SHARDS),
        tokenizer=f"{DATA}/tokenizer/tokenizer.json",
    output:
        f"{DATA}/manifest.json",
    log:
        "results/logs/gather.log",
    shell:
        "{PY:q} -m pipeline.tokenize gather --out {DATA:q} --shards {CFG.data.shards}"
        " --tokenizer {DATA:q}/tokenizer > {log:q} 2>&1"
