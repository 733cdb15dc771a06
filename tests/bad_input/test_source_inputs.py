"""Bad and hostile sources and tokenizers: corrupt compressed or Parquet inputs, lines that are
not JSON, binary files given as text, folders with nothing to read, unreadable files, things
that are not tokenizers. Each is refused by ``python -m pipeline.tokenize shard`` or
``python -m pipeline.tokenize tokenizer ...`` with one line naming the file, no traceback, and nothing
written (the output folder is not even created)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.bad_input.conftest import assert_refused, run, snapshot
from tests.bad_input.tiny_data import build_tokenizer, write_corpus


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    """A tokenizer trained on a tiny corpus (one per module)."""
    root = tmp_path_factory.mktemp("tok")
    return build_tokenizer(root / "tokenizer", write_corpus(root))


def _shard(cwd: Path, tok: Path, *inputs: str, extra: tuple[str, ...] = ()):
    return run(["-m", "pipeline.tokenize", "shard", "--input", *inputs, "--tokenizer", str(tok),
                "--seq-len", "16", "--out", str(cwd / "out"), "--no-progress", *extra], cwd)


def _train(cwd: Path, *inputs: str, extra: tuple[str, ...] = ()):
    return run(["-m", "pipeline.tokenize", "tokenizer", "train", "--input", *inputs, "--vocab-size", "300",
                "--out", str(cwd / "newtok"), *extra], cwd)


def _good(tmp_path: Path) -> Path:
    """A good text file beside the bad one: the bad one alone must stop the job."""
    p = tmp_path / "good.txt"
    p.write_text("some good text to read " * 20)
    return p


# --- corrupt and unreadable sources ----------------------------------------------------------


def test_corrupt_gzip_names_the_file(tmp_path: Path, tok: Path) -> None:
    bad = tmp_path / "bad.txt.gz"
    bad.write_bytes(b"this is not gzip data at all")
    good = _good(tmp_path)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(good), str(bad)), "bad.txt.gz", "cannot be read",
                   before=before, roots=[tmp_path])


def test_truncated_gzip_names_the_file_in_tokenizer_train(tmp_path: Path) -> None:
    bad = tmp_path / "cut.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"text": "hello world"}\n' * 500)[:-40])
    before = snapshot(tmp_path)
    assert_refused(_train(tmp_path, str(bad)), "cut.jsonl.gz", "truncated",
                   before=before, roots=[tmp_path])


def test_corrupt_zstd_names_the_file(tmp_path: Path, tok: Path) -> None:
    bad = tmp_path / "bad.jsonl.zst"
    bad.write_bytes(b"\x00\x01 not a zstd frame " * 10)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(bad)), "bad.jsonl.zst", "cannot be read",
                   before=before, roots=[tmp_path])


def test_corrupt_parquet_names_the_file(tmp_path: Path, tok: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1" + b"garbage" * 50)
    good = _good(tmp_path)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(good), str(bad)), "bad.parquet", "cannot be read",
                   before=before, roots=[tmp_path])


def test_parquet_with_a_damaged_page_names_the_file(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"text": [f"row {i} of text " * 5 for i in range(2000)]}), path,
                   compression="snappy")
    data = bytearray(path.read_bytes())
    for i in range(200, min(len(data) - 200, 4000)):  # inside the first data page
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    assert_refused(_train(tmp_path, str(path)), "damaged.parquet", before=before,
                   roots=[tmp_path])


def test_parquet_without_the_text_column_names_file_and_column(tmp_path: Path, tok: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a b c"] * 10}), tmp_path / "x.parquet")
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(tmp_path / "x.parquet")), "x.parquet",
                   "no column 'text'", "--text-field", before=before, roots=[tmp_path])


def test_jsonl_line_that_is_not_json_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "docs.jsonl"
    p.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": "cut off\n')
    before = snapshot(tmp_path)
    assert_refused(_train(tmp_path, str(p)), "docs.jsonl:3", "not valid JSON",
                   before=before, roots=[tmp_path])


def test_jsonl_line_that_is_not_json_fails_the_shard_with_on_invalid_fail(
        tmp_path: Path, tok: Path) -> None:
    p = tmp_path / "docs.jsonl"
    p.write_text('{"text": "fine"}\nnot json at all\n')
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(p), extra=("--on-invalid", "fail")),
                   "docs.jsonl:2", "not valid JSON", before=before, roots=[tmp_path])


def test_jsonl_without_the_text_field_names_file_line_and_option(
        tmp_path: Path, tok: Path) -> None:
    p = tmp_path / "docs.jsonl"
    p.write_text('{"text": "fine"}\n{"content": "elsewhere"}\n')
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(p), extra=("--on-invalid", "fail")),
                   "docs.jsonl:2", "no field 'text'", "--text-field",
                   before=before, roots=[tmp_path])


def test_jsonl_whose_text_is_not_a_string(tmp_path: Path) -> None:
    p = tmp_path / "docs.jsonl"
    p.write_text('{"text": ["a", "list"]}\n')
    before = snapshot(tmp_path)
    assert_refused(_train(tmp_path, str(p)), "docs.jsonl:1", "not a string",
                   before=before, roots=[tmp_path])


def test_binary_file_given_as_txt_names_it(tmp_path: Path, tok: Path) -> None:
    p = tmp_path / "image.bin"
    p.write_bytes(bytes(range(256)) * 40)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(p), extra=("--format", "txt")),
                   "no usable documents", "image.bin", before=before, roots=[tmp_path])


def test_binary_file_given_as_txt_names_it_in_tokenizer_train(tmp_path: Path) -> None:
    p = tmp_path / "blob.txt"
    p.write_bytes(b"\xff\xfe\x00" * 1000)
    before = snapshot(tmp_path)
    assert_refused(_train(tmp_path, str(p)), "no usable documents", "blob.txt",
                   before=before, roots=[tmp_path])


def test_directory_with_no_readable_file_names_the_input(tmp_path: Path, tok: Path) -> None:
    d = tmp_path / "empty"
    (d / ".hidden").mkdir(parents=True)
    (d / ".hidden" / "x.txt").write_text("hidden files are not read")
    (d / ".dotfile.txt").write_text("neither are dotfiles inside a directory")
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(d)), "empty", "matches no file",
                   before=before, roots=[tmp_path])


def test_unreadable_file_names_it(tmp_path: Path, tok: Path) -> None:
    p = tmp_path / "locked.txt"
    good = _good(tmp_path)
    if os.geteuid() == 0:
        # Permissions do not stop root: a file whose every read fails does (EIO).
        p.symlink_to("/proc/self/mem")
    else:
        p.write_text("secret")
        p.chmod(0)
    before = snapshot(tmp_path) if os.geteuid() == 0 else None
    try:
        res = _shard(tmp_path, tok, str(good), str(p))
    finally:
        if not p.is_symlink():
            p.chmod(0o644)
    assert_refused(res, "locked.txt", "cannot be read", before=before, roots=[tmp_path])
    assert not (tmp_path / "out").exists()


def test_input_glob_matching_nothing_names_it(tmp_path: Path, tok: Path) -> None:
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(tmp_path / "nothing-*.jsonl")),
                   "nothing-*.jsonl", "matches no file", before=before, roots=[tmp_path])


# --- things that are not tokenizers ----------------------------------------------------------


def test_tokenizer_path_that_is_a_text_file(tmp_path: Path) -> None:
    good = _good(tmp_path)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, good, str(good)), "good.txt", "cannot load tokenizer",
                   before=before, roots=[tmp_path])


def test_tokenizer_folder_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tk").mkdir()
    (tmp_path / "tk" / "vocab.txt").write_text("a\nb\n")
    good = _good(tmp_path)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tmp_path / "tk", str(good)), "tk", "no tokenizer.json",
                   before=before, roots=[tmp_path])


def test_tokenizer_json_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "tk").mkdir()
    (tmp_path / "tk" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    good = _good(tmp_path)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tmp_path / "tk", str(good)), "tokenizer.json",
                   before=before, roots=[tmp_path])


def test_tokenizer_json_that_is_not_json_on_import(tmp_path: Path) -> None:
    (tmp_path / "tk").mkdir()
    (tmp_path / "tk" / "tokenizer.json").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.tokenize", "tokenizer", "import", "--path", str(tmp_path / "tk"),
               "--out", str(tmp_path / "imported")], tmp_path)
    assert_refused(res, "tokenizer.json", before=before, roots=[tmp_path])


def _without_eos(tok: Path, dest: Path) -> Path:
    spec = json.loads((tok / "tokenizer.json").read_text())
    spec["added_tokens"] = []
    del spec["model"]["vocab"]["<|endoftext|>"]
    dest.mkdir()
    (dest / "tokenizer.json").write_text(json.dumps(spec))
    return dest


def test_tokenizer_without_eos_is_refused_by_tokenize(tmp_path: Path, tok: Path) -> None:
    tk = _without_eos(tok, tmp_path / "noeos")
    good = _good(tmp_path)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tk, str(good)), "noeos", "no EOS token",
                   before=before, roots=[tmp_path])


def test_tokenizer_without_eos_is_refused_by_import(tmp_path: Path, tok: Path) -> None:
    tk = _without_eos(tok, tmp_path / "noeos")
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.tokenize", "tokenizer", "import", "--path", str(tk / "tokenizer.json"),
               "--out", str(tmp_path / "imported")], tmp_path)
    assert_refused(res, "noeos", "no EOS token", before=before, roots=[tmp_path])


def test_tokenizer_config_that_is_not_an_object(tmp_path: Path, tok: Path) -> None:
    tk = tmp_path / "tk"
    shutil.copytree(tok, tk)
    (tk / "tokenizer_config.json").write_text('["eos_token"]\n')
    good = _good(tmp_path)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tk, str(good)), "tokenizer_config.json", "not an object",
                   before=before, roots=[tmp_path])


def test_bos_asked_of_a_tokenizer_without_one(tmp_path: Path, tok: Path) -> None:
    good = _good(tmp_path)
    before = snapshot(tmp_path)
    assert_refused(_shard(tmp_path, tok, str(good), extra=("--bos",)), "--bos", "no BOS token",
                   before=before, roots=[tmp_path])


def test_fingerprint_of_json_that_is_not_a_tokenizer(tmp_path: Path) -> None:
    p = tmp_path / "tokenizer.json"
    p.write_text('{"just": "some json"}\n')
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.tokenize", "tokenizer", "fingerprint", str(p)], tmp_path)
    assert_refused(res, "tokenizer.json", "cannot load tokenizer", before=before,
                   roots=[tmp_path])


def test_binary_files_split_over_shard_jobs_are_named_by_gather(tmp_path: Path, tok: Path) -> None:
    for i in range(2):
        (tmp_path / f"blob-{i}.dat").write_bytes(bytes(range(128, 256)) * 20)
    inputs = [str(tmp_path / "blob-0.dat"), str(tmp_path / "blob-1.dat")]
    for i in ("0", "1"):  # alone, neither job can tell the corpus has nothing usable
        res = _shard(tmp_path, tok, *inputs, extra=("--format", "txt", "--shards", "2",
                                                    "--shard", i))
        assert res.returncode == 0, res.stderr
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.tokenize", "gather", "--out", str(tmp_path / "out"), "--shards",
               "2", "--tokenizer", str(tok)], tmp_path)
    assert_refused(res, "no usable training documents", "blob-", before=before,
                   roots=[tmp_path])


def test_tokenizer_path_that_is_a_device_or_fifo(tmp_path: Path) -> None:
    good = _good(tmp_path)
    os.mkfifo(tmp_path / "tok.fifo")  # opening it would block forever
    before = snapshot(good)
    for path in (Path("/dev/zero"), tmp_path / "tok.fifo"):
        res = _shard(tmp_path, path, str(good))
        assert_refused(res, str(path), "neither a folder nor a regular file", before=before,
                       roots=[good])
    assert not (tmp_path / "out").exists()
