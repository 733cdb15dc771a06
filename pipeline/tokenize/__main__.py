"""CLI of the tokenize stage.

    python -m pipeline.tokenize shard --input PATH... --tokenizer DIR --seq-len N --shards K
        --shard I --out DIR [--format auto|txt|jsonl|parquet] [--text-field F]
        [--doc-split file|blank-line] [--val-fraction F] [--on-invalid skip|fail] [--bos]
        [--no-fast] [--threads N] [--no-progress] [--source-name NAME]
    python -m pipeline.tokenize gather --out DIR --shards K --tokenizer DIR [--source NAME]...
    python -m pipeline.tokenize tokenizer {train,import,fingerprint} ...   (the tokenizer's own
        command, :mod:`pipeline.text.tokenizer`: the shards need a tokenizer first)

``shard`` may be omitted (``python -m pipeline.tokenize --input ...`` tokenizes one shard).
User errors print ``error: <message>`` to stderr and exit with status 2. Options that mirror a
config key (``data.*``) take its default and description from ``pipeline.config.schema``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pipeline.config.files import in_range, mirror_argument
from pipeline.config.schema import MAX_SHARDS, DataConfig
from pipeline.errors import PipelineError
from pipeline.text.readers import add_reader_arguments

#: Encoder threads one shard job may start.
MAX_THREADS = 4096


def _parser() -> argparse.ArgumentParser:
    """Options that mirror a config key take its default and description from the config."""
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.tokenize",
        description="Tokenize raw text into packed Arrow shards, then gather a manifest.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("tokenizer", add_help=False,
                   help="train, import or fingerprint a tokenizer "
                   "(python -m pipeline.tokenize tokenizer --help)")
    sh = sub.add_parser("shard", help="tokenize shard I of K")
    sh.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, dirs or globs; <stdlib> = Python's stdlib dir",
    )
    sh.add_argument("--tokenizer", required=True, help="HF tokenizer dir or tokenizer.json")
    mirror_argument(sh, "--seq-len", DataConfig, "seq_len", required=True)
    # Not data.shards' default: one command alone tokenizes everything unless told to split.
    mirror_argument(sh, "--shards", DataConfig, "shards", default=1,
                    help="number of shard jobs, K (config: data.shards)")
    sh.add_argument("--shard", type=int, default=0, help="this job's shard, 0 <= I < K",
                    **in_range(0, MAX_SHARDS - 1, "a shard index"))
    sh.add_argument("--out", required=True, help="data directory (shards/ and manifest.json)")
    add_reader_arguments(sh)
    mirror_argument(sh, "--val-fraction", DataConfig, "val_fraction")
    mirror_argument(sh, "--on-invalid", DataConfig, "on_invalid")
    mirror_argument(sh, "--bos", DataConfig, "bos")
    sh.add_argument(
        "--no-fast", action="store_true", help="use HF encode_batch, not the tiktoken fast path"
    )
    sh.add_argument(
        "--threads", type=int, default=None, help="encoder threads (default: usable cores)",
        **in_range(1, MAX_THREADS, "a thread count")
    )
    sh.add_argument("--no-progress", action="store_true")
    sh.add_argument(
        "--source-name",
        default=None,
        help="the data source these inputs are (data.sources[].name): its own shard files",
    )
    ga = sub.add_parser("gather", help="write manifest.json from complete shards")
    ga.add_argument("--out", required=True)
    mirror_argument(ga, "--shards", DataConfig, "shards", required=True,
                    help="number of shard jobs, K (config: data.shards)")
    ga.add_argument("--tokenizer", required=True)
    ga.add_argument(
        "--source",
        action="append",
        default=None,
        help="a named source's shards (repeat, in the config's order); none: one unnamed source",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--") and argv[0] not in ("--help", "-h"):
        argv.insert(0, "shard")  # `python -m pipeline.tokenize --input ...` = one shard
    if argv and argv[0] == "tokenizer":
        from pipeline.text.tokenizer import main as tokenizer_main

        return tokenizer_main(argv[1:])
    args = _parser().parse_args(argv)
    from pipeline.text.sources import SourceSpec
    from pipeline.tokenize.manifest import gather
    from pipeline.tokenize.shard import tokenize_shard

    try:
        if args.cmd == "shard":
            spec = SourceSpec.from_args(
                args.input, fmt=args.format, text_field=args.text_field, doc_split=args.doc_split
            )
            stats = tokenize_shard(
                spec,
                args.tokenizer,
                seq_len=args.seq_len,
                shards=args.shards,
                shard=args.shard,
                out=args.out,
                val_fraction=args.val_fraction,
                on_invalid=args.on_invalid,
                bos=args.bos,
                fast=not args.no_fast,
                num_threads=args.threads,
                progress=not args.no_progress,
                source=args.source_name,
            )
            summary = {
                k: stats[k] for k in ("shard", "skipped", "encoder", "elapsed_s", "tokens_per_s")
            }
            summary["splits"] = {
                s: {k: v for k, v in e.items() if k != "tail_ids"}
                for s, e in stats["splits"].items()
            }
            print(json.dumps(summary))
        else:
            m = gather(args.out, args.shards, args.tokenizer, args.source)
            print(
                json.dumps(
                    {
                        s: {k: v for k, v in e.items() if k != "shards"}
                        for s, e in m["splits"].items()
                    }
                )
            )
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output folder cannot be written (permissions, a file in the way)
        print(f"error: {e.filename or args.out}: {e.strerror or e}: check --out", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
