"""Every pre-flight case fails with a message naming the key and a fix; all checks < 5 s."""

from __future__ import annotations

import time

import pytest

from pipeline.errors import PipelineError
from pipeline.plan import PRESETS, BatchSpec, Cluster, ModelShape, Strategy, check, preflight
from pipeline.plan.preflight import validate_ds_config

SEVEN_B = PRESETS["llama2-7b"]
BATCH = BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=8, activation_checkpointing=True)
#: A GPU node with 512 GB host RAM (the config default, cluster.host_mem_gb, is smaller; DeepSpeed's
#: estimators count host RAM even without offload).
NODE = Cluster(nodes=1, gpus_per_node=8, host_mem_gb=512)


def _messages(**kw) -> list[str]:
    kw.setdefault("model", SEVEN_B)
    kw.setdefault("cluster", NODE)
    kw.setdefault("batch", BATCH)
    return [str(e) for e in check(**kw)[1]]


def _one(needle: str, messages: list[str]) -> str:
    hits = [m for m in messages if needle in m]
    assert hits, f"no message with {needle!r} in {messages}"
    return hits[0]


def test_valid_configuration_passes() -> None:
    assert _messages() == []
    p = preflight(model=SEVEN_B, cluster=NODE, batch=BATCH)
    assert p.fits


def test_global_batch_mismatch() -> None:
    batch = BatchSpec(seq_len=4096, micro_batch_size=2, grad_accum=4, global_batch_size=60)
    msg = _one("train.global_batch_size", _messages(batch=batch))
    assert "train.micro_batch_size (2) × train.grad_accum (4)" in msg and "= 64" in msg
    assert "multiple of 16" in msg


def test_global_batch_alone_resolves_accumulation() -> None:
    batch = BatchSpec(seq_len=4096, micro_batch_size=2, global_batch_size=64)
    the_plan, errors = check(model=SEVEN_B, cluster=NODE, batch=batch)
    assert errors == [] and the_plan.dims.grad_accum == 4


def test_tp_does_not_divide_heads() -> None:
    model = ModelShape(name="h12", vocab_size=32000, hidden_size=1536, intermediate_size=4096,
                       num_layers=8, num_heads=12, num_kv_heads=12)
    msg = _one("attention heads", _messages(model=model, strategy=Strategy(tp=8)))
    assert msg.startswith("train.tp") and "[1, 2, 3, 4, 6]" in msg


def test_tp_does_not_divide_kv_heads() -> None:
    model = ModelShape(name="gqa", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                       num_layers=8, num_heads=16, num_kv_heads=2)
    msgs = _messages(model=model, strategy=Strategy(tp=4))
    assert _one("KV heads", msgs).startswith("train.tp")
    assert not any("attention heads" in m for m in msgs)


def test_tp_larger_than_node() -> None:
    msg = _one("exceeds", _messages(cluster=Cluster(nodes=4, gpus_per_node=8),
                                    strategy=Strategy(tp=16)))
    assert "cluster.gpus_per_node=8" in msg and "train.pp" in msg


def test_pp_exceeding_layers_is_refused_uneven_split_is_not() -> None:
    # 40 layers over 3 stages is 14 + 13 + 13 (topology.stage_layers): allowed.
    assert not any("layers" in m for m in _messages(
        model=PRESETS["llama2-13b"], cluster=Cluster(nodes=3, gpus_per_node=8, host_mem_gb=512),
        strategy=Strategy(zero_stage=1, pp=3)))
    tiny = ModelShape(name="l2", vocab_size=1024, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=4)
    msg = _one("layers", _messages(model=tiny, cluster=Cluster(nodes=4, gpus_per_node=1),
                                   strategy=Strategy(engine="fsdp", pp=4)))
    assert msg.startswith("train.pp") and "2 layers" in msg and "pp ≤ 2" in msg


def test_world_size_mismatch() -> None:
    msg = _one("cluster.world_size", _messages(cluster=Cluster(nodes=2, gpus_per_node=8,
                                                               world_size=8)))
    assert "≠" in msg and "= 16" in msg


def test_memory_does_not_fit_says_how_much_and_what_fits() -> None:
    msg = _one("cluster.gpu_mem_gb", _messages(strategy=Strategy(zero_stage=0)))
    assert "GB more than" in msg
    assert "'ZeRO-1' would fit" in msg


def test_offload_exceeds_host_ram() -> None:
    cluster = Cluster(nodes=1, gpus_per_node=8, host_mem_gb=256)
    strategy = Strategy(zero_stage=3, offload_optimizer=True, offload_params=True)
    msg = _one("cluster.host_mem_gb", _messages(model=PRESETS["llama2-70b"], cluster=cluster,
                                                strategy=strategy))
    assert "offloaded states" in msg and "GB more than" in msg


def test_fp16_and_bf16_both_on() -> None:
    msgs = _messages(ds_overrides={"fp16": {"enabled": True}})
    assert _one("both enabled", msgs).startswith("train.precision")


def test_zero3_with_pipeline() -> None:
    msg = _one("pipeline", _messages(cluster=Cluster(nodes=2, gpus_per_node=8),
                                     strategy=Strategy(zero_stage=3, pp=2)))
    assert msg.startswith("train.zero_stage") and "ZeRO-3" in msg


@pytest.mark.parametrize("override,needle", [
    ({"zero_optimization": {"stage3_bogus_option": 1}}, "stage3_bogus_option"),
    ({"tensor_parallel": {"tp_size": 2}}, "tp_size"),
    ({"gradient_clip": 1.0}, "train.deepspeed.gradient_clip"),
    ({"pipeline": {"stages": 2}}, "train.deepspeed.pipeline.stages"),
])
def test_unknown_deepspeed_option(override: dict, needle: str) -> None:
    msg = _one(needle, _messages(ds_overrides=override))
    assert msg.startswith("train.deepspeed")


def test_validate_ds_config_uses_the_real_world_size() -> None:
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
           "gradient_accumulation_steps": 2}
    assert validate_ds_config(cfg, world_size=8) == []
    errors = validate_ds_config(cfg, world_size=32)
    assert errors and "16 != 1 * 2 * 32" in str(errors[0])


def test_preflight_raises_one_error_listing_all() -> None:
    with pytest.raises(PipelineError) as info:
        preflight(model=SEVEN_B, cluster=Cluster(nodes=1, gpus_per_node=8, host_mem_gb=512, world_size=4),
                  batch=BatchSpec(micro_batch_size=1, grad_accum=1, global_batch_size=7),
                  strategy=Strategy(zero_stage=0))
    text = str(info.value)
    assert "3 problem(s)" in text
    for key in ("cluster.world_size", "train.global_batch_size", "cluster.gpu_mem_gb"):
        assert key in text


def test_all_checks_together_under_5_seconds() -> None:
    start = time.perf_counter()
    for strategy in (Strategy(), Strategy(zero_stage=2, offload_optimizer=True),
                     Strategy(zero_stage=1, tp=2, pp=2), Strategy(engine="fsdp")):
        check(model=PRESETS["llama2-70b"], cluster=Cluster(nodes=4, gpus_per_node=8),
              batch=BATCH, strategy=strategy)
    assert time.perf_counter() - start < 5.0
