"""The gather step: the stats of every complete shard → ``manifest.json`` (written atomically).

The layout of the shards and of their stats files is described in :mod:`pipeline.tokenize.shard`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from pipeline.artifacts import inside, read_artifact
from pipeline.data.mixture import DEFAULT_SOURCE
from pipeline.errors import PipelineError
from pipeline.text.tokenizer import tokenizer_info
from pipeline.tokenize.shard import FORMAT, SPLITS, shard_name, stats_path

#: Per-split counts summed over the shards.
_KEYS = ("sequences", "tokens", "documents", "tail_tokens")


#: Options every source's shards must share (they are packed into one vocabulary and length).
_SHARED = ("seq_len", "shards", "tokenizer_fingerprint", "val_fraction", "bos")


def gather(
    out: str | os.PathLike[str],
    shards: int,
    tokenizer: str | os.PathLike[str],
    sources: Sequence[str] | None = None,
) -> dict:
    """Combine the stats of all ``shards`` shards into ``out/manifest.json`` (atomically).

    ``sources``: the names of the data sources (each tokenized into its own ``shards`` shards,
    ``tokenize_shard(source=...)``), in the config's order; None is the one unnamed source. The
    manifest lists every source's shards together, each entry naming its ``source``, and counts
    each source apart under ``by_source``.
    """
    out = Path(out)
    names: list[str | None] = [None] if not sources else list(sources)
    if len(set(names)) != len(names):
        raise PipelineError(f"--source names must be unique, got {list(sources or [])}")
    per_source = [_load_stats(out, shards, name) for name in names]
    stats = [st for group in per_source for st in group]
    opts = stats[0]["options"]
    for name, group in zip(names, per_source, strict=True):
        theirs = {k: group[0]["options"].get(k) for k in _SHARED}
        if theirs != {k: opts.get(k) for k in _SHARED}:
            raise PipelineError(
                f"the shards of source {name!r} were made with other options ({theirs}) than "
                f"those of {names[0]!r}: rerun every source's shard jobs with the same seq_len, "
                "shards, tokenizer, val_fraction and bos"
            )
    info = tokenizer_info(tokenizer, bos=opts["bos"])
    if info.fingerprint != opts["tokenizer_fingerprint"]:
        raise PipelineError(
            f"tokenizer {info.path} (fingerprint {info.fingerprint[:12]}) is not the one the shards "
            f"were made with ({opts['tokenizer_fingerprint'][:12]}): rerun the shard jobs or name "
            "the right --tokenizer"
        )
    splits = {split: _split(out, stats, split) for split in SPLITS}
    if splits["train"]["documents"] == 0:
        skipped = _sum_skipped(stats)
        examples: dict[str, str] = {}
        for st in stats:
            eg = st.get("skipped_examples")
            for k, v in (eg.items() if isinstance(eg, dict) else ()):
                examples.setdefault(str(k), str(v))
        eg_text = "; ".join(f"{k}: {v}" for k, v in examples.items())
        raise PipelineError(
            f"the corpus has no usable training documents (skipped: {skipped or 'none'}"
            + (f", e.g. {eg_text}" if eg_text else "")
            + "): check --input, --format, --text-field and --doc-split"
        )
    if splits["train"]["sequences"] == 0:
        raise PipelineError(
            f"the training split has {splits['train']['tail_tokens']} tokens, fewer than one "
            f"sequence of {opts['seq_len']}: add data or lower --seq-len"
        )
    if opts["val_fraction"] > 0 and splits["validation"]["sequences"] == 0:
        warnings.warn(
            "the validation split has no full sequence: raise --val-fraction or add data",
            RuntimeWarning,
            stacklevel=2,
        )
    tok_dir = info.path.parent if info.path.name == "tokenizer.json" else info.path
    if out.resolve() not in tok_dir.resolve().parents:
        warnings.warn(
            f"tokenizer {tok_dir} is outside {out}: stages read the manifest's tokenizer only "
            f"from inside the data directory (consolidate will refuse it); copy it in with "
            f"`python -m pipeline.tokenize tokenizer import --path {tok_dir} --out {out / 'tokenizer'}`",
            RuntimeWarning,
            stacklevel=2,
        )
    manifest = {
        "format": FORMAT,
        "seq_len": opts["seq_len"],
        "tokenizer": {
            "path": os.path.relpath(tok_dir, out),
            "fingerprint": info.fingerprint,
            "vocab_size": info.vocab_size,
            "eos_id": info.eos_id,
            "bos_id": info.bos_id,
        },
        "splits": splits,
        "skipped": _sum_skipped(stats),
        "sources": [f for group in per_source for f in group[0]["sources"]],
        "options": {k: v for k, v in opts.items() if k not in ("tokenizer_fingerprint",)},
        "encoders": sorted({st["encoder"] for st in stats}),
        "by_source": {
            name or DEFAULT_SOURCE: _source_entry(out, group) for name, group in zip(
                names, per_source, strict=True)
        },
    }
    mp = out / "manifest.json"
    tmp = mp.with_name(f"manifest.json.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, mp)
    return manifest


def _source_entry(out: Path, stats: list[dict]) -> dict:
    """One source's counts per split, its input files and reading options."""
    entry: dict = {}
    for split in SPLITS:
        entry[split] = {k: sum(st["splits"][split][k] for st in stats) for k in _KEYS}
    opts = stats[0]["options"]
    entry["options"] = {k: opts.get(k) for k in ("format", "text_field", "doc_split")}
    entry["inputs"] = stats[0]["sources"]
    entry["skipped"] = _sum_skipped(stats)
    return entry


def _load_stats(out: Path, shards: int, source: str | None = None) -> list[dict]:
    """The stats of every shard of one source, checked to be there and made with the same
    inputs/options."""
    if shards < 1:
        raise PipelineError(f"--shards {shards} must be at least 1")
    missing = [i for i in range(shards) if not stats_path(out, i, source).is_file()]
    if missing:
        of = "" if source is None else f" of source {source!r}"
        raise PipelineError(
            f"shard(s) {', '.join(map(str, missing[:20]))}{' ...' if len(missing) > 20 else ''}"
            f"{of} of {shards} are not complete in {out / 'shards'} (no stats file): run those "
            "shard jobs first"
        )
    stats = [_read_stats(out, i, source) for i in range(shards)]
    opts = stats[0]["options"]
    for st in stats[1:]:
        if st["options"] != opts or st["sources"] != stats[0]["sources"]:
            raise PipelineError(
                f"{shard_name(st['shard'], source)} was made with different inputs or options "
                f"than {shard_name(0, source)}: rerun all shard jobs with the same arguments"
            )
    if opts["shards"] != shards:
        raise PipelineError(f"the shards were made with --shards {opts['shards']}, not {shards}")
    return stats


def _read_stats(out: Path, i: int, source: str | None = None) -> dict:
    """Shard ``i``'s stats file, checked to have what gather reads (a stats file cut short or
    edited is an error naming it and the shard to rerun)."""
    sp = stats_path(out, i, source)
    redo = f"delete it and rerun shard job {i} (python -m pipeline.tokenize shard ... --shard {i})"
    st = read_artifact(sp, "shard stats file", hint=redo)
    try:
        ok = (
            isinstance(st["options"], dict)
            and all(k in st["options"] for k in ("seq_len", "shards", "tokenizer_fingerprint",
                                                   "val_fraction", "bos"))
            and isinstance(st["sources"], list)
            and isinstance(st["skipped"], dict)
            and all(isinstance(v, int) for v in st["skipped"].values())
            and isinstance(st["encoder"], str)
            and st["shard"] == i
            and st.get("source") == source
            and all(
                isinstance(st["splits"][s]["path"], str)
                and isinstance(st["splits"][s]["sha256"], str)
                and all(type(st["splits"][s][k]) is int for k in ("bytes", *_KEYS))
                for s in SPLITS
            )
        )
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise PipelineError(f"{sp}: the shard stats file is incomplete or malformed; {redo}")
    return st


def _split(out: Path, stats: list[dict], split: str) -> dict:
    """One split's manifest entry: its totals and each shard's file (checked to be there)."""
    entries = []
    for st in stats:
        e = st["splits"][split]
        p = inside(out, e["path"], stats_path(out, st["shard"], st.get("source")))
        if not p.is_file() or p.stat().st_size != e["bytes"]:
            raise PipelineError(
                f"{p} is missing or has the wrong size ({e['bytes']} bytes expected): rerun "
                f"shard {st['shard']}"
            )
        entries.append(
            {
                **({"source": st["source"]} if "source" in st else {}),
                "path": e["path"],
                "sha256": e["sha256"],
                "bytes": e["bytes"],
                **{k: e[k] for k in _KEYS},
            }
        )
    return {**{k: sum(e[k] for e in entries) for k in _KEYS}, "shards": entries}


def _sum_skipped(stats: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for st in stats:
        for k, v in st["skipped"].items():
            total[k] = total.get(k, 0) + v
    return dict(sorted(total.items()))
