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


def write_config(tmp_path, mutate, name="config.yaml"):
    cfg = yaml.safe_load(yaml.safe_dump(DEFAULT))
    mutate(cfg)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def bad_deepspeed_key(cfg):
    cfg["runs"]["deepspeed"]["train"]["deepspeed"] = {"bogus_option": 1}


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda c: c["train"].update(bogus=1), "train.bogus: unknown key"),
        (lambda c: c["train"].update(micro_batch_size="x"), "train.micro_batch_size"),
        (lambda c: c["train"].update(global_batch_size=10), "train.global_batch_size (10) must equal"),
        (lambda c: c["data"].update(sources=[{"path": "/nonexistent/corpus-*.txt"}]),
         "data.sources.0.path: '/nonexistent/corpus-*.txt' matches no file"),
        # Past the typed parse: only the pre-flight (planner + installed DeepSpeed) sees this.
        (bad_deepspeed_key, "train.deepspeed.bogus_option: DeepSpeed does not read"),
    ],
    ids=["unknown-key", "wrong-type", "batch-does-not-divide", "corpus-matches-nothing",
         "deepspeed-unknown-key"],
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
    for rule in ("tokenize_shard", "gather", "render", "train", "consolidate", "evaluate",
                 "report"):
        assert f"rule {rule}:" in res.stdout + res.stderr, rule


def test_lint_is_clean(tmp_path):
    cfg = write_config(tmp_path, lambda c: None)
    res = snakemake(tmp_path, "--configfile", str(cfg), "--lint")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "Lints for" not in out, out


def test_preflight_runs_in_the_main_process_only_and_its_pass_is_cached(tmp_path):
    # A cluster job of the executor plugin parses the Snakefile with --mode remote: the main
    # process has checked the config already, so no planner/DeepSpeed there (a bad config that
    # only the pre-flight catches goes through that parse).
    bad = write_config(tmp_path, bad_deepspeed_key, "bad.yaml")
    res = snakemake(tmp_path, "--configfile", str(bad), "--mode", "remote", "-n")
    assert res.returncode == 0, res.stderr
    assert "bogus_option" not in res.stdout + res.stderr
    cache = tmp_path / ".snakemake" / "zerosnake" / "preflight"
    assert not cache.exists()
    # The main process records one pass per run, and a second start with the same config
    # finds them (nothing new written).
    good = write_config(tmp_path, lambda c: None)
    assert snakemake(tmp_path, "--configfile", str(good), "-n").returncode == 0
    markers = sorted(p.name for p in cache.glob("*.ok"))
    assert len(markers) == len(DEFAULT["runs"])
    stamps = [p.stat().st_mtime_ns for p in sorted(cache.glob("*.ok"))]
    assert snakemake(tmp_path, "--configfile", str(good), "-n").returncode == 0
    assert [p.stat().st_mtime_ns for p in sorted(cache.glob("*.ok"))] == stamps
    # A pass of another config does not cover a failing one.
    res = snakemake(tmp_path, "--configfile", str(bad), "-n")
    assert res.returncode != 0 and "bogus_option" in res.stdout + res.stderr
