"""Config: typed classes, the generated schema, and errors that name the key path."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from pipeline.config.files import (
    expand_sources,
    load_config,
    load_yaml,
    merge_config,
    parse_config,
    workflow_config_raw,
)
from pipeline.config.schema import json_schema
from pipeline.errors import PipelineError
from tests.conftest import REPO

DEFAULT = yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def with_(**changes):
    """The default config with keys replaced; ``train__lr=1`` sets ``train.lr``."""
    cfg = copy.deepcopy(DEFAULT)
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = cfg
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return cfg


def test_schema_file_is_generated_from_the_classes():
    on_disk = json.loads((REPO / "config" / "schema.json").read_text())
    assert on_disk == json.loads(json.dumps(json_schema())), (
        "config/schema.json is stale: run `python -m pipeline.config schema > config/schema.json`"
    )


def test_every_field_has_a_description():
    schema = json_schema()
    for name, definition in schema["$defs"].items():
        for field, prop in definition.get("properties", {}).items():
            assert prop.get("description"), f"{name}.{field} has no docstring"


def test_default_config_defines_two_runs_sharing_data():
    cfg = load_config(REPO / "config" / "config.yaml")
    assert cfg.run_names() == ["fsdp", "deepspeed"]
    fsdp, ds = cfg.run("fsdp"), cfg.run("deepspeed")
    assert fsdp.train.backend == "fsdp" and ds.train.backend == "deepspeed"
    assert ds.train.zero_stage == 2
    assert fsdp.data == ds.data
    assert fsdp.train.lr == ds.train.lr == cfg.train.lr  # overrides touch only what they name


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (with_(train__micro_batchsize=4), "train.micro_batchsize: unknown key"),
        (with_(train__micro_batch_size="eight"), "train.micro_batch_size"),
        (with_(train__micro_batch_size=0), "train.micro_batch_size"),
        (with_(train__backend="megatron"), "train.backend"),
        (with_(train__global_batch_size=15), "train.global_batch_size (15) must equal"),
        (with_(data__seq_len=1), "data.seq_len"),
        (with_(model__num_heads=5), "model.num_heads"),
        ({**DEFAULT, "runs": {"a": {"train": {"lrr": 1.0}}}}, "runs.a.train.lrr: unknown key"),
        ({**DEFAULT, "runs": {"a b;": {}}}, "run name 'a b;'"),
        ({k: v for k, v in DEFAULT.items() if k != "data"}, "data: required key is missing"),
        (with_(train__lr=float("inf")), "train.lr: Input should be a finite number"),
        (with_(train__betas=[0.9, 1.0]), "train.betas.1"),
        (with_(cluster__nodes=10**9), "cluster.nodes"),
        ({**DEFAULT, "runs": {"a\n": {}}}, "run name 'a\\n'"),
        ({**DEFAULT, "runs": {}}, "runs"),
        (with_(model__init_from="/nonexistent/model"), "model.init_from: '/nonexistent/model'"),
    ],
)
def test_bad_config_names_the_key(raw, needle):
    with pytest.raises(PipelineError) as err:
        parse_config(raw)
    assert needle in str(err.value)


def test_batch_that_divides_is_accepted():
    cfg = parse_config(with_(train__global_batch_size=16))  # 8 micro × 1 × 2 processes
    assert cfg.run("fsdp").global_batch_size == 16


def test_source_matching_nothing_names_the_path(tmp_path):
    cfg = parse_config(with_(data__sources=[{"path": str(tmp_path / "nothing-*.txt")}]))
    with pytest.raises(PipelineError, match=r"data\.sources\.0\.path: .*nothing-\*\.txt"):
        expand_sources(cfg.data.sources)


def test_stdlib_source_expands_on_every_machine():
    cfg = load_config(REPO / "config" / "config.yaml")
    files = expand_sources(cfg.data.sources)
    assert len(files) > 20 and all(f.suffix == ".py" for f in files)


def test_model_preset_fills_architecture_and_explicit_keys_win():
    raw = with_(model={"preset": "llama3-8b", "num_layers": 2})
    m = parse_config(raw).run("fsdp").model
    assert (m.hidden_size, m.num_kv_heads, m.rope_theta, m.num_layers) == (4096, 8, 500000.0, 2)
    with pytest.raises(PipelineError, match=r"model\.preset: unknown preset 'llama9'"):
        parse_config(with_(model={"preset": "llama9"}))


def test_a_preset_in_a_users_file_is_a_whole_model():
    """The default config's explicit model keys give way to a later file's preset (or
    init_from); keys beside the preset in that file, and a run's own, still win."""
    user = {"model": {"preset": "llama2-70b"}, "runs": {"big": {}, "short": {
        "model": {"num_layers": 2}}, "small": {"model": {"preset": "llama2-7b"}}}}
    merged = merge_config(DEFAULT, user)
    cfg = parse_config(merged)
    big = cfg.run("big").model
    assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads) == (8192, 80, 64, 8)
    assert cfg.run("short").model.num_layers == 2 and cfg.run("short").model.hidden_size == 8192
    assert cfg.run("small").model.hidden_size == 4096
    assert cfg.run("small").model.num_kv_heads in (None, 32)  # 7b has no GQA, not 70b's 8
    beside = merge_config(DEFAULT, {"model": {"preset": "llama2-7b", "num_layers": 4}})
    assert parse_config(beside).run("fsdp").model.num_layers == 4
    # Without a preset the default's keys merge as before.
    assert merge_config(DEFAULT, {"model": {"num_layers": 5}})["model"]["hidden_size"] == \
        DEFAULT["model"]["hidden_size"]


def test_the_readmes_7b_and_70b_configs_pass_the_preflight():
    import re

    from pipeline.plan.run import render_run

    text = (REPO / "README.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "preset:" in b]
    assert len(blocks) == 2
    for block in blocks:
        cfg = parse_config(merge_config(DEFAULT, yaml.safe_load(block)))
        (name,) = cfg.run_names()
        files = render_run(cfg.run(name), vocab_size=32000)
        assert "fits" in files["plan.md"] or "FULL_SHARD" in files["plan.md"]


def test_planner_keys_name_config_fields():
    from pipeline.config.schema import ClusterConfig, DataConfig, TrainConfig
    from pipeline.plan import KEYS

    sections = {"data": DataConfig, "cluster": ClusterConfig, "train": TrainConfig}
    for key in KEYS.values():
        if key == "cluster.world_size":  # what the launcher starts, not a config key
            continue
        section, name = key.split(".")
        assert name in sections[section].model_fields, key


def test_a_later_files_runs_replace_the_earlier_runs_and_the_rest_merges():
    user = {"train": {"lr": 1e-3}, "runs": {"solo": {"train": {"max_steps": 40}}}}
    merged = merge_config(DEFAULT, user)
    assert list(merged["runs"]) == ["solo"]
    assert merged["train"]["lr"] == 1e-3
    assert merged["train"]["backend"] == DEFAULT["train"]["backend"]  # deep-merged
    assert merge_config(DEFAULT, {"train": {"lr": 1e-3}})["runs"] == DEFAULT["runs"]
    cfg = parse_config(merged)
    assert cfg.run_names() == ["solo"] and cfg.run("solo").train.max_steps == 40


def test_workflow_config_reads_the_default_here_then_each_file(tmp_path, monkeypatch):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(DEFAULT))
    (tmp_path / "a.yaml").write_text("runs:\n  one: {}\n")
    (tmp_path / "b.yaml").write_text("train:\n  lr: 1.0e-3\n")
    monkeypatch.chdir(tmp_path)
    raw = workflow_config_raw(["a.yaml", "b.yaml"], {"train": {"max_steps": 30}})
    cfg = parse_config(raw)
    assert cfg.run_names() == ["one"]
    assert (cfg.train.lr, cfg.train.max_steps) == (1e-3, 30)
    with pytest.raises(PipelineError, match="data: required key is missing"):
        parse_config(workflow_config_raw(["a.yaml"], replace_default=True))


def test_yaml_duplicate_keys_are_refused_with_key_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1\n  max_steps: 3\n  lr: 2\n")
    with pytest.raises(PipelineError, match=r"line 4: duplicate key train\.lr \(first at line 2\)"):
        load_yaml(path)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {lr: 1.0e-3, max_steps: 20}\n"
                    "runs:\n  a: {train: {<<: *b, lr: 2.0e-3}}\n")
    assert load_yaml(path)["runs"]["a"]["train"] == {"lr": 2e-3, "max_steps": 20}


def test_an_empty_run_entry_is_a_run_without_overrides():
    assert parse_config({**DEFAULT, "runs": {"plain": None}}).run_names() == ["plain"]
