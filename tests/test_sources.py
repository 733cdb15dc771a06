"""One source expander: the config check and the tokenizer/tokenize input see the same files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import get_args

import pytest

from pipeline.config.files import expand_sources
from pipeline.config.schema import DocSplit, SourceConfig, SourceFormat
from pipeline.text.sources import DOC_SPLITS, FORMATS, SourceSpec, expand_paths


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    for rel in ("a.txt", ".hidden.txt", ".git/objects.txt", "sub/b.txt", "sub/.c.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"text of {rel}\n")
    return root


def _both(path: str) -> tuple[list[str], list[str]]:
    by_config = [os.path.abspath(p) for p in expand_sources([SourceConfig(path=path)])]
    by_reader = [s.path for s in SourceSpec.from_args([path]).resolve()]
    return by_config, by_reader


def test_dotfiles_are_treated_the_same_by_config_and_reader(corpus: Path) -> None:
    # A directory: hidden files and hidden directories are skipped by both.
    by_config, by_reader = _both(str(corpus))
    assert by_config == by_reader == [str(corpus / "a.txt"), str(corpus / "sub" / "b.txt")]
    # A glob: `*` does not match dotfiles, for both.
    by_config, by_reader = _both(str(corpus / "*.txt"))
    assert by_config == by_reader == [str(corpus / "a.txt")]
    # A dotfile named explicitly is read by both.
    by_config, by_reader = _both(str(corpus / ".hidden.txt"))
    assert by_config == by_reader == [str(corpus / ".hidden.txt")]


def test_expanded_paths_keep_the_spelling_of_the_source(corpus: Path, monkeypatch) -> None:
    monkeypatch.chdir(corpus.parent)
    assert expand_sources([SourceConfig(path="corpus/*.txt")]) == [Path("corpus/a.txt")]
    assert expand_paths("corpus/sub") == [os.path.join("corpus", "sub", "b.txt")]


def test_reader_value_sets_agree_with_the_config_types() -> None:
    assert get_args(SourceFormat) == ("auto", *FORMATS)
    assert get_args(DocSplit) == DOC_SPLITS


def test_a_local_datasets_directory_is_read_as_its_arrow_files(tmp_path: Path) -> None:
    import datasets

    from pipeline.text.readers import iter_texts

    texts = [f"document {i}\nwith two lines" for i in range(50)] + ["  ", None]
    ds = datasets.Dataset.from_dict({"body": texts, "n": list(range(52))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    files = expand_paths(str(tmp_path / "saved"))
    assert [Path(f).name for f in files] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    by_config = [os.path.abspath(p) for p in expand_sources([SourceConfig(path=str(tmp_path / "saved"))])]
    assert by_config == [os.path.abspath(f) for f in files]
    skipped: dict[str, int] = {}
    spec = SourceSpec.from_args([str(tmp_path / "saved")], text_field="body")
    assert list(iter_texts(spec, skipped=skipped)) == texts[:50]
    assert skipped == {"empty": 2}
