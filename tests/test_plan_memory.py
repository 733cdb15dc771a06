"""Memory accounting: parameter counts vs transformers, DeepSpeed's estimators, the ZeRO paper,
Korthikanti et al.'s activation formula."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from pipeline.errors import PipelineError
from pipeline.plan import PRESETS, BatchSpec, ModelShape, ParallelDims, Strategy, estimate_memory
from pipeline.plan.memory import (
    HF_EXTRA_SBH_16BIT_PARAMS,
    OUTPUT_SBV_MIXED,
    activation_bytes,
    layer_activation_bytes,
    local_params,
)

GB = 1e9


def _meta_model(shape: ModelShape) -> torch.nn.Module:
    cfg_cls = MistralConfig if shape.model_type == "mistral" else LlamaConfig
    kwargs = shape.to_hf_config()
    kwargs.pop("model_type")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg_cls(**kwargs))


def _hf_counts(model: torch.nn.Module) -> tuple[int, int]:
    # parameters() already yields a tied tensor once (as DeepSpeed's model_to_params does by
    # data_ptr, which is useless on the meta device).
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_count_equals_transformers(name: str) -> None:
    shape = PRESETS[name]
    total, largest = _hf_counts(_meta_model(shape))
    assert shape.num_params() == total
    assert shape.largest_layer_params() == largest


@pytest.mark.parametrize("variant", [
    {"tie_word_embeddings": True},
    {"num_kv_heads": 2, "num_heads": 8, "hidden_size": 128},
    {"attention_bias": True, "mlp_bias": True},
    {"head_dim": 32},
])
def test_param_count_variants(variant: dict) -> None:
    fields = {**PRESETS["tiny"].__dict__, **variant}
    shape = ModelShape(**fields)
    assert shape.num_params() == _hf_counts(_meta_model(shape))[0]


def test_tied_embeddings_counted_once() -> None:
    untied = PRESETS["tiny"]
    tied = ModelShape(**{**untied.__dict__, "tie_word_embeddings": True})
    assert untied.num_params() - tied.num_params() == untied.vocab_size * untied.hidden_size


def test_from_hf_config_roundtrip(tmp_path) -> None:
    import json
    shape = PRESETS["mistral-7b"]
    (tmp_path / "config.json").write_text(json.dumps(shape.to_hf_config()))
    loaded = ModelShape.from_hf_config(tmp_path / "config.json")
    assert loaded.num_params() == shape.num_params()
    assert ModelShape.from_hf_config(tmp_path).num_kv_heads == 8
    with pytest.raises(PipelineError, match="lacks"):
        ModelShape.from_hf_config({"vocab_size": 10})
    with pytest.raises(PipelineError, match="model_type"):
        ModelShape.from_hf_config({**shape.to_hf_config(), "model_type": "gpt2"})


MODELS = ["llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "mistral-7b"]
TOPOLOGIES = [(1, 8), (4, 8), (2, 4)]  # (nodes, gpus per node)


def _states(shape: ModelShape, nodes: int, gpn: int, **strategy) -> object:
    dims = ParallelDims(nodes=nodes, gpus_per_node=gpn)
    s = Strategy(engine="deepspeed", tp=1, pp=1, offload_params=False, **strategy)
    return estimate_memory(model=shape, dims=dims, strategy=s, batch=BatchSpec(),
                           accounting="deepspeed")


def _close(ours: float, theirs: float, rel: float = 0.01) -> bool:
    return abs(ours - theirs) <= rel * theirs


@pytest.mark.parametrize("nodes,gpn", TOPOLOGIES)
@pytest.mark.parametrize("name", MODELS)
def test_deepspeed_accounting_matches_zero2_estimator(name: str, nodes: int, gpn: int) -> None:
    shape = PRESETS[name]
    n = shape.num_params()
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params=n, num_gpus_per_node=gpn, num_nodes=nodes, cpu_offload=offload)
        ours = _states(shape, nodes, gpn, zero_stage=2, offload_optimizer=offload)
        assert _close(ours.model_states, gpu), (offload, ours.model_states, gpu)
        if nodes == 1 or not offload:
            assert _close(ours.host_per_node, cpu), (offload, ours.host_per_node, cpu)
        else:
            # DeepSpeed counts 4 bytes × *all* GPUs of the job per node here; we count this
            # node's ranks (see memory._deepspeed_states) — never more than DeepSpeed's figure.
            assert ours.host_per_node < cpu


@pytest.mark.parametrize("nodes,gpn", TOPOLOGIES)
@pytest.mark.parametrize("name", MODELS)
def test_deepspeed_accounting_matches_zero3_estimator(name: str, nodes: int, gpn: int) -> None:
    shape = PRESETS[name]
    n, largest = shape.num_params(), shape.largest_layer_params()
    for offload_opt, offload_par in ((False, False), (True, False), (True, True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total_params=n, largest_layer_params=largest, num_gpus_per_node=gpn,
            num_nodes=nodes, cpu_offload=offload_opt, cpu_offload_params=offload_par,
            zero_init=True)
        dims = ParallelDims(nodes=nodes, gpus_per_node=gpn)
        s = Strategy(engine="deepspeed", zero_stage=3, offload_optimizer=offload_opt,
                     offload_params=offload_par, tp=1, pp=1)
        ours = estimate_memory(model=shape, dims=dims, strategy=s, batch=BatchSpec())
        assert _close(ours.model_states, gpu), (offload_opt, offload_par, ours.model_states, gpu)
        assert _close(ours.host_per_node, cpu), (offload_opt, offload_par, ours.host_per_node,
                                                 cpu)


def test_notes_figures_7b_4x8() -> None:
    # ../shared/notes/cpu-engines.md: 7 B params, 4 × 8 GPUs.
    shape = ModelShape.synthetic(7_000_000_000)
    assert round(_states(shape, 4, 8, zero_stage=2, offload_optimizer=False).model_states / GB,
                 2) == 17.94
    assert _states(shape, 4, 8, zero_stage=2, offload_optimizer=True).model_states == 14 * 10**9


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_accounting_reproduces_zero_paper(stage: int, expected_gb: float) -> None:
    # ZeRO (arXiv:1910.02054) Figure 1: Ψ = 7.5 B, N_d = 64, K = 12.
    shape = ModelShape.synthetic(7_500_000_000)
    dims = ParallelDims(nodes=8, gpus_per_node=8)
    s = Strategy(engine="deepspeed", zero_stage=stage, offload_optimizer=False,
                 offload_params=False, tp=1, pp=1)
    mem = estimate_memory(model=shape, dims=dims, strategy=s, batch=BatchSpec(),
                          accounting="paper")
    assert round(mem.model_states / GB, 1) == expected_gb


def test_activation_formula_reproduces_korthikanti() -> None:
    # arXiv:2205.05198 §4: sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP+SP: sbh/t(34+5as/h)
    s, b, h, a = 2048, 4, 12288, 96  # GPT-3 175B
    gpt = {"seq_len": s, "micro_batch": b, "hidden": h, "heads": a, "gated_mlp": False,
           "dropout": True, "fused_attention": False}
    sbh = s * b * h
    assert layer_activation_bytes(**gpt) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert layer_activation_bytes(**gpt, tp=8) == pytest.approx(
        sbh * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert layer_activation_bytes(**gpt, tp=8, sequence_parallel=True) == pytest.approx(
        sbh / 8 * (34 + 5 * a * s / h))
    # Fused attention drops the s² term: far smaller at long sequence length.
    assert layer_activation_bytes(**{**gpt, "fused_attention": True}) < sbh * 40


def test_activation_checkpointing_and_precision() -> None:
    shape = PRESETS["llama2-7b"]
    dims = ParallelDims(nodes=1, gpus_per_node=8)
    s = Strategy(engine="deepspeed", zero_stage=1, offload_optimizer=False, offload_params=False,
                 tp=1, pp=1)

    def acts(**batch) -> int:
        return estimate_memory(model=shape, dims=dims, strategy=s,
                               batch=BatchSpec(seq_len=4096, **batch)).activations

    full, ckpt = acts(), acts(activation_checkpointing=True)
    assert ckpt < full / 5
    # fp32 doubles the bare count: the HF extras and the loss transients measured on a GPU
    # (HF_EXTRA_SBH_16BIT_PARAMS, OUTPUT_SBV_MIXED) are mixed-precision figures.
    bare = activation_bytes(model=shape, batch=BatchSpec(seq_len=4096), dims=dims) \
        - (OUTPUT_SBV_MIXED - 10) * 4096 * shape.vocab_size
    assert acts(precision="fp32") == 2 * bare
    assert full == activation_bytes(model=shape, batch=BatchSpec(seq_len=4096), dims=dims,
                                    extra_sbh=HF_EXTRA_SBH_16BIT_PARAMS)
    assert full - bare == (HF_EXTRA_SBH_16BIT_PARAMS * shape.num_layers * shape.hidden_size
                           + (OUTPUT_SBV_MIXED - 10) * shape.vocab_size) * 4096
    assert acts(micro_batch_size=2) == pytest.approx(2 * full, rel=1e-6)


def test_tp_pp_divide_params() -> None:
    shape = PRESETS["llama2-70b"]
    n, vh = shape.num_params(), shape.vocab_size * shape.hidden_size
    # TP splits the decoder layers only: embedding and lm_head stay whole on every TP rank.
    # TP splits the decoder layers' projections, not their norms.
    h, layers = shape.hidden_size, shape.num_layers
    projections = layers * (shape.attention_params() + shape.mlp_params())
    assert local_params(shape, tp=8) == projections // 8 + layers * 2 * h + 2 * vh + h
    assert n == projections + layers * 2 * h + 2 * vh + h
    assert local_params(shape, pp=4) == pytest.approx(n / 4, rel=0.02)
    assert local_params(shape, tp=8, pp=4) < n / 28


def test_offload_moves_states_to_host() -> None:
    shape = PRESETS["llama2-7b"]
    base = _states(shape, 1, 8, zero_stage=2, offload_optimizer=False)
    off = _states(shape, 1, 8, zero_stage=2, offload_optimizer=True)
    assert off.optimizer == 0 and off.grads == 0 and base.optimizer > 0
    assert off.host_offload_per_node > 0 and base.host_offload_per_node == 0


def test_zero_table_1_in_the_plans_json_and_plan_md() -> None:
    # ZeRO (arXiv:1910.02054) Table 1 row Ψ = 7.5 B, N_d = 64, K = 12, as --json and plan.md
    # report it: model states per GPU as one figure beside params, grads and optimizer states.
    from pipeline.plan import Cluster, plan, render_plan_md

    shape = ModelShape.synthetic(7_500_000_000)
    cluster = Cluster(nodes=8, gpus_per_node=8, host_mem_gb=4096)
    table = {0: "120.00", 1: "31.41", 2: "16.64", 3: "1.88"}  # GB (paper: 120, 31.4, 16.6, 1.9)
    for stage, figure in table.items():
        s = Strategy(engine="deepspeed", zero_stage=stage, offload_optimizer=False,
                     offload_params=False, tp=1, pp=1)
        p = plan(model=shape, cluster=cluster, batch=BatchSpec(seq_len=1024), strategy=s,
                 accounting="paper")
        b = p.as_dict()["per_gpu_bytes"]
        assert b["model_states"] == b["params"] + b["grads"] + b["optimizer"]
        assert f"{b['model_states'] / GB:.2f}" == figure
        assert f"| {figure} |" in render_plan_md(p).split("## Rejected")[0]
