"""Bad input stops the real Snakemake at workflow start: non-zero exit, the key named, no job run."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.conftest import PY, REPO, subprocess_env

DEFAULT = yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def snakemake(workdir, *args):
    return subprocess.run(
        [PY, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "1", *args],
        cwd=workdir, capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )


def write_config(tmp_path, mutate):
    cfg = yaml.safe_load(yaml.safe_dump(DEFAULT))
    mutate(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda c: c["train"].update(bogus=1), "train.bogus: unknown key"),
        (lambda c: c["train"].update(micro_batch_size="x"), "train.micro_batch_size"),
        (lambda c: c["train"].update(global_batch_size=10), "train.global_batch_size (10) must equal"),
        (lambda c: c["data"].update(sources=[{"path": "/nonexistent/corpus-*.txt"}]),
         "data.sources.0.path: '/nonexistent/corpus-*.txt' matches no file"),
    ],
    ids=["unknown-key", "wrong-type", "batch-does-not-divide", "corpus-matches-nothing"],
)
def test_bad_config_stops_before_any_job(tmp_path, mutate, needle):
    cfg = write_config(tmp_path, mutate)
    # A real run (not a dry run): had validation let it through, jobs would have started.
    res = snakemake(tmp_path, "--configfile", str(cfg))
    assert res.returncode != 0
    assert needle in res.stderr + res.stdout
    assert not (tmp_path / "results").exists(), "a job ran before validation stopped the workflow"


def test_dry_run_lists_all_five_stages(tmp_path):
    cfg = write_config(tmp_path, lambda c: None)
    res = snakemake(tmp_path, "--configfile", str(cfg), "-n")
    assert res.returncode == 0, res.stderr
    for rule in ("tokenize_shard", "gather", "render", "train", "consolidate", "evaluate"):
        assert f"rule {rule}:" in res.stdout + res.stderr, rule


def test_lint_is_clean(tmp_path):
    cfg = write_config(tmp_path, lambda c: None)
    res = snakemake(tmp_path, "--configfile", str(cfg), "--lint")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "Lints for" not in out, out
