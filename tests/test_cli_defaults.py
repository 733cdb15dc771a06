"""Every stage-command option that mirrors a config key defaults to the config's value."""

from __future__ import annotations

import inspect

from pipeline.config.files import field_default, field_help
from pipeline.config.schema import (
    ClusterConfig,
    DataConfig,
    PlanConfig,
    SourceConfig,
    TokenizerConfig,
    TrainConfig,
)
from pipeline.plan import Cluster
from pipeline.plan.__main__ import _parser as plan_parser
from pipeline.text.sources import SourceSpec
from pipeline.text.tokenizer import _parser as tokenizer_parser
from pipeline.tokenize.__main__ import _parser as tokenize_parser
from pipeline.tokenize.shard import tokenize_shard


def _check(args, mirrors: dict[str, tuple[type, str]]) -> None:
    for dest, (cls, name) in mirrors.items():
        assert getattr(args, dest) == field_default(cls, name), f"--{dest} vs {cls.__name__}.{name}"


READER = {
    "format": (SourceConfig, "format"),
    "text_field": (SourceConfig, "text_field"),
    "doc_split": (SourceConfig, "doc_split"),
}


def test_tokenize_shard_defaults_are_the_config_defaults() -> None:
    args = tokenize_parser().parse_args(
        ["shard", "--input", "x", "--tokenizer", "t", "--seq-len", "8", "--out", "o"]
    )
    _check(args, {**READER, "val_fraction": (DataConfig, "val_fraction"),
                  "on_invalid": (DataConfig, "on_invalid"), "bos": (DataConfig, "bos")})
    default = inspect.signature(tokenize_shard).parameters["val_fraction"].default
    assert default == field_default(DataConfig, "val_fraction")


def test_tokenizer_train_defaults_are_the_config_defaults() -> None:
    args = tokenizer_parser().parse_args(["train", "--input", "x", "--out", "o"])
    _check(args, {**READER, "vocab_size": (TokenizerConfig, "vocab_size"),
                  "max_bytes": (TokenizerConfig, "train_max_bytes")})
    spec = SourceSpec.from_args(["x"])
    assert (spec.text_field, spec.doc_split) == (
        field_default(SourceConfig, "text_field"), field_default(SourceConfig, "doc_split"))


def test_plan_defaults_are_the_config_defaults() -> None:
    args = plan_parser().parse_args([])
    _check(args, {
        "nodes": (ClusterConfig, "nodes"), "gpus_per_node": (ClusterConfig, "gpus_per_node"),
        "gpu_mem_gb": (ClusterConfig, "gpu_mem_gb"), "host_mem_gb": (ClusterConfig, "host_mem_gb"),
        "micro_batch": (TrainConfig, "micro_batch_size"), "seq_len": (DataConfig, "seq_len"),
        "precision": (TrainConfig, "precision"),
        "activation_checkpointing": (TrainConfig, "activation_checkpointing"),
        "accounting": (PlanConfig, "accounting"), "headroom": (PlanConfig, "headroom"),
    })
    c = Cluster()
    assert (c.nodes, c.gpus_per_node, c.gpu_mem_gb, c.host_mem_gb) == tuple(
        field_default(ClusterConfig, k) for k in ("nodes", "gpus_per_node", "gpu_mem_gb",
                                                  "host_mem_gb"))


def test_help_comes_from_the_field_docstring() -> None:
    text = field_help(DataConfig, "val_fraction")
    assert text.startswith("Fraction of documents held out for validation")
    assert "config: data.val_fraction" in text and "default: 0.05" in text
    helps = {a.dest: a.help for a in plan_parser()._actions}
    assert helps["gpus_per_node"] == field_help(ClusterConfig, "gpus_per_node")
