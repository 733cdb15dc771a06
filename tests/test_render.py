"""Render: a pure function of one run's typed config, pinned by golden files.

Regenerate the goldens after an intended change with ``UPDATE_GOLDEN=1 pytest tests/test_render.py``
and review the diff.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess

import pytest
import yaml

from pipeline.config.files import parse_config
from pipeline.errors import PipelineError
from pipeline.plan.run import render_run
from tests.conftest import PY, REPO, subprocess_env

GOLDEN = REPO / "tests" / "golden" / "render"
DEFAULT = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
LLAMA2_7B = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_layers": 32, "num_heads": 32,
    "max_position_embeddings": 4096,
}


def config_with(**sections):
    raw = copy.deepcopy(DEFAULT)
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    raw["runs"] = {"r": {}}
    return parse_config(raw).run("r")


CASES = {
    "default-fsdp": (parse_config(DEFAULT).run("fsdp"), 1024),
    "default-deepspeed": (parse_config(DEFAULT).run("deepspeed"), 1024),
    "llama2-7b-auto-4x8-bf16": (
        config_with(
            model=LLAMA2_7B,
            data={"seq_len": 4096},
            cluster={"nodes": 4, "gpus_per_node": 8, "gpu_mem_gb": 80, "host_mem_gb": 1024},
            train={"backend": "deepspeed", "strategy": "auto", "precision": "bf16",
                   "activation_checkpointing": True, "micro_batch_size": 1, "grad_accum": 8,
                   "lr": 3e-4, "warmup_steps": 100, "max_steps": 1000},
        ),
        32000,
    ),
    "llama2-7b-fsdp-hybrid-2x8-bf16": (
        config_with(
            model=LLAMA2_7B,
            data={"seq_len": 4096},
            cluster={"nodes": 2, "gpus_per_node": 8, "gpu_mem_gb": 80},
            train={"backend": "fsdp", "fsdp_sharding": "HYBRID_SHARD", "precision": "bf16",
                   "activation_checkpointing": True, "micro_batch_size": 2, "grad_accum": 4},
        ),
        32000,
    ),
}


def _normalise(content):
    return content if isinstance(content, str) else json.loads(json.dumps(content))


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_matches_golden(case):
    run, vocab = CASES[case]
    files = render_run(run, vocab_size=vocab)
    folder = GOLDEN / case
    if os.environ.get("UPDATE_GOLDEN"):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        for name, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=2, sort_keys=True)
            (folder / name).write_text(text + ("" if text.endswith("\n") else "\n"))
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)
    for name, content in files.items():
        on_disk = (folder / name).read_text()
        if name.endswith(".json"):
            assert json.loads(on_disk) == _normalise(content), name
        else:
            assert on_disk.rstrip("\n") == content.rstrip("\n"), name


def test_render_is_pure():
    run, vocab = CASES["llama2-7b-auto-4x8-bf16"]
    assert render_run(run, vocab_size=vocab) == render_run(run, vocab_size=vocab)


def test_auto_strategy_is_written_into_the_rendered_config():
    run, vocab = CASES["llama2-7b-auto-4x8-bf16"]
    files = render_run(run, vocab_size=vocab)
    stage = files["ds_config.json"]["zero_optimization"]["stage"]
    assert files["config.json"]["train"]["zero_stage"] == stage
    assert files["config.json"]["train"]["strategy"] == "auto"
    assert "Chosen" in files["plan.md"]


def test_memory_that_does_not_fit_is_a_preflight_error():
    run = config_with(model=LLAMA2_7B, cluster={"gpu_mem_gb": 24, "gpus_per_node": 2},
                      train={"backend": "deepspeed", "zero_stage": 0, "precision": "bf16"})
    with pytest.raises(PipelineError, match=r"cluster\.gpu_mem_gb: .*needs .* GB per GPU"):
        render_run(run, vocab_size=32000)


def test_unknown_deepspeed_option_is_a_preflight_error():
    run = config_with(train={"backend": "deepspeed", "deepspeed": {"zero_optimization": {"stage_typo": 1}}})
    with pytest.raises(PipelineError, match="stage_typo"):
        render_run(run, vocab_size=1024)


def test_render_cli_writes_files_and_rejects_bad_input(tmp_path):
    env = subprocess_env()
    ok = subprocess.run(
        [PY, "-m", "pipeline.render", "--config", str(REPO / "config" / "config.yaml"),
         "--run", "deepspeed", "--out", str(tmp_path / "r"), "--vocab-size", "1024"],
        capture_output=True, text=True, env=env,
    )
    assert ok.returncode == 0, ok.stderr
    from pipeline.plan import validate_ds_config

    ds = json.loads((tmp_path / "r" / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2
    assert validate_ds_config(ds, world_size=2) == []  # the installed DeepSpeedConfig accepts it
    bad = subprocess.run(
        [PY, "-m", "pipeline.render", "--config", str(REPO / "config" / "config.yaml"),
         "--run", "nope", "--out", str(tmp_path / "x")],
        capture_output=True, text=True, env=env,
    )
    assert bad.returncode == 2 and "unknown run 'nope'" in bad.stderr
    assert not (tmp_path / "x").exists()


def test_auto_turns_activation_checkpointing_on_before_offload_and_writes_it():
    """Micro batch 4 at seq 4096: no ZeRO rung fits the activations of llama2-7b without
    recomputation; auto recomputes (time for memory) rather than offloading, and the rendered
    config.json makes the trainer do so."""
    run = config_with(model=LLAMA2_7B, data={"seq_len": 4096},
                      cluster={"nodes": 4, "gpus_per_node": 8, "gpu_mem_gb": 80,
                               "host_mem_gb": 1024},
                      train={"backend": "deepspeed", "strategy": "auto", "precision": "bf16",
                             "micro_batch_size": 4, "grad_accum": 2, "lr": 3e-4,
                             "warmup_steps": 100, "max_steps": 1000})
    files = render_run(run, vocab_size=32000)
    train = files["config.json"]["train"]
    assert train["activation_checkpointing"] is True
    assert not train["offload_optimizer"] and not train["offload_params"]
    assert (train["tp"], train["pp"]) == (1, 1)
    assert "activation checkpointing chosen by the planner" in files["plan.md"]


def test_plan_states_the_mixture_and_what_happens_when_a_source_runs_out():
    """plan.md's data line: the weights and train.on_source_exhausted always; with the data
    manifest (what the render rule passes), the passes over each source or the step a
    source runs out at."""
    sources = [{"name": "code", "path": "<stdlib>/[a-c]*.py", "format": "txt"},
               {"name": "prose", "path": "<stdlib>/[d-f]*.py", "format": "txt"}]
    # 1,000 and 100 sequences of 128 tokens; global batch 16 × 200 steps = 3,200 drawn.
    manifest = {"seq_len": 128, "by_source": {"code": {"train": {"tokens": 128_000}},
                                              "prose": {"train": {"tokens": 12_800}}}}

    def line(train, manifest):
        md = render_run(config_with(data={"sources": sources}, train={"max_steps": 200, **train}),
                        vocab_size=1024,
                        manifest=manifest)["plan.md"]
        return next(x for x in md.splitlines() if x.startswith("- Data:"))

    weights = {"mixture": {"code": 3, "prose": 1}}
    assert line(weights, None) == (
        "- Data: code 75%, prose 25% (train.mixture); a source that runs out starts over, "
        "reshuffled (train.on_source_exhausted: repeat)")
    assert line(weights, manifest).endswith(
        "; passes over each source in 200 steps: code 2.40×, prose 8.00×")
    stop = line({**weights, "on_source_exhausted": "stop"}, manifest)
    assert "a source that runs out ends training (train.on_source_exhausted: stop)" in stop
    step = int(re.search(r"it stops at step (\d+) of 200$", stop).group(1))
    assert 24 <= step <= 25  # prose's 100 sequences at 4 of every 16
    assert line({}, manifest).startswith("- Data: in proportion to tokens (train.mixture)")
