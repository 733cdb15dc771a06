"""Tokenize stage: shard jobs + gather, round trips, sharding invariants, bad input."""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import pipeline.text.sources as sources_mod
import pipeline.tokenize.shard as shard_mod
from pipeline.errors import PipelineError
from pipeline.text.tokenizer import load_tokenizer, train_tokenizer
from pipeline.tokenize import SourceSpec, gather, shard_path, stats_path, tokenize_shard
from tests.conftest import REPO
from tests.conftest import require_corpora as corpora

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    texts = [p.read_text("utf-8") for p in sorted(STDLIB.glob("json/*.py"))]
    texts += ["First Citizen:\nBefore we proceed any further, hear me speak.", "Ünïcödé 日本語 🙂"]
    return train_tokenizer(
        texts, 600, tmp_path_factory.mktemp("tok") / "tokenizer", bos_token="<|bos|>"
    )


def run_all(spec: SourceSpec, tok: Path, out: Path, shards: int, seq_len: int, **kw) -> dict:
    for i in range(shards):
        tokenize_shard(
            spec, tok, seq_len=seq_len, shards=shards, shard=i, out=out, progress=False, **kw
        )
    return gather(out, shards, tok)


def split_stream(out: Path, split: str, shards: int) -> tuple[np.ndarray, list[int], np.ndarray]:
    """All ids of a split in order (rows of every shard, then that shard's tail), the absolute
    positions of the doc_starts recorded in the rows, and a mask of positions stored in rows."""
    parts, starts, pos, stored = [], [], 0, []
    for i in range(shards):
        with pa.memory_map(str(shard_path(out, split, i))) as mm:
            table = pa.ipc.open_stream(mm).read_all()
        seq_len = table.schema.field("input_ids").type.list_size
        rows = np.asarray(table.column("input_ids").combine_chunks().values).reshape(-1, seq_len)
        for r, ds in enumerate(table.column("doc_starts").to_pylist()):
            starts += [pos + r * seq_len + d for d in ds]
        parts.append(rows.reshape(-1))
        stored.append(np.ones(rows.size, bool))
        pos += rows.size
        tail = json.loads(stats_path(out, i).read_text())["splits"][split]["tail_ids"]
        parts.append(np.asarray(tail, dtype=np.int32))
        stored.append(np.zeros(len(tail), bool))
        pos += len(tail)
    return np.concatenate(parts), starts, np.concatenate(stored)


def decode_docs(tok_dir: Path, ids: np.ndarray, eos: int, bos: int | None = None) -> list[str]:
    tok = load_tokenizer(tok_dir)
    cuts = np.flatnonzero(ids == eos)
    assert len(ids) == 0 or cuts[-1] == len(ids) - 1, "the stream must end with EOS"
    docs, prev = [], 0
    for c in cuts:
        d = ids[prev:c].tolist()
        if bos is not None:
            assert d[0] == bos
            d = d[1:]
        docs.append(tok.decode(d, skip_special_tokens=False))
        prev = c + 1
    return docs


def is_val(text: str, frac: float) -> bool:
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") < frac * 2**64


def blank_line_blocks(text: str) -> list[str]:
    """Reference implementation of the documented blank-line normalisation."""
    blocks, cur = [], []
    for line in text.splitlines(keepends=True):
        if line.strip():
            cur.append(line)
        elif cur:
            blocks.append("".join(cur))
            cur = []
    if cur:
        blocks.append("".join(cur))
    return [re.sub(r"\r?\n\Z", "", b) for b in blocks]


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


def test_round_trip_real_corpora_blank_lines(tok_dir: Path, tmp_path: Path) -> None:
    root = corpora()
    files = sorted(root.glob("*.txt"))
    expected = [b for f in files for b in blank_line_blocks(f.read_text("utf-8"))]
    spec = SourceSpec.from_args([str(root / "*.txt")], doc_split="blank-line")
    # 7 shards: byte-range boundaries land inside blocks; each block must still appear once.
    m = run_all(spec, tok_dir, tmp_path, 7, 96, val_fraction=0.05)
    eos = m["tokenizer"]["eos_id"]
    for split in ("train", "validation"):
        ids, starts, in_rows = split_stream(tmp_path, split, 7)
        want = [d for d in expected if is_val(d, 0.05) == (split == "validation")]
        got = decode_docs(tok_dir, ids, eos)
        assert got == want
        # doc_starts mark exactly the first token of every document that begins inside a row.
        boundaries = [0, *(np.flatnonzero(ids == eos)[:-1] + 1).tolist()]
        assert starts == [b for b in boundaries if in_rows[b]]
        assert int(in_rows.sum()) == m["splits"][split]["tokens"]
        assert m["splits"][split]["documents"] == len(want)
        assert m["splits"][split]["tokens"] + m["splits"][split]["tail_tokens"] == len(ids)
    assert m["splits"]["validation"]["documents"] > 0
    assert m["sources"] == [{"path": str(f), "bytes": f.stat().st_size} for f in files]


def test_validation_split_does_not_depend_on_shard_count(tok_dir: Path, tmp_path: Path) -> None:
    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py"), str(STDLIB / "email" / "*.py")])
    streams = []
    for k in (1, 3):
        m = run_all(spec, tok_dir, tmp_path / f"k{k}", k, 32, val_fraction=0.2)
        assert m["splits"]["validation"]["documents"] > 0
        ids, _, _ = split_stream(tmp_path / f"k{k}", "validation", k)
        streams.append(ids)
    np.testing.assert_array_equal(streams[0], streams[1])


def _write_mixed(tmp: Path) -> tuple[list[Path], list[str]]:
    """Documents in every supported container; returns the files and their documents in order."""
    import pyarrow.parquet as pq
    import zstandard

    docs = [
        f"doc {i}: naïve café — 日本語 {'x' * (i % 7)} 🙂\n  indented\r\nend" for i in range(40)
    ]
    a = tmp / "a.jsonl.gz"
    with gzip.open(a, "wt", encoding="utf-8") as f:
        for d in docs[:10]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    b = tmp / "b.parquet"
    pq.write_table(pa.table({"text": docs[10:20], "n": list(range(10))}), b, row_group_size=3)
    c = tmp / "c.txt.zst"
    c.write_bytes(zstandard.ZstdCompressor().compress("\n\n\n".join(docs[20:30]).encode()))
    d = tmp / "d.jsonl"
    d.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[30:40]), encoding="utf-8")
    return [a, b, c, d], docs


def test_round_trip_all_formats_and_compressions(tok_dir: Path, tmp_path: Path) -> None:
    files, docs = _write_mixed(tmp_path)
    spec = SourceSpec.from_args([str(f) for f in files], doc_split="blank-line")
    # blank-line splitting of c.txt.zst turns its "\r\n"-free blocks into the original docs
    m = run_all(spec, tok_dir, tmp_path / "out", 3, 16, val_fraction=0.0, bos=True)
    assert m["tokenizer"]["bos_id"] is not None
    ids, _, _ = split_stream(tmp_path / "out", "train", 3)
    got = decode_docs(tok_dir, ids, m["tokenizer"]["eos_id"], m["tokenizer"]["bos_id"])
    assert got == docs
    assert m["splits"]["validation"]["documents"] == 0


def test_big_document_is_streamed_in_exact_pieces(
    tok_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    text = "".join(p.read_text("utf-8") for p in sorted(STDLIB.glob("json/*.py")))
    text = text * 3 + "\n" + "word " * 2000  # long runs with only spaces as cut points too
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    (tmp_path / "small.txt").write_text("a small document", encoding="utf-8")
    spec = SourceSpec.from_args([str(tmp_path / "*.txt")])
    whole = run_all(spec, tok_dir, tmp_path / "whole", 1, 64, val_fraction=0.0)
    monkeypatch.setattr(sources_mod, "BIG_DOC_BYTES", 4096)
    monkeypatch.setattr(sources_mod, "PIECE_CHARS", 1000)
    cut = list(sources_mod.BigDoc(str(tmp_path / "big.txt"), None, 0, None).pieces())
    assert len(cut) > 20 and "".join(cut) == text  # really encoded piecewise
    spec = SourceSpec.from_args([str(tmp_path / "*.txt")])
    pieces = run_all(spec, tok_dir, tmp_path / "pieces", 1, 64, val_fraction=0.0)
    assert pieces["splits"]["train"]["documents"] == 2
    assert [s["sha256"] for s in pieces["splits"]["train"]["shards"]] == [
        s["sha256"] for s in whole["splits"]["train"]["shards"]
    ]
    ids, _, _ = split_stream(tmp_path / "pieces", "train", 1)
    assert decode_docs(tok_dir, ids, pieces["tokenizer"]["eos_id"]) == [text, "a small document"]


def test_fast_and_hf_encoders_write_identical_shards(tok_dir: Path, tmp_path: Path) -> None:
    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py"), str(STDLIB / "email" / "*.py")])
    a = run_all(spec, tok_dir, tmp_path / "fast", 2, 64, fast=True)
    b = run_all(spec, tok_dir, tmp_path / "hf", 2, 64, fast=False)
    assert a["encoders"] == ["tiktoken"] and b["encoders"] == ["hf"]
    assert a["splits"] == b["splits"]


# ---------------------------------------------------------------------------------------------
# Reading by other tools, reruns
# ---------------------------------------------------------------------------------------------


def test_datasets_reads_a_shard(tok_dir: Path, tmp_path: Path) -> None:
    import datasets

    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py")])
    m = run_all(spec, tok_dir, tmp_path, 1, 32, val_fraction=0.0)
    ds = datasets.Dataset.from_file(str(shard_path(tmp_path, "train", 0)))
    assert len(ds) == m["splits"]["train"]["sequences"] > 10
    ids, _, _ = split_stream(tmp_path, "train", 1)
    np.testing.assert_array_equal(np.asarray(ds[3]["input_ids"]), ids[3 * 32 : 4 * 32])
    assert ds[0]["doc_starts"][0] == 0


def test_complete_shard_is_skipped_and_tampered_one_redone(
    tok_dir: Path, tmp_path: Path, capsys
) -> None:
    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py")])
    kw = dict(seq_len=32, shards=2, out=tmp_path, progress=False)
    first = tokenize_shard(spec, tok_dir, shard=0, **kw)
    p = shard_path(tmp_path, "train", 0)
    mtime = p.stat().st_mtime_ns
    again = tokenize_shard(spec, tok_dir, shard=0, **kw)
    assert "already complete" in capsys.readouterr().err
    assert again == first and p.stat().st_mtime_ns == mtime
    data = bytearray(p.read_bytes())
    data[-100] ^= 0xFF
    p.write_bytes(bytes(data))
    redone = tokenize_shard(spec, tok_dir, shard=0, **kw)
    assert "already complete" not in capsys.readouterr().err
    assert redone["splits"]["train"]["sha256"] == first["splits"]["train"]["sha256"]
    assert hashlib.sha256(p.read_bytes()).hexdigest() == first["splits"]["train"]["sha256"]
    # Other options are other work: not skipped.
    other = tokenize_shard(spec, tok_dir, shard=0, **{**kw, "seq_len": 16})
    assert other["options"]["seq_len"] == 16


def test_gather_refuses_missing_shards_and_other_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py")])
    tokenize_shard(spec, tok_dir, seq_len=32, shards=2, shard=0, out=tmp_path, progress=False)
    with pytest.raises(PipelineError, match=r"shard\(s\) 1 of 2 are not complete"):
        gather(tmp_path, 2, tok_dir)
    tokenize_shard(spec, tok_dir, seq_len=32, shards=2, shard=1, out=tmp_path, progress=False)
    other = train_tokenizer(["some other text " * 50], 300, tmp_path / "other")
    with pytest.raises(PipelineError, match="not the one the shards were made with"):
        gather(tmp_path, 2, other)
    with pytest.warns(RuntimeWarning, match="validation split has no full sequence"):
        m = gather(tmp_path, 2, tok_dir)  # 1% of 4 files: no validation document
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == m and m["tokenizer"]["path"] == os.path.relpath(tok_dir, tmp_path)
    assert not list(tmp_path.glob("manifest.json.tmp*"))


# ---------------------------------------------------------------------------------------------
# Bad input: each a test
# ---------------------------------------------------------------------------------------------


def test_invalid_utf8_is_skipped_and_counted_or_fails(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "good.txt").write_text("good text " * 20)
    (tmp_path / "in" / "bad.txt").write_bytes(b"caf\xe9 latin-1 text " * 20)
    spec = SourceSpec.from_args([str(tmp_path / "in" / "*.txt")])
    m = run_all(spec, tok_dir, tmp_path / "o1", 1, 8, val_fraction=0.0)
    assert m["skipped"] == {"invalid_utf8": 1}
    assert m["splits"]["train"]["documents"] == 1
    with pytest.raises(PipelineError, match=r"bad\.txt.*invalid UTF-8"):
        tokenize_shard(
            spec,
            tok_dir,
            seq_len=8,
            shards=1,
            shard=0,
            out=tmp_path / "o2",
            on_invalid="fail",
            progress=False,
        )
    assert not list((tmp_path / "o2").rglob("*.arrow*"))  # nothing partial left behind


def test_empty_files_are_counted_and_an_all_empty_corpus_fails(
    tok_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.txt").write_text("  \n\n \t\n")
    (tmp_path / "x.txt").write_text("real text " * 10)
    spec = SourceSpec.from_args([str(tmp_path / "*.txt")])
    m = run_all(spec, tok_dir, tmp_path / "o1", 1, 8, val_fraction=0.0)
    assert m["skipped"] == {"empty": 2} and m["splits"]["train"]["documents"] == 1
    only_empty = SourceSpec.from_args([str(tmp_path / "e*.txt")])
    with pytest.raises(PipelineError, match="no usable documents"):
        tokenize_shard(
            only_empty, tok_dir, seq_len=8, shards=1, shard=0, out=tmp_path / "o2", progress=False
        )
    # With several shards no single job can tell; the gather step says it.
    only_empty = SourceSpec.from_args([str(tmp_path / "e*.txt")])
    with pytest.raises(PipelineError, match="no usable training documents"):
        run_all(only_empty, tok_dir, tmp_path / "o3", 2, 8)


def test_glob_matching_nothing_names_it(tok_dir: Path, tmp_path: Path) -> None:
    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py"), str(tmp_path / "missing-*.jsonl")])
    with pytest.raises(PipelineError, match=r"missing-\*\.jsonl.*matches no file"):
        tokenize_shard(spec, tok_dir, seq_len=8, shards=1, shard=0, out=tmp_path, progress=False)


def test_jsonl_bad_line_names_file_and_line_or_is_counted(tok_dir: Path, tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"line {i} text"}) for i in range(6)]
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text("\n".join([*lines[:3], "{not json", *lines[3:]]) + "\n")
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text("\n".join([*lines[:4], json.dumps({"body": "x"}), *lines[4:]]) + "\n")
    kw = dict(seq_len=8, shards=1, shard=0, progress=False)
    with pytest.raises(PipelineError, match=r"bad\.jsonl:4: not valid JSON"):
        tokenize_shard(SourceSpec.from_args([str(bad_json)]), tok_dir, out=tmp_path / "o1", **kw)
    with pytest.raises(PipelineError, match=r"nofield\.jsonl:5: no field 'text'"):
        tokenize_shard(SourceSpec.from_args([str(no_field)]), tok_dir, out=tmp_path / "o2", **kw)
    spec = SourceSpec.from_args([str(bad_json), str(no_field)])
    st = tokenize_shard(
        spec, tok_dir, out=tmp_path / "o3", on_invalid="skip", val_fraction=0.0, **kw
    )
    assert st["skipped"] == {"invalid_json": 1, "missing_field": 1}
    assert st["splits"]["train"]["documents"] == 12


def test_parquet_without_the_column(tok_dir: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "x.parquet")
    spec = SourceSpec.from_args([str(tmp_path / "x.parquet")])
    with pytest.raises(
        PipelineError, match=r"x\.parquet: Parquet file has no column 'text' \(columns: content\)"
    ):
        tokenize_shard(
            spec, tok_dir, seq_len=8, shards=1, shard=0, out=tmp_path / "o", progress=False
        )


def test_missing_tokenizer_dir_and_bad_seq_len(tok_dir: Path, tmp_path: Path) -> None:
    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py")])
    with pytest.raises(PipelineError, match=r"tokenizer .*nope does not exist"):
        tokenize_shard(
            spec, tmp_path / "nope", seq_len=8, shards=1, shard=0, out=tmp_path, progress=False
        )
    for bad in (1, 0, -5):
        with pytest.raises(PipelineError, match=f"--seq-len {bad} must be at least 2"):
            tokenize_shard(
                spec, tok_dir, seq_len=bad, shards=1, shard=0, out=tmp_path, progress=False
            )


def test_disk_full_removes_the_partial_file(tok_dir: Path, tmp_path: Path, monkeypatch) -> None:
    class FullDisk:
        """A real file that runs out of space after a few kilobytes (ENOSPC)."""

        def __init__(self, path: Path) -> None:
            self.f = open(path, "wb")  # noqa: SIM115
            self.written = 0
            self.closed = False

        def write(self, b) -> int:
            if self.written + len(b) > 20_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(b)
            return self.f.write(b)

        def flush(self) -> None:
            self.f.flush()

        def fileno(self) -> int:
            return self.f.fileno()

        def close(self) -> None:
            self.closed = True
            self.f.close()

    monkeypatch.setattr(shard_mod, "_open_sink", FullDisk)
    monkeypatch.setattr(shard_mod, "FLUSH_TOKENS", 2048)  # write early, like a big corpus would
    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py")])
    with pytest.raises(
        PipelineError,
        match=r"disk full while writing .*shard-00000\.arrow.*partial file .* was removed",
    ):
        tokenize_shard(spec, tok_dir, seq_len=32, shards=1, shard=0, out=tmp_path, progress=False)
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []


def test_out_must_be_a_data_directory_and_a_failed_shard_leaves_no_folder(
    tok_dir: Path, tmp_path: Path
) -> None:
    spec = SourceSpec.from_args([str(STDLIB / "json" / "__init__.py")])
    kw = dict(seq_len=8, shards=1, shard=0, progress=False)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PipelineError, match=r"is not a data directory \(it holds notes\.txt\)"):
        tokenize_shard(spec, tok_dir, out=tmp_path, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    bad = tmp_path / "bad.txt.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(PipelineError, match=r"bad\.txt\.gz cannot be read"):
        tokenize_shard(SourceSpec.from_args([str(bad)]), tok_dir, out=tmp_path / "o", **kw)
    assert not (tmp_path / "o").exists()


def test_a_corrupt_stats_file_is_redone_by_the_shard_and_refused_by_gather(
    tok_dir: Path, tmp_path: Path
) -> None:
    spec = SourceSpec.from_args([str(STDLIB / "json" / "*.py")])
    kw = dict(seq_len=32, shards=1, shard=0, out=tmp_path, val_fraction=0.0, progress=False)
    tokenize_shard(spec, tok_dir, **kw)
    sp = stats_path(tmp_path, 0)
    good = sp.read_text()
    sp.write_text(good[: len(good) // 2])
    with pytest.raises(PipelineError, match=r"shard-00000\.stats\.json.*rerun shard job 0"):
        gather(tmp_path, 1, tok_dir)
    again = tokenize_shard(spec, tok_dir, **kw)  # not "complete": redone
    assert json.loads(sp.read_text())["splits"] == json.loads(json.dumps(again["splits"]))
    gather(tmp_path, 1, tok_dir)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.tokenize", *args], capture_output=True, text=True, cwd=REPO
    )


def test_cli_shard_gather_and_errors(tok_dir: Path, tmp_path: Path) -> None:
    assert _cli("--help").returncode == 0
    r = _cli("shard", "--help")
    assert r.returncode == 0 and "--doc-split" in r.stdout
    common = [
        "--input",
        "<stdlib>/json/*.py",
        "--tokenizer",
        str(tok_dir),
        "--out",
        str(tmp_path),
        "--shards",
        "2",
    ]
    for i in ("0", "1"):
        r = _cli("shard", *common, "--seq-len", "64", "--shard", i, "--no-progress")
        assert r.returncode == 0, r.stderr
    r = _cli("gather", "--out", str(tmp_path), "--shards", "2", "--tokenizer", str(tok_dir))
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["seq_len"] == 64 and len(m["splits"]["train"]["shards"]) == 2
    assert all(s["path"].startswith(sysconfig.get_paths()["stdlib"]) for s in m["sources"])
    r = _cli(*common, "--seq-len", "1", "--shard", "0")  # no subcommand = shard
    assert r.returncode == 2 and "error: --seq-len 1: must be at least 2 (config: data.seq_len)" in r.stderr
    r = _cli(
        "shard",
        *common[:2],
        "--tokenizer",
        str(tmp_path / "nope"),
        "--out",
        str(tmp_path),
        "--seq-len",
        "8",
    )
    assert r.returncode == 2 and "nope does not exist" in r.stderr
