"""The Snakefile's start-up pre-flight: a pass is cached, a failure never is."""

from __future__ import annotations

import json

import pytest
import yaml

import pipeline.plan.run
from pipeline.config.files import parse_config
from pipeline.errors import PipelineError
from pipeline.plan import preflight_cache
from tests.conftest import REPO


@pytest.fixture
def cfg():
    return parse_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))


@pytest.fixture
def calls(monkeypatch):
    """Runs the planner was asked to check (a stand-in for render_run: no DeepSpeed here)."""
    seen = []
    monkeypatch.setattr(pipeline.plan.run, "render_run",
                        lambda run, *, vocab_size: seen.append(run.name) or {})
    monkeypatch.delenv("ZEROSNAKE_PREFLIGHT_CACHE", raising=False)
    preflight_cache._sha.cache_clear()
    return seen


def test_a_pass_is_recorded_and_reused(cfg, calls, tmp_path):
    names = cfg.run_names()
    assert preflight_cache.preflight_runs(cfg, cache_dir=tmp_path) == dict.fromkeys(names,
                                                                                    "checked")
    assert preflight_cache.preflight_runs(cfg, cache_dir=tmp_path) == dict.fromkeys(names,
                                                                                    "cached")
    assert calls == names
    marker = json.loads(next(tmp_path.glob("*.ok")).read_text())
    assert "plan/run.py" in marker["code"] and "config/schema.py" in marker["code"]


def test_another_config_is_checked_again(cfg, calls, tmp_path):
    preflight_cache.preflight_runs(cfg, cache_dir=tmp_path)
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw["runs"]["fsdp"] = {"train": {"lr": 1e-4}}
    verdicts = preflight_cache.preflight_runs(parse_config(raw), cache_dir=tmp_path)
    assert verdicts == {"fsdp": "checked", "deepspeed": "cached"}


def test_changed_pipeline_code_is_checked_again(cfg, calls, tmp_path):
    preflight_cache.preflight_runs(cfg, cache_dir=tmp_path)
    for path in tmp_path.glob("*.ok"):
        marker = json.loads(path.read_text())
        marker["code"]["render.py"] = "0" * 64  # as if render.py changed since the pass
        path.write_text(json.dumps(marker))
    assert set(preflight_cache.preflight_runs(cfg, cache_dir=tmp_path).values()) == {"checked"}


def test_a_failure_is_raised_every_time_and_never_recorded(cfg, monkeypatch, tmp_path):
    def fail(run, *, vocab_size):
        raise PipelineError(f"pre-flight found 1 problem(s): {run.name}")

    monkeypatch.setattr(pipeline.plan.run, "render_run", fail)
    for _ in range(2):
        with pytest.raises(PipelineError, match="pre-flight"):
            preflight_cache.preflight_runs(cfg, cache_dir=tmp_path)
    assert not list(tmp_path.glob("*.ok"))


def test_cache_off_checks_every_time(cfg, calls, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROSNAKE_PREFLIGHT_CACHE", "0")
    preflight_cache.preflight_runs(cfg, cache_dir=tmp_path)
    preflight_cache.preflight_runs(cfg, cache_dir=tmp_path)
    assert len(calls) == 2 * len(cfg.run_names())
    assert not list(tmp_path.glob("*.ok"))
