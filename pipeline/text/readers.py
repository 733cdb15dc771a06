"""Reading documents: each format's documents from a shard's tasks, with skip counts.

Documents and their normalisation (what a round trip gives back):

* ``txt`` with ``--doc-split file`` (default): the whole file, decoded as strict UTF-8, byte for
  byte (no newline translation, no stripping). A whitespace-only file is skipped as ``empty``.
* ``txt`` with ``--doc-split blank-line``: blocks of consecutive non-blank lines (a blank line is
  empty or whitespace-only); a block keeps its internal line breaks; the line terminator of its
  last line (``\\n`` or ``\\r\\n``) is removed.
* ``jsonl``: the string value of the text field of each line; blank lines are ignored; a null or
  whitespace-only value is skipped as ``empty``.
* ``parquet``: each non-null, non-blank value of the text column (string or UTF-8 binary).
* ``arrow``: the same, from Arrow IPC files: what ``datasets``' ``save_to_disk`` writes (name
  the folder; its ``state.json`` lists the files).
* ``.gz`` / ``.zst`` variants of each are decompressed on the fly.

Which part of which file a shard reads, and big documents, are :mod:`pipeline.text.sources`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from typing import BinaryIO, get_args

from pipeline.config.files import mirror_argument
from pipeline.config.schema import OnInvalid, SourceConfig
from pipeline.errors import PipelineError

# sources.BIG_DOC_BYTES is read at call time (tests shrink it to exercise big documents).
from pipeline.text import sources
from pipeline.text.sources import BigDoc, Source, SourceSpec, Task, open_binary, plan, reading


def _line_number(src: Source, offset: int) -> int:
    """1-based line number of the line starting at byte ``offset`` (computed only for errors)."""
    n = 1
    remaining = offset
    with open_binary(src.path, src.compression) as f:
        while remaining > 0:
            buf = f.read(min(sources.READ_CHUNK, remaining))
            if not buf:
                break
            n += buf.count(b"\n")
            remaining -= len(buf)
    return n



# ---------------------------------------------------------------------------------------------
# Reading documents
# ---------------------------------------------------------------------------------------------


class DocReader:
    """Yields the documents (``str`` or :class:`BigDoc`) of a shard's tasks, counting skips.

    ``on_invalid``: None = defaults (invalid UTF-8 is skipped and counted; a bad JSONL line is an
    error), "skip" = skip and count everything, "fail" = every invalid document is an error.
    """

    def __init__(self, spec: SourceSpec, *, on_invalid: OnInvalid | None = None) -> None:
        if on_invalid is not None and on_invalid not in get_args(OnInvalid):
            raise PipelineError(
                f"--on-invalid {on_invalid!r} must be one of {', '.join(get_args(OnInvalid))}"
            )
        self.spec = spec
        self.on_invalid = on_invalid
        self.skipped: dict[str, int] = {}
        #: The first skipped document of each reason: where it is (for "nothing usable" errors).
        self.examples: dict[str, str] = {}
        self._where = ""  # the file being read

    def _count(self, reason: str, where: str | None = None) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.examples.setdefault(reason, where or self._where)

    def describe_skipped(self) -> str:
        """``{'invalid_utf8': 2} (e.g. invalid_utf8: /data/x.bin)``, or ``none``."""
        if not self.skipped:
            return "none"
        eg = "; ".join(f"{k}: {v}" for k, v in self.examples.items() if v)
        return f"{self.skipped}" + (f" (e.g. {eg})" if eg else "")

    def _skip(self, reason: str, default_skip: bool, message: str) -> None:
        if self.on_invalid == "fail" or (self.on_invalid is None and not default_skip):
            hint = (
                " (or pass --on-invalid skip to skip and count such documents)"
                if self.on_invalid != "skip"
                else ""
            )
            raise PipelineError(message + hint)
        self._count(reason, message.split(": ", 1)[0])

    def _decode(self, data: bytes, where: str) -> str | None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            self._skip(
                "invalid_utf8",
                True,
                f"{where}: invalid UTF-8 at byte {e.start} of the document; fix or re-encode "
                "the file as UTF-8",
            )
            return None
        if not text.strip():
            self._count("empty", where)
            return None
        return text

    def scan_big(self, doc: BigDoc) -> bytes | None:
        """Validate a big document in one streaming pass: its blake2b-64 digest, or None when
        it is skipped (invalid UTF-8 or blank), counted like any other document."""
        ok, digest, _, nonblank = doc.scan()
        if not ok:
            self._skip(
                "invalid_utf8",
                True,
                f"{doc.path} (document starting at byte {doc.start}): invalid UTF-8; fix or "
                "re-encode the file as UTF-8",
            )
            return None
        if not nonblank:
            self._count("empty", doc.path)
            return None
        return digest

    def read(self, tasks: Sequence[Task]) -> Iterator[str | BigDoc]:
        """All documents of ``tasks`` in order; a file that cannot be read (corrupt, truncated,
        unreadable) is a :class:`PipelineError` naming it."""
        for t in tasks:
            s = t.source
            self._where = s.path
            with reading(s.path):
                if s.fmt == "parquet":
                    yield from self._parquet(t)
                elif s.fmt == "arrow":
                    yield from self._arrow(t)
                elif s.fmt == "jsonl":
                    yield from self._jsonl(t)
                elif self.spec.doc_split == "blank-line":
                    yield from self._blocks(t)
                else:
                    yield from self._whole(t)

    # -- txt, one document per file ----------------------------------------------------------
    def _whole(self, t: Task) -> Iterator[str | BigDoc]:
        s = t.source
        with open_binary(s.path, s.compression) as f:
            data = f.read(sources.BIG_DOC_BYTES + 1)
        if len(data) > sources.BIG_DOC_BYTES:
            yield BigDoc(s.path, s.compression, 0, None)
            return
        text = self._decode(data, s.path)
        if text is not None:
            yield text

    # -- txt, blank-line separated blocks ----------------------------------------------------
    def _blocks(self, t: Task) -> Iterator[str | BigDoc]:
        s = t.source
        count = 0
        with open_binary(s.path, s.compression) as f:
            pos = 0
            skipping = False
            if t.lo > 0:
                f.seek(t.lo - 1)
                pos = t.lo - 1 + len(f.readline())
                # The block at `pos` is ours only if the line before it is blank.
                skipping = not _prev_line_blank(f, pos)
                f.seek(pos)
            start = end = 0
            parts: list[bytes] | None = None  # None: not in a block
            big = False
            size = 0
            for line in iter(f.readline, b""):
                lstart = pos
                pos += len(line)
                if not line.strip():
                    if parts is not None:
                        count += 1
                        yield from self._block(s, start, end, parts, big)
                        parts = None
                    skipping = False
                    continue
                if skipping:
                    continue  # tail of a block that started in the previous shard's range
                if parts is None:
                    if lstart >= t.hi:
                        break
                    start, end, parts, big, size = lstart, pos, [line], False, len(line)
                else:
                    end = pos
                    size += len(line)
                    if big:
                        continue
                    if size > sources.BIG_DOC_BYTES:
                        big, parts = True, []
                    else:
                        parts.append(line)
            if parts is not None:
                count += 1
                yield from self._block(s, start, end, parts, big)
        if count == 0 and t.lo == 0 and t.hi >= s.bytes:
            self._count("empty", s.path)  # a file with no text

    def _block(
        self, s: Source, start: int, end: int, parts: list[bytes], big: bool
    ) -> Iterator[str | BigDoc]:
        if big:
            # Find the terminator length of the last line without holding the block.
            tail = b"".join(BigDoc(s.path, s.compression, max(start, end - 2), end).chunks())
            cut = 2 if tail.endswith(b"\r\n") else (1 if tail.endswith(b"\n") else 0)
            yield BigDoc(s.path, s.compression, start, end - cut)
            return
        data = b"".join(parts)
        if data.endswith(b"\n"):
            data = data[:-2] if data.endswith(b"\r\n") else data[:-1]
        text = self._decode(data, f"{s.path} (block starting at byte {start})")
        if text is not None:
            yield text

    # -- JSON Lines -----------------------------------------------------------------------------
    def _jsonl(self, t: Task) -> Iterator[str]:
        s = t.source
        field_ = self.spec.text_field
        with open_binary(s.path, s.compression) as f:
            pos = 0
            if t.lo > 0:
                f.seek(t.lo - 1)
                pos = t.lo - 1 + len(f.readline())
            for line in iter(f.readline, b""):
                lstart = pos
                pos += len(line)
                if lstart >= t.hi:
                    break
                if not line.strip():
                    continue

                def where(lstart: int = lstart) -> str:
                    return f"{s.path}:{_line_number(s, lstart)}"

                try:
                    raw = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    self._skip(
                        "invalid_utf8",
                        True,
                        f"{where()}: invalid UTF-8 at byte {e.start} of the line; re-encode the file as UTF-8",
                    )
                    continue
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError as e:
                    self._skip(
                        "invalid_json",
                        False,
                        f"{where()}: not valid JSON ({e.msg} at column {e.colno}); fix the line",
                    )
                    continue
                if not isinstance(obj, dict) or field_ not in obj:
                    self._skip(
                        "missing_field",
                        False,
                        f"{where()}: no field {field_!r} in this JSON line; set --text-field to "
                        "the field that holds the text",
                    )
                    continue
                val = obj[field_]
                if val is None or (isinstance(val, str) and not val.strip()):
                    self._count("empty", s.path)
                    continue
                if not isinstance(val, str):
                    self._skip(
                        "missing_field",
                        False,
                        f"{where()}: field {field_!r} is a {type(val).__name__}, not a string",
                    )
                    continue
                yield val

    # -- Parquet --------------------------------------------------------------------------------
    def _parquet(self, t: Task) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        s = t.source
        col = self.spec.text_field
        try:
            pf = pq.ParquetFile(s.path)
        except (pa.ArrowInvalid, OSError) as e:
            raise PipelineError(f"{s.path}: not a readable Parquet file ({e})") from e
        names = pf.schema_arrow.names
        if col not in names:
            raise PipelineError(
                f"{s.path}: Parquet file has no column {col!r} (columns: {', '.join(names)}); "
                "set --text-field to the column that holds the text"
            )
        groups = list(t.row_groups) if t.row_groups is not None else None
        for batch in pf.iter_batches(batch_size=1024, row_groups=groups, columns=[col]):
            yield from self._values(batch.column(0), s, col)

    # -- Arrow (the files of a `datasets` directory, save_to_disk) ------------------------------
    def _arrow(self, t: Task) -> Iterator[str]:
        import pyarrow as pa

        s = t.source
        col = self.spec.text_field
        with pa.memory_map(s.path, "r") as mm:
            try:  # datasets writes IPC streams; IPC files are read too
                batches = iter(pa.ipc.open_stream(mm))
            except pa.ArrowInvalid:
                mm.seek(0)
                f = pa.ipc.open_file(mm)
                batches = (f.get_batch(i) for i in range(f.num_record_batches))
            for batch in batches:
                if col not in batch.schema.names:
                    raise PipelineError(
                        f"{s.path}: Arrow file has no column {col!r} (columns: "
                        f"{', '.join(batch.schema.names)}); set text_field to the text column"
                    )
                yield from self._values(batch.column(col), s, col)

    def _values(self, arr, s: Source, col: str) -> Iterator[str]:
        """The documents of one text column chunk (Parquet or Arrow), counting skips."""
        import pyarrow as pa

        binary = pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)
        for v in arr.to_pylist():
            if v is None:
                self._count("empty", s.path)
                continue
            if binary:
                v = self._decode(v, f"{s.path} (column {col!r})")
                if v is None:
                    continue
            elif not isinstance(v, str):
                raise PipelineError(
                    f"{s.path}: column {col!r} holds {arr.type}, not text; name a string column with --text-field"
                )
            elif not v.strip():
                self._count("empty", s.path)
                continue
            yield v


def _prev_line_blank(f: BinaryIO, pos: int) -> bool:
    """Is the line that ends just before byte ``pos`` (whose last byte is a newline) blank?"""
    i = pos - 1  # index of that line's newline
    while i > 0:
        s = max(0, i - 65536)
        f.seek(s)
        buf = f.read(i - s)
        j = buf.rfind(b"\n")
        seg = buf[j + 1 :] if j >= 0 else buf
        if seg.strip():
            return False
        if j >= 0:
            return True
        i = s
    return True


def iter_texts(
    spec: SourceSpec,
    *,
    max_bytes: int | None = None,
    skipped: dict[str, int] | None = None,
    on_invalid: str | None = None,
    examples: dict[str, str] | None = None,
) -> Iterator[str]:
    """Every document of ``spec`` as text (big documents as pieces), at most ``max_bytes``
    bytes in all; used to train tokenizers. A big document is read, and checked, only as far
    as the budget left reaches. Skip counts are accumulated into ``skipped``, the first skipped
    document of each reason into ``examples``."""
    reader = DocReader(spec, on_invalid=on_invalid)
    budget = max_bytes
    try:
        for doc in reader.read(plan(spec.resolve(), 1, 0)):
            if budget is not None:
                if budget <= 0:
                    return
                if isinstance(doc, BigDoc):
                    doc = doc.first(budget)
            texts = (
                [doc] if isinstance(doc, str) else (doc.pieces() if reader.scan_big(doc) else [])
            )
            for t in texts:
                if budget is not None:
                    if budget <= 0:
                        return
                    t = t[:budget]
                    budget -= len(t.encode("utf-8"))
                yield t
    finally:
        if skipped is not None:
            for k, v in reader.skipped.items():
                skipped[k] = skipped.get(k, 0) + v
        if examples is not None:
            for k, v in reader.examples.items():
                examples.setdefault(k, v)


def add_reader_arguments(ap: argparse.ArgumentParser) -> None:
    """--format, --text-field, --doc-split: the reading options of ``data.sources`` (default
    and help from ``pipeline.config.schema``), for the tokenizer and tokenize commands."""
    mirror_argument(ap, "--format", SourceConfig, "format")
    mirror_argument(ap, "--text-field", SourceConfig, "text_field")
    mirror_argument(ap, "--doc-split", SourceConfig, "doc_split")
