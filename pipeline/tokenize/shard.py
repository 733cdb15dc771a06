"""One shard job: documents → packed Arrow sequences (the gather step is :mod:`.manifest`).

Output layout under ``out`` (see docs/ARCHITECTURE.md)::

    shards/train/shard-00003.arrow        Arrow IPC stream: input_ids fixed_size_list<int32>[seq_len],
    shards/validation/shard-00003.arrow   doc_starts list<int32> (row offsets where a document starts)
    shards/shard-00003.stats.json         written last: the shard's completion marker
    manifest.json                         written by gather, atomically

Packing: each document becomes ``[BOS] ids EOS`` (BOS only with ``bos=True``) and the documents
of a split are concatenated and cut into rows of ``seq_len``. Counts: ``tokens`` are the tokens
stored in rows (= sequences × seq_len); ``tail_tokens`` are those after the last full row, not
stored as a row but kept, as ids, in the stats file (``tail_ids``) so nothing is silently lost.

Validation split: a document goes to validation when the blake2b-64 hash of its UTF-8 bytes,
read as a fraction of 2**64, is below ``val_fraction`` — a property of the document alone, so
the split never overlaps training and does not change with the number of shards.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from pipeline.artifacts import inside
from pipeline.config.files import field_default
from pipeline.config.schema import MAX_SEQ_LEN, MAX_SHARDS, DataConfig
from pipeline.errors import PipelineError
from pipeline.io import sha256_file
from pipeline.text.encoders import HFEncoder, TiktokenEncoder, verify_encoder
from pipeline.text.readers import DocReader
from pipeline.text.sources import BigDoc, SourceSpec, plan
from pipeline.text.tokenizer import load_tokenizer, make_encoder, tokenizer_info

FORMAT = 1
SPLITS = ("train", "validation")
BATCH_CHARS = 2 << 20  # characters per encode batch: big enough to amortise, small for memory
FLUSH_TOKENS = 4 << 20  # tokens per Arrow record batch (~16 MB of int32)
VERIFY_CHARS = 64 << 10  # characters of real data re-checked against HF at the start of a shard


def shard_name(i: int, source: str | None = None) -> str:
    """``shard-00003``, or ``code.shard-00003`` for shard 3 of the source named ``code`` (a data
    directory of one unnamed source keeps the plain names)."""
    return f"shard-{i:05d}" if source is None else f"{source}.shard-{i:05d}"


def stats_path(out: str | os.PathLike[str], i: int, source: str | None = None) -> Path:
    """Where shard ``i``'s stats (completion marker) live."""
    return Path(out) / "shards" / f"{shard_name(i, source)}.stats.json"


def shard_path(out: str | os.PathLike[str], split: str, i: int, source: str | None = None) -> Path:
    """Where shard ``i`` of ``split`` lives."""
    return Path(out) / "shards" / split / f"{shard_name(i, source)}.arrow"


def check_source_name(source: str | None) -> None:
    """A source name becomes part of file names: the config's pattern, checked here too."""
    from pipeline.config.schema import SOURCE_NAME_RE

    if source is not None and not SOURCE_NAME_RE.fullmatch(source):
        raise PipelineError(
            f"--source-name {source!r} must match {SOURCE_NAME_RE.pattern} (letters, digits, "
            "'_', '.', '-')"
        )


def schema(seq_len: int) -> pa.Schema:
    """The shard schema (docs/ARCHITECTURE.md)."""
    return pa.schema(
        [
            pa.field("input_ids", pa.list_(pa.int32(), seq_len), nullable=False),
            pa.field("doc_starts", pa.list_(pa.int32()), nullable=False),
        ]
    )


#: What a data directory holds (tokenize writes shards/ and manifest.json; the tokenizer
#: command writes tokenizer/); dotfiles and manifest.json's temporary files besides.
DATA_DIR_NAMES = ("manifest.json", "tokenizer", "shards")


def check_data_out(out: Path) -> None:
    """Refuse an ``--out`` that is not a data directory: a file, or a folder holding anything
    but tokenize's outputs (``.``, a run directory, ``/``), so that shards never litter or
    overwrite a folder the stage did not make. Absent and empty folders are fine."""
    if not out.exists():
        if out.is_symlink():
            raise PipelineError(f"--out {out} is a dangling symbolic link: choose another folder")
        return
    if not out.is_dir():
        raise PipelineError(f"--out {out} is not a folder: name a data directory (e.g. results/data)")
    foreign = sorted(
        p.name for p in out.iterdir()
        if p.name not in DATA_DIR_NAMES and not p.name.startswith((".", "manifest.json"))
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise PipelineError(
            f"--out {out} is not a data directory (it holds {shown}): the shards go into a "
            "folder that holds only tokenize's outputs (manifest.json, shards/, tokenizer/); "
            "nothing was written; choose a new or empty folder"
        )
    for sub in (out / "shards", *(out / "shards" / s for s in SPLITS)):
        if (sub.exists() or sub.is_symlink()) and not sub.is_dir():
            raise PipelineError(f"{sub} is not a folder: remove it or choose another --out")


def _open_sink(path: Path) -> BinaryIO:
    """Open a shard's temporary file for writing (a seam for fault-injection tests)."""
    return open(path, "wb")


def is_validation(digest: bytes, val_fraction: float) -> bool:
    """The split of a document from its blake2b-64 digest."""
    return int.from_bytes(digest, "big") < val_fraction * 2.0**64


def _doc_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()


class _SplitWriter:
    """Packs one split's token stream into fixed-length rows and streams them to Arrow."""

    def __init__(self, final: Path, seq_len: int, eos_id: int, bos_id: int | None) -> None:
        self.final = final
        self.tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        self.seq_len = seq_len
        self.eos = np.array([eos_id], dtype=np.int32)
        self.bos = None if bos_id is None else np.array([bos_id], dtype=np.int32)
        self.schema = schema(seq_len)
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.starts: list[int] = []  # document starts, relative to the pending buffer
        self.sequences = 0
        self.documents = 0
        self.tail = np.zeros(0, dtype=np.int32)
        final.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO | None = None
        self._writer = None
        self._guard(self._open)

    def _open(self) -> None:
        self._file = _open_sink(self.tmp)
        self._writer = pa.ipc.new_stream(self._file, self.schema)

    def _guard(self, fn, *args) -> None:
        """Run a write step; on an OS error remove the partial file and say so."""
        try:
            fn(*args)
        except OSError as e:
            self.abort()
            what = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else f"I/O error ({e})"
            raise PipelineError(
                f"{what} while writing {self.final}: the partial file {self.tmp.name} was "
                "removed; free space (or fix the output directory) and rerun this shard"
            ) from e

    def add(self, ids: np.ndarray, start: bool, end: bool) -> None:
        """Append one document (or one piece of a big document)."""
        if start:
            self.starts.append(self.pending_len)
            self.documents += 1
            if self.bos is not None:
                self._push(self.bos)
        self._push(ids)
        if end:
            self._push(self.eos)
        if self.pending_len >= FLUSH_TOKENS:
            self._guard(self._flush)

    def _push(self, a: np.ndarray) -> None:
        if len(a):
            self.pending.append(a)
            self.pending_len += len(a)

    def _flush(self) -> None:
        n_rows = self.pending_len // self.seq_len
        if n_rows == 0:
            return
        buf = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        cut = n_rows * self.seq_len
        starts = np.asarray(self.starts, dtype=np.int64)
        inside = starts[starts < cut]
        counts = np.bincount(inside // self.seq_len, minlength=n_rows)
        offsets = np.zeros(n_rows + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        ids = pa.FixedSizeListArray.from_arrays(pa.array(buf[:cut], type=pa.int32()), self.seq_len)
        doc_starts = pa.ListArray.from_arrays(
            pa.array(offsets), pa.array((inside % self.seq_len).astype(np.int32))
        )
        assert self._writer is not None
        self._writer.write_batch(pa.record_batch([ids, doc_starts], schema=self.schema))
        rest = buf[cut:].copy()  # copy: do not pin the big buffer through a view
        self.pending = [rest] if len(rest) else []
        self.pending_len = len(rest)
        self.starts = [int(s) - cut for s in starts[starts >= cut]]
        self.sequences += n_rows

    def _close(self) -> None:
        self._flush()
        self.tail = np.concatenate(self.pending) if self.pending else np.zeros(0, np.int32)
        assert self._writer is not None and self._file is not None
        self._writer.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def finish(self) -> dict:
        """Flush, close, fsync, rename into place; the split's stats."""
        self._guard(self._close)
        digest = sha256_file(self.tmp)
        size = self.tmp.stat().st_size
        os.replace(self.tmp, self.final)
        return {
            "sha256": digest,
            "bytes": size,
            "sequences": self.sequences,
            "tokens": self.sequences * self.seq_len,
            "documents": self.documents,
            "tail_tokens": len(self.tail),
            "tail_ids": self.tail.tolist(),
        }

    def abort(self) -> None:
        """Drop the partial file (any error, any interrupt)."""
        for closer in (getattr(self._writer, "close", None), getattr(self._file, "close", None)):
            try:
                if closer is not None:
                    closer()
            except Exception:  # already failing; the partial file goes anyway
                pass
        self._writer = None
        self.tmp.unlink(missing_ok=True)


def _options(
    spec: SourceSpec,
    seq_len: int,
    shards: int,
    tok_fp: str,
    val_fraction: float,
    bos: bool,
    on_invalid: str | None,
) -> dict:
    return {
        **spec.options(),
        "seq_len": seq_len,
        "shards": shards,
        "tokenizer_fingerprint": tok_fp,
        "val_fraction": val_fraction,
        "bos": bos,
        "on_invalid": on_invalid,
    }


def _complete(
    out: Path, shard: int, options: dict, sources: list[dict], source: str | None
) -> dict | None:
    """The stats of shard ``shard`` if it is complete for these options and inputs."""
    sp = stats_path(out, shard, source)
    if not sp.is_file():
        return None
    try:
        stats = json.loads(sp.read_text())
        if stats.get("options") != options or stats.get("sources") != sources:
            return None
        for split in SPLITS:
            entry = stats["splits"][split]
            p = inside(out, entry["path"])  # a path read from a file stays in the data dir
            if (
                not p.is_file()
                or p.stat().st_size != entry["bytes"]
                or sha256_file(p) != entry["sha256"]
            ):
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable or malformed (PipelineError included): redo the shard
    return stats


def tokenize_shard(
    spec: SourceSpec,
    tokenizer: str | os.PathLike[str],
    *,
    seq_len: int,
    shards: int,
    shard: int,
    out: str | os.PathLike[str],
    val_fraction: float = field_default(DataConfig, "val_fraction"),
    on_invalid: str | None = None,
    bos: bool = False,
    fast: bool = True,
    num_threads: int | None = None,
    progress: bool = True,
    source: str | None = None,
) -> dict:
    """Tokenize shard ``shard`` of ``shards`` into ``out``; returns its stats.

    ``source`` names the data source these inputs are (``data.sources[].name``): its shards get
    their own files (:func:`shard_name`) and the gather step counts them apart. Skips the work
    (returning the existing stats) when the shard is already complete for the same inputs and
    options and its files match their checksums.
    """
    _check_args(seq_len, shards, shard, val_fraction)
    check_source_name(source)
    if num_threads is not None and num_threads < 1:
        raise PipelineError(f"--threads {num_threads} must be at least 1")
    info = tokenizer_info(tokenizer, bos=bos)
    sources = spec.resolve()
    out = Path(out)
    check_data_out(out)
    src_list = [{"path": s.path, "bytes": s.bytes} for s in sources]
    options = _options(spec, seq_len, shards, info.fingerprint, val_fraction, bos, on_invalid)
    done = _complete(out, shard, options, src_list, source)
    if done is not None:
        print(f"{shard_name(shard, source)}: already complete, checksums match; skipping",
              file=sys.stderr)
        return done
    # A stale marker must not outlive a rewrite.
    stats_path(out, shard, source).unlink(missing_ok=True)

    tasks = plan(sources, shards, shard)
    reader = DocReader(spec, on_invalid=on_invalid)
    t0 = time.perf_counter()
    made = [d for d in (out, out / "shards", *(out / "shards" / s for s in SPLITS))
            if not d.exists()]
    try:
        split_stats, encoder_name = _write_splits(
            reader, tasks, info, out, shard, seq_len, val_fraction,
            fast=fast, num_threads=num_threads, progress=progress, source=source,
        )
        docs = sum(s["documents"] for s in split_stats.values())
        if docs == 0 and shards == 1:
            for split in SPLITS:
                shard_path(out, split, shard, source).unlink(missing_ok=True)
            raise PipelineError(
                f"the corpus has no usable documents (skipped: {reader.describe_skipped()}): "
                "check --input, --format, --text-field and --doc-split"
            )
    except BaseException:
        for d in reversed(made):  # the folders this job made, when it leaves them empty
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    elapsed = time.perf_counter() - t0
    total_tokens = sum(s["tokens"] + s["tail_tokens"] for s in split_stats.values())
    stats = {
        "format": FORMAT,
        "shard": shard,
        **({} if source is None else {"source": source}),
        "options": options,
        "splits": split_stats,
        "skipped": reader.skipped,
        "skipped_examples": reader.examples,  # the first skipped document of each reason
        "sources": src_list,
        "read": [
            {
                "path": t.source.path,
                "lo": t.lo,
                "hi": None if t.hi == float("inf") else t.hi,
                "row_groups": list(t.row_groups) if t.row_groups is not None else None,
            }
            for t in tasks
        ],
        "encoder": encoder_name,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(total_tokens / elapsed, 1) if elapsed > 0 else None,
    }
    sp = stats_path(out, shard, source)
    tmp = sp.with_name(f"{sp.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(stats) + "\n")
    os.replace(tmp, sp)
    return stats


def _check_args(seq_len: int, shards: int, shard: int, val_fraction: float) -> None:
    if seq_len <= 1:
        raise PipelineError(
            f"--seq-len {seq_len} must be at least 2 (a sequence needs an input and a target)"
        )
    # The caller's own limits too (the CLI's options check them as they parse): a row buffer
    # is seq_len long, and every shard job plans its share of the corpus.
    if seq_len > MAX_SEQ_LEN:
        raise PipelineError(f"--seq-len {seq_len} is more than {MAX_SEQ_LEN} (data.seq_len)")
    if shards > MAX_SHARDS:
        raise PipelineError(f"--shards {shards} is more than {MAX_SHARDS} (data.shards)")
    if shards < 1 or not 0 <= shard < shards:
        raise PipelineError(f"--shard {shard} must be in 0..{shards - 1} (--shards {shards})")
    if not 0.0 <= val_fraction < 1.0:
        raise PipelineError(f"--val-fraction {val_fraction} must be in [0, 1)")


def _write_splits(
    reader: DocReader,
    tasks: list,
    info,
    out: Path,
    shard: int,
    seq_len: int,
    val_fraction: float,
    *,
    fast: bool,
    num_threads: int | None,
    progress: bool,
    source: str | None = None,
) -> tuple[dict[str, dict], str]:
    """Encode the shard's documents into its train and validation files: (stats of each split,
    name of the encoder that wrote them). A failure removes the partial files."""
    tok = load_tokenizer(info.path)
    encoder = make_encoder(tok, fast=fast, num_threads=num_threads)
    writers: dict[str, _SplitWriter] = {}
    bar = None
    try:
        for split in SPLITS:
            writers[split] = _SplitWriter(
                shard_path(out, split, shard, source), seq_len, info.eos_id, info.bos_id
            )
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                desc=shard_name(shard, source),
                unit="tok",
                unit_scale=True,
                mininterval=1.0 if sys.stderr.isatty() else 30.0,
            )
        encoder = _run(reader, tasks, encoder, tok, writers, val_fraction, bar)
        split_stats = {s: writers[s].finish() for s in SPLITS}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
        encoder.close()
    for split in SPLITS:
        split_stats[split]["path"] = str(shard_path(out, split, shard, source).relative_to(out))
    return split_stats, encoder.name


def _batches(
    reader: DocReader, tasks, val_fraction: float
) -> Iterator[tuple[list[str], list[tuple[str, bool, bool]]]]:
    """Encode batches: texts plus (split, starts a document, ends a document) per text."""
    texts: list[str] = []
    meta: list[tuple[str, bool, bool]] = []
    chars = 0
    # The first batches are small so that encoding starts while reading goes on (a small
    # shard is otherwise read whole before its first encode); the size then doubles up to
    # BATCH_CHARS.
    limit = BATCH_CHARS // 16
    for doc in reader.read(tasks):
        if isinstance(doc, BigDoc):
            digest = reader.scan_big(doc)
            if digest is None:
                continue
            split = "validation" if is_validation(digest, val_fraction) else "train"
            pieces = doc.pieces()
            piece = next(pieces, "")
            first = True
            while True:
                nxt = next(pieces, None)
                texts.append(piece)
                meta.append((split, first, nxt is None))
                chars += len(piece)
                first = False
                if chars >= limit:
                    yield texts, meta
                    texts, meta, chars = [], [], 0
                    limit = min(2 * limit, BATCH_CHARS)
                if nxt is None:
                    break
                piece = nxt
            continue
        split = (
            "validation"
            if val_fraction > 0 and is_validation(_doc_digest(doc), val_fraction)
            else "train"
        )
        texts.append(doc)
        meta.append((split, True, True))
        chars += len(doc)
        if chars >= limit:
            yield texts, meta
            texts, meta, chars = [], [], 0
            limit = min(2 * limit, BATCH_CHARS)
    if texts:
        yield texts, meta


def _run(reader, tasks, encoder, tok, writers, val_fraction, bar):
    """Read → encode (in the background, one batch ahead) → pack and write, in order."""
    inflight: deque[tuple[Future, list]] = deque()
    first = True
    with ThreadPoolExecutor(1, thread_name_prefix="encode") as ex:

        def drain_one() -> None:
            fut, meta = inflight.popleft()
            for ids, (split, start, end) in zip(fut.result(), meta, strict=True):
                writers[split].add(ids, start, end)
            if bar is not None:
                bar.update(sum(len(i) for i in fut.result()) + len(meta))

        for texts, meta in _batches(reader, tasks, val_fraction):
            if first and isinstance(encoder, TiktokenEncoder):
                # Re-check the fast path on this shard's own text before trusting it.
                sample, n = [], 0
                for t in texts:
                    if n >= VERIFY_CHARS:
                        break
                    # Truncating is fine: both encoders see the same string. It bounds memory
                    # (HF's Encoding objects are heavy) when the first text is a big-doc piece.
                    sample.append(t[: VERIFY_CHARS - n])
                    n += len(sample[-1])
                diff = verify_encoder(encoder, HFEncoder(tok), sample)
                if diff is not None:
                    warnings.warn(
                        f"fast tiktoken encoder disagrees with the HF tokenizer on this shard's "
                        f"text ({diff}); falling back to HF encode_batch (exact, slower)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    encoder.close()
                    encoder = HFEncoder(tok)
            first = False
            inflight.append((ex.submit(encoder.encode_batch, texts), meta))
            while len(inflight) > 1:
                drain_one()
        while inflight:
            drain_one()
    return encoder
