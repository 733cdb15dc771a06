"""Input sources: expanding inputs, splitting work among shard jobs, big documents.

What files an input names (:func:`expand_paths`, the one expander: the config check
``pipeline.config.files.expand_sources``, the tokenizer and the tokenize stage all use it): a file is
taken as it is (a dotfile too); a directory is walked recursively, skipping hidden files and
hidden directories (a name starting with ``.``, as a glob's ``*`` does); a glob's matching files;
``<stdlib>`` at the start means Python's standard library directory, ``~`` the home directory.
Directory and glob matches are sorted. A directory that ``datasets``' ``save_to_disk`` wrote
(``state.json`` + ``dataset_info.json``) names its Arrow files, in the order it lists them.

Work is split among K shard jobs by byte range over the concatenation of all sources (in the
order given, each glob's matches sorted): a document belongs to the shard whose range holds its
first byte (uncompressed txt/jsonl), a Parquet row group to the shard holding its first page,
and a compressed or one-document-per-file source to the shard holding its first byte. So each
job reads only its slice and the assignment depends only on the inputs and K.

Memory: documents larger than ``BIG_DOC_BYTES`` (whole-file documents, blank-line blocks) are
never held whole: they are validated in one streaming pass and encoded in pieces cut at points
where the byte-level pre-tokenizer splits anyway (see :meth:`BigDoc.pieces`). A single JSONL line,
Parquet value or text line is held in memory whole. Reading the documents of each format is
:mod:`pipeline.text.readers`.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import gzip
import io
import os
import re
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from pipeline.errors import PipelineError

BIG_DOC_BYTES = 32 << 20  # above this a document is streamed in pieces, never held whole
PIECE_CHARS = 4 << 20  # target size of one encoded piece of a big document
READ_CHUNK = 4 << 20

# The same value sets as pipeline.config.schema's SourceFormat (less "auto") and DocSplit; this
# module sits below pipeline.config.schema, so tests/test_config.py checks that they agree.
FORMATS = ("txt", "jsonl", "parquet", "arrow")
DOC_SPLITS = ("file", "blank-line")
_EXT_FORMAT = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
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


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def datasets_files(folder: str) -> list[str] | None:
    """The Arrow files of a folder that ``datasets.Dataset.save_to_disk`` wrote (its
    ``state.json`` lists them, in order), or None when ``folder`` is not one."""
    import json

    state = Path(folder) / "state.json"
    if not (state.is_file() and (Path(folder) / "dataset_info.json").is_file()):
        return None
    try:
        files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise PipelineError(f"{state}: not a datasets state file ({e}): save the dataset again") from e
    out = []
    for name in files:
        p = Path(folder) / name
        if not isinstance(name, str) or p.parent != Path(folder) or not p.is_file():
            raise PipelineError(f"{state} lists {name!r}, which is not a file of {folder}")
        out.append(str(p))
    return out


def expand_paths(pattern: str) -> list[str]:
    """The files one input names (see the module docstring); empty when it names none."""
    expanded = expand_input(pattern)
    if os.path.isdir(expanded):
        saved = datasets_files(expanded)
        if saved is not None:  # a local `datasets` directory: its Arrow files, in its order
            return saved
        root = Path(expanded)
        return sorted(
            str(p) for p in root.rglob("*") if p.is_file() and not _hidden(p.relative_to(root))
        )
    if glob.has_magic(expanded):
        return sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    return [expanded] if os.path.isfile(expanded) else []


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
        """Build and check a spec (raises PipelineError on unknown options). ``fmt`` None or
        ``auto``: by extension."""
        fmt = None if fmt == "auto" else fmt
        if fmt is not None and fmt not in FORMATS:
            raise PipelineError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
        if doc_split not in DOC_SPLITS:
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
            matches = expand_paths(pat)
            if not matches:
                expanded = expand_input(pat)
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


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a corrupt, truncated or unreadable input raises: OS errors, a gzip stream
    cut short, zstd and Arrow/Parquet decoding errors (imported only when one is caught)."""
    import zlib

    errs: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    try:
        import zstandard

        errs.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover - zstandard is a dependency
        pass
    try:
        import pyarrow

        errs.append(pyarrow.ArrowException)
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        pass
    return tuple(errs)


def unreadable(path: str, err: BaseException) -> PipelineError | None:
    """The user-facing error for ``err`` raised while reading input ``path``, or None when
    ``err`` is not a read error (a bug, or already a :class:`PipelineError`)."""
    if isinstance(err, PipelineError) or not isinstance(err, _read_errors()):
        return None
    what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return PipelineError(
        f"input {path} cannot be read ({what}): the file is corrupt, truncated, not in the "
        "format its name says, or not readable; fix or replace it, or leave it out of --input"
    )


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """Turn a read error inside the block into a :class:`PipelineError` naming ``path``."""
    try:
        yield
    except Exception as err:
        mapped = unreadable(path, err)
        if mapped is None:
            raise
        raise mapped from err


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
    #: The range ends where a byte budget stops reading, not where the document ends: a
    #: character cut there is dropped, not counted as invalid UTF-8.
    head: bool = False

    def first(self, n: int) -> BigDoc:
        """The document's first ``n`` bytes (all that a budget of ``n`` reads, so all that
        need be checked: a small ``.gz`` may inflate to gigabytes)."""
        end = self.start + n if self.end is None else min(self.end, self.start + n)
        return self if end == self.end else replace(self, end=end, head=True)

    def chunks(self, size: int = READ_CHUNK) -> Iterator[bytes]:
        """The raw bytes of the document, in chunks (a read error names the file)."""
        with reading(self.path):
            yield from self._chunks(size)

    def _chunks(self, size: int) -> Iterator[bytes]:
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
            dec.decode(b"", final=not self.head)
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
        carry += dec.decode(b"", final=not self.head)
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
            with reading(s.path):
                offsets = _row_group_offsets(s.path)
            groups = tuple(g for g, off in enumerate(offsets) if lo <= s_lo + off < hi)
            if groups:
                tasks.append(Task(s, row_groups=groups))
        elif lo <= s_lo < hi:
            tasks.append(Task(s))
    return tasks
