"""Input sources: expanding inputs, splitting work among shard jobs, reading documents.

Documents and their normalisation (what a round trip gives back):

* ``txt`` with ``--doc-split file`` (default): the whole file, decoded as strict UTF-8, byte for
  byte (no newline translation, no stripping). A whitespace-only file is skipped as ``empty``.
* ``txt`` with ``--doc-split blank-line``: blocks of consecutive non-blank lines (a blank line is
  empty or whitespace-only); a block keeps its internal line breaks; the line terminator of its
  last line (``\\n`` or ``\\r\\n``) is removed.
* ``jsonl``: the string value of the text field of each line; blank lines are ignored; a null or
  whitespace-only value is skipped as ``empty``.
* ``parquet``: each non-null, non-blank value of the text column (string or UTF-8 binary).
* ``.gz`` / ``.zst`` variants of each are decompressed on the fly.

Work is split among K shard jobs by byte range over the concatenation of all sources (in the
order given, each glob's matches sorted): a document belongs to the shard whose range holds its
first byte (uncompressed txt/jsonl), a Parquet row group to the shard holding its first page,
and a compressed or one-document-per-file source to the shard holding its first byte. So each
job reads only its slice and the assignment depends only on the inputs and K.

Memory: documents larger than ``BIG_DOC_BYTES`` (whole-file documents, blank-line blocks) are
never held whole: they are validated in one streaming pass and encoded in pieces cut at points
where the byte-level pre-tokenizer splits anyway (see :meth:`BigDoc.pieces`). A single JSONL line,
Parquet value or text line is held in memory whole.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import os
import re
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from pipeline.errors import PipelineError

BIG_DOC_BYTES = 32 << 20  # above this a document is streamed in pieces, never held whole
PIECE_CHARS = 4 << 20  # target size of one encoded piece of a big document
_READ_CHUNK = 4 << 20

FORMATS = ("txt", "jsonl", "parquet")
_EXT_FORMAT = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_COMPRESSED = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}


@dataclass(frozen=True)
class Source:
    """One input file."""

    path: str
    bytes: int  # on-disk size (compressed size for compressed files)
    fmt: str
    compression: str | None

    @property
    def splittable(self) -> bool:
        """Can a byte range of this file be read on its own (seekable, line-based format)?"""
        return self.compression is None and self.fmt in ("txt", "jsonl")


def _detect(path: str, fmt: str | None) -> tuple[str, str | None]:
    p = Path(path)
    suffixes = [s.lower() for s in p.suffixes]
    comp = _COMPRESSED.get(suffixes[-1]) if suffixes else None
    inner = (
        suffixes[-2]
        if comp and len(suffixes) >= 2
        else (suffixes[-1] if suffixes and not comp else "")
    )
    return fmt or _EXT_FORMAT.get(inner, "txt"), comp


def expand_input(pattern: str) -> str:
    """``<stdlib>`` at the start of a path means Python's standard library directory."""
    if pattern.startswith("<stdlib>"):
        return sysconfig.get_paths()["stdlib"] + pattern[len("<stdlib>") :]
    return os.path.expanduser(pattern)


@dataclass
class SourceSpec:
    """What to read and how: input patterns plus format options."""

    inputs: list[str]
    fmt: str | None = None  # None: by extension
    text_field: str = "text"
    doc_split: str = "file"  # txt only: "file" or "blank-line"
    _resolved: list[Source] | None = field(default=None, repr=False)

    @classmethod
    def from_args(
        cls,
        inputs: Sequence[str],
        *,
        fmt: str | None = None,
        text_field: str = "text",
        doc_split: str = "file",
    ) -> SourceSpec:
        """Build and check a spec (raises PipelineError on unknown options)."""
        if fmt is not None and fmt not in FORMATS:
            raise PipelineError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
        if doc_split not in ("file", "blank-line"):
            raise PipelineError(f"--doc-split {doc_split!r} must be 'file' or 'blank-line'")
        if not inputs:
            raise PipelineError("no --input given: name files, directories or globs to read")
        return cls(list(inputs), fmt, text_field, doc_split)

    def resolve(self) -> list[Source]:
        """Expand patterns into files (deterministic order); error naming a pattern that
        matches nothing."""
        if self._resolved is not None:
            return self._resolved
        seen: set[str] = set()
        out: list[Source] = []
        for pat in self.inputs:
            expanded = expand_input(pat)
            if os.path.isdir(expanded):
                matches = sorted(
                    str(p)
                    for p in Path(expanded).rglob("*")
                    if p.is_file() and not p.name.startswith(".")
                )
            elif glob.has_magic(expanded):
                matches = sorted(
                    p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p)
                )
            else:
                matches = [expanded] if os.path.isfile(expanded) else []
            if not matches:
                raise PipelineError(
                    f"input {pat!r} matches no file"
                    + (f" (expanded to {expanded!r})" if expanded != pat else "")
                    + ": check the path or glob (globs need quoting in the shell; ** needs a /)"
                )
            for m in matches:
                m = os.path.abspath(m)
                if m in seen:
                    continue
                seen.add(m)
                fmt, comp = _detect(m, self.fmt)
                out.append(Source(m, os.path.getsize(m), fmt, comp))
        self._resolved = out
        return out

    def options(self) -> dict:
        """The options that determine what documents are read (recorded in stats/manifest)."""
        return {"format": self.fmt, "text_field": self.text_field, "doc_split": self.doc_split}


# ---------------------------------------------------------------------------------------------
# Opening files
# ---------------------------------------------------------------------------------------------


def open_binary(path: str, compression: str | None) -> BinaryIO:
    """A buffered binary reader of the (decompressed) content."""
    if compression == "gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if compression == "zst":
        import zstandard

        raw = open(path, "rb")  # noqa: SIM115 - closed with the wrapper
        return io.BufferedReader(
            zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), 1 << 20
        )  # type: ignore[arg-type]
    return open(path, "rb")


def _line_number(src: Source, offset: int) -> int:
    """1-based line number of the line starting at byte ``offset`` (computed only for errors)."""
    n = 1
    remaining = offset
    with open_binary(src.path, src.compression) as f:
        while remaining > 0:
            buf = f.read(min(_READ_CHUNK, remaining))
            if not buf:
                break
            n += buf.count(b"\n")
            remaining -= len(buf)
    return n


# ---------------------------------------------------------------------------------------------
# Big documents
# ---------------------------------------------------------------------------------------------

# Cut points for big documents: where GPT-2-style split patterns always split. No pre-token of
# those patterns contains a newline followed by a non-space, nor a non-space followed by
# " " + non-space (the space starts the next pre-token).
_CUT_NEWLINE = re.compile(r"\n(?=\S)")
_CUT_SPACE = re.compile(r"(?<=\S)(?= \S)")


@dataclass(frozen=True)
class BigDoc:
    """A document too big to hold: a byte range of a (decompressed) file, read when needed."""

    path: str
    compression: str | None
    start: int
    end: int | None  # None: to the end of the file

    def chunks(self, size: int = _READ_CHUNK) -> Iterator[bytes]:
        """The raw bytes of the document, in chunks."""
        with open_binary(self.path, self.compression) as f:
            if self.compression is None:
                f.seek(self.start)
            else:  # not seekable: decompress and drop the prefix
                left = self.start
                while left > 0:
                    got = f.read(min(size, left))
                    if not got:
                        return
                    left -= len(got)
            left = None if self.end is None else self.end - self.start
            while left is None or left > 0:
                buf = f.read(size if left is None else min(size, left))
                if not buf:
                    return
                if left is not None:
                    left -= len(buf)
                yield buf

    def scan(self) -> tuple[bool, bytes, int, bool]:
        """One streaming pass: (valid UTF-8, blake2b-64 digest of the bytes, byte count,
        has non-whitespace)."""
        import hashlib

        dec = codecs.getincrementaldecoder("utf-8")("strict")
        h = hashlib.blake2b(digest_size=8)
        n = 0
        nonblank = False
        try:
            for c in self.chunks():
                h.update(c)
                n += len(c)
                s = dec.decode(c)
                nonblank = nonblank or bool(s.strip())
            dec.decode(b"", final=True)
        except UnicodeDecodeError:
            return False, h.digest(), n, nonblank
        return True, h.digest(), n, nonblank

    def pieces(self, piece_chars: int | None = None) -> Iterator[str]:
        """The text in pieces of about ``piece_chars`` (default ``PIECE_CHARS``) characters, cut
        where the pre-tokenizer splits anyway, so encoding the pieces one by one gives the ids
        of the whole."""
        piece_chars = piece_chars or PIECE_CHARS
        dec = codecs.getincrementaldecoder("utf-8")("strict")
        carry = ""
        for c in self.chunks():
            carry += dec.decode(c)
            while len(carry) >= 2 * piece_chars:
                cut = _find_cut(carry, piece_chars)
                yield carry[:cut]
                carry = carry[cut:]
        carry += dec.decode(b"", final=True)
        if carry:
            yield carry


def _find_cut(text: str, target: int) -> int:
    """A cut index near ``target`` (at most 2×target) where a split is exact."""
    window = text[target : 2 * target]
    for pat in (_CUT_NEWLINE, _CUT_SPACE):
        m = pat.search(window)
        if m:
            # _CUT_NEWLINE matches the newline: cut after it; _CUT_SPACE is zero-width.
            return target + m.end()
    # No safe point in a whole window (e.g. megabytes without spaces or newlines): cut anyway.
    import warnings

    warnings.warn(
        "a big document has no newline or space in a whole piece; cutting it mid-token "
        "(tokenization may differ slightly at the cut)",
        RuntimeWarning,
        stacklevel=3,
    )
    return 2 * target


# ---------------------------------------------------------------------------------------------
# Planning: which part of which file a shard reads
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A part of one source for one shard: a byte range [lo, hi) or a list of row groups."""

    source: Source
    lo: int = 0
    hi: float = float("inf")
    row_groups: tuple[int, ...] | None = None


def _row_group_offsets(path: str) -> list[int]:
    import pyarrow.parquet as pq

    md = pq.ParquetFile(path).metadata
    offs = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        starts = []
        for c in range(rg.num_columns):
            col = rg.column(c)
            starts.append(
                col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
            )
        offs.append(min(starts) if starts else 0)
    return offs


def plan(sources: Sequence[Source], shards: int, shard: int) -> list[Task]:
    """The tasks of shard ``shard`` of ``shards``: deterministic, by byte range."""
    total = sum(s.bytes for s in sources)
    lo = total * shard // shards
    hi: float = total * (shard + 1) // shards if shard < shards - 1 else float("inf")
    tasks: list[Task] = []
    base = 0
    for s in sources:
        s_lo, s_hi = base, base + s.bytes
        base = s_hi
        if s.splittable and s.bytes > 0:
            a, b = max(lo, s_lo), min(hi, s_hi)
            if a < b:
                tasks.append(Task(s, a - s_lo, (b - s_lo) if b < s_hi else float("inf")))
        elif s.fmt == "parquet" and s.bytes > 0:
            if s_hi <= lo or s_lo >= hi:
                continue
            groups = tuple(
                g for g, off in enumerate(_row_group_offsets(s.path)) if lo <= s_lo + off < hi
            )
            if groups:
                tasks.append(Task(s, row_groups=groups))
        elif lo <= s_lo < hi:
            tasks.append(Task(s))
    return tasks


# ---------------------------------------------------------------------------------------------
# Reading documents
# ---------------------------------------------------------------------------------------------


class DocReader:
    """Yields the documents (``str`` or :class:`BigDoc`) of a shard's tasks, counting skips.

    ``on_invalid``: None = defaults (invalid UTF-8 is skipped and counted; a bad JSONL line is an
    error), "skip" = skip and count everything, "fail" = every invalid document is an error.
    """

    def __init__(self, spec: SourceSpec, *, on_invalid: str | None = None) -> None:
        if on_invalid not in (None, "skip", "fail"):
            raise PipelineError(f"--on-invalid {on_invalid!r} must be 'skip' or 'fail'")
        self.spec = spec
        self.on_invalid = on_invalid
        self.skipped: dict[str, int] = {}

    def _skip(self, reason: str, default_skip: bool, message: str) -> None:
        if self.on_invalid == "fail" or (self.on_invalid is None and not default_skip):
            hint = (
                " (or pass --on-invalid skip to skip and count such documents)"
                if self.on_invalid != "skip"
                else ""
            )
            raise PipelineError(message + hint)
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

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
            self.skipped["empty"] = self.skipped.get("empty", 0) + 1
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
            self.skipped["empty"] = self.skipped.get("empty", 0) + 1
            return None
        return digest

    def read(self, tasks: Sequence[Task]) -> Iterator[str | BigDoc]:
        """All documents of ``tasks`` in order."""
        for t in tasks:
            s = t.source
            if s.fmt == "parquet":
                yield from self._parquet(t)
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
            data = f.read(BIG_DOC_BYTES + 1)
        if len(data) > BIG_DOC_BYTES:
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
                    if size > BIG_DOC_BYTES:
                        big, parts = True, []
                    else:
                        parts.append(line)
            if parts is not None:
                count += 1
                yield from self._block(s, start, end, parts, big)
        if count == 0 and t.lo == 0 and t.hi >= s.bytes:
            self.skipped["empty"] = self.skipped.get("empty", 0) + 1  # a file with no text

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
                    self.skipped["empty"] = self.skipped.get("empty", 0) + 1
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
            arr = batch.column(0)
            binary = pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)
            for v in arr.to_pylist():
                if v is None:
                    self.skipped["empty"] = self.skipped.get("empty", 0) + 1
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
                    self.skipped["empty"] = self.skipped.get("empty", 0) + 1
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
) -> Iterator[str]:
    """Every document of ``spec`` as text (big documents as pieces), at most ``max_bytes``
    bytes in all; used to train tokenizers. Skip counts are accumulated into ``skipped``."""
    reader = DocReader(spec, on_invalid=on_invalid)
    budget = max_bytes
    try:
        for doc in reader.read(plan(spec.resolve(), 1, 0)):
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
