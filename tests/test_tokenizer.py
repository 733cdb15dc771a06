"""Tokenizer stage: training, loading, fingerprint, the tiktoken fast path and its fallback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import PipelineError
from pipeline.text.tokenizer import (
    EOS_TOKEN,
    HFEncoder,
    TiktokenEncoder,
    fingerprint,
    load_tokenizer,
    make_encoder,
    tiktoken_encoding_from_hf,
    tokenizer_info,
    train_tokenizer,
)
from tests.conftest import REPO
from tests.conftest import require_corpora as corpora

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_texts(limit: int = 60) -> list[str]:
    out = []
    for p in sorted(STDLIB.glob("*.py"))[:limit]:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    texts = stdlib_texts(40) + ["Ünïcödé 日本語 🙂 naïve café"] * 3
    return train_tokenizer(texts, 700, out, bos_token="<|startoftext|>")


def test_trained_dir_loads_with_autotokenizer(tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {
        p.name for p in tok_dir.iterdir()
    }
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4 and 5
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    info = tokenizer_info(tok_dir, bos=True)
    assert hf.eos_token == EOS_TOKEN and hf.eos_token_id == info.eos_id == 0
    assert hf.bos_token == "<|startoftext|>" and hf.bos_token_id == info.bos_id
    assert info.vocab_size == len(hf) == 700
    text = "def f(x):\n    return 'naïve' + \"日本\"  # 🙂\n"
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert hf.decode(ids) == text
    assert ids == load_tokenizer(tok_dir).encode(text, add_special_tokens=False).ids


def test_tokenizer_json_file_path_and_missing_dir(tok_dir: Path, tmp_path: Path) -> None:
    assert (
        tokenizer_info(tok_dir / "tokenizer.json").fingerprint
        == tokenizer_info(tok_dir).fingerprint
    )
    with pytest.raises(PipelineError, match=r"does not exist.*train"):
        tokenizer_info(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PipelineError, match=r"no tokenizer\.json"):
        tokenizer_info(tmp_path / "empty")
    with pytest.raises(PipelineError, match="no BOS"):
        # A tokenizer without a BOS token cannot honour --bos.
        bare = train_tokenizer(stdlib_texts(5), 300, tmp_path / "bare")
        tokenizer_info(bare, bos=True)


def test_fingerprint_is_canonical(tok_dir: Path, tmp_path: Path) -> None:
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tokenizer.json").write_text(json.dumps(spec, indent=4))
    assert fingerprint(tmp_path / "a") == fingerprint(tok_dir)  # formatting does not matter
    spec["model"]["vocab"]["zzz_new"] = 10_000
    (tmp_path / "a" / "tokenizer.json").write_text(json.dumps(spec))
    assert fingerprint(tmp_path / "a") != fingerprint(tok_dir)  # content does


def test_vocab_too_small_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="vocab_size 100 is too small"):
        train_tokenizer(["abc"], 100, tmp_path / "t")


def _real_documents() -> list[str]:
    root = corpora()
    docs: list[str] = []
    for name in ("tinyshakespeare.txt", "wikitext2-valid.txt"):
        text = (root / name).read_text(encoding="utf-8")
        docs += [b for b in re.split(r"\n\s*\n", text) if b.strip()]
        docs.append(text)  # and each corpus as one big document
    return docs + stdlib_texts(200)


def test_fast_path_is_identical_to_hf_on_real_text(tmp_path: Path) -> None:
    docs = _real_documents()
    tok_path = train_tokenizer(docs[:3000], 4096, tmp_path / "tok")
    tok = load_tokenizer(tok_path)
    fast = make_encoder(tok, num_threads=2)
    assert isinstance(fast, TiktokenEncoder)
    ref = HFEncoder(tok)
    got, want = fast.encode_batch(docs), ref.encode_batch(docs)
    fast.close()
    assert sum(len(w) for w in want) > 500_000  # the comparison covers real volume
    mismatched = [
        i for i, (a, b) in enumerate(zip(got, want, strict=True)) if not np.array_equal(a, b)
    ]
    assert mismatched == []


def test_literal_special_token_text_is_plain_text(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    text = "before <|endoftext|> after"
    fast = make_encoder(tok)
    assert isinstance(fast, TiktokenEncoder)
    for enc in (fast, HFEncoder(tok)):
        ids = enc.encode_batch([text])[0]
        assert 0 not in ids.tolist()
        assert tok.decode(ids.tolist()) == text
    fast.close()


def test_not_convertible_uses_hf(tok_dir: Path, tmp_path: Path) -> None:
    from tokenizers import normalizers

    tok = load_tokenizer(tok_dir)
    tok.normalizer = normalizers.Lowercase()  # tiktoken has no normalisers: no fast path
    assert tiktoken_encoding_from_hf(tok) is None
    assert isinstance(make_encoder(tok), HFEncoder)
    # Merge order that disagrees with id order is detected structurally.
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    m = spec["model"]["merges"]
    m[0], m[-1] = m[-1], m[0]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert tiktoken_encoding_from_hf(load_tokenizer(tmp_path)) is None


def test_disagreeing_fast_path_falls_back_with_warning(tok_dir: Path, monkeypatch) -> None:
    import tiktoken

    import pipeline.text.tokenizer as tk

    tok = load_tokenizer(tok_dir)
    good = tiktoken_encoding_from_hf(tok)
    assert good is not None
    ranks = dict(good._mergeable_ranks)
    # Swap the ranks of two multi-byte tokens: a real, wrong encoder.
    multi = sorted((r, b) for b, r in ranks.items() if len(b) > 1)
    (r1, b1), (r2, b2) = multi[0], multi[-1]
    ranks[b1], ranks[b2] = r2, r1
    bad = tiktoken.Encoding(
        "bad", pat_str=tk.GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    monkeypatch.setattr(tk, "tiktoken_encoding_from_hf", lambda _tok: bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enc = tk.make_encoder(tok, sample=stdlib_texts(5))
    assert isinstance(enc, HFEncoder)
    assert any("falling back to HF" in str(w.message) for w in caught)


def test_cli_help_and_errors(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "pipeline.tokenize", "tokenizer"]
    r = subprocess.run([*run, "train", "--help"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "--vocab-size" in r.stdout
    r = subprocess.run(
        [
            *run,
            "train",
            "--input",
            str(tmp_path / "none*.txt"),
            "--vocab-size",
            "300",
            "--out",
            str(tmp_path / "t"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 2
    assert (
        r.stderr.startswith("error: ") and "none*.txt" in r.stderr and "matches no file" in r.stderr
    )


def test_cli_train_from_jsonl(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"body": t}) + "\n" for t in stdlib_texts(10)))
    out = tmp_path / "tok"
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.tokenize", "tokenizer", "train", "--input", str(src), "--text-field", "body",
         "--vocab-size", "400", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["vocab_size"] == 400 and report["fingerprint"] == fingerprint(out)


def test_import_a_local_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    # A bare tokenizer.json (no config): EOS detected, config written.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.tokenize", "tokenizer", "import", "--path", str(tmp_path / "src" / "tokenizer.json"),
         "--out", str(tmp_path / "a")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fingerprint"] == fingerprint(tok_dir)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert hf.eos_token == EOS_TOKEN
    # A whole directory keeps its own config (here: the BOS token).
    from pipeline.text.tokenizer import import_tokenizer

    out = import_tokenizer(tok_dir, tmp_path / "b")
    assert tokenizer_info(out, bos=True).bos_token == "<|startoftext|>"
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.tokenize", "tokenizer", "import", "--path", str(tmp_path / "none"), "--out", str(tmp_path / "c")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 2 and "does not exist" in r.stderr and not (tmp_path / "c").exists()


def test_tokenizer_output_replaces_only_its_own_folder(tmp_path):
    """`tokenizer import --out results/data` must not delete the shards and manifest there; a
    tokenizer folder this command wrote (or an old one holding only tokenizer files) is
    replaced whole."""
    from pipeline.text.tokenizer import import_tokenizer, train_tokenizer

    tok_dir = train_tokenizer(["def f(x): return x"] * 50, 300, tmp_path / "tok")
    data = tmp_path / "data"
    (data / "shards").mkdir(parents=True)
    (data / "manifest.json").write_text("{}")
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.tokenize", "tokenizer", "import", "--path", str(tok_dir),
         "--out", str(data)],
        capture_output=True, text=True, cwd=REPO,
    )
    assert r.returncode == 2, r.stderr
    assert "not written by this command" in r.stderr and "Traceback" not in r.stderr
    assert (data / "manifest.json").read_text() == "{}" and (data / "shards").is_dir()
    # twice into the same folder: the second run replaces the first
    out = import_tokenizer(tok_dir, tmp_path / "copy")
    (out / "tokenizer.json").write_text("stale")
    import_tokenizer(tok_dir, out)
    assert fingerprint(out) == fingerprint(tok_dir)
    # a folder from before markers existed, with only tokenizer files, is still ours
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "tokenizer.json").write_text("old")
    import_tokenizer(tok_dir, legacy)
    assert fingerprint(legacy) == fingerprint(tok_dir)


def test_tokenizer_config_that_is_not_an_object_and_fingerprint_of_other_json(
    tok_dir: Path, tmp_path: Path
) -> None:
    import shutil

    from pipeline.text.tokenizer import tokenizer_info

    bad = tmp_path / "tk"
    shutil.copytree(tok_dir, bad)
    (bad / "tokenizer_config.json").write_text("[]")
    with pytest.raises(PipelineError, match=r"tokenizer_config\.json is a JSON list, not an object"):
        tokenizer_info(bad)
    other = tmp_path / "other.json"
    other.write_text('{"not": "a tokenizer"}')
    r = subprocess.run([sys.executable, "-m", "pipeline.tokenize", "tokenizer", "fingerprint", str(other)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.startswith("error: cannot load tokenizer")
