"""TP × PP × DP in the planner: the per-rank parameter count (THE stage split), the ladder's
rungs against the engines' own rules, and the llama2-70b 4 × 8 plan in the engines' own parsers
at world size 32. Pure arithmetic and config parsing: no process group, no GPU."""

from __future__ import annotations

import copy
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.config.files import parse_config, parse_run_config
from pipeline.config.schema import TrainConfig
from pipeline.errors import PipelineError
from pipeline.plan import PRESETS, BatchSpec, Cluster, ModelShape, ParallelDims, Strategy, plan
from pipeline.plan.run import render_run
from pipeline.plan.strategy import ladder
from pipeline.plan.topology import layer_params_per_tp_rank, params_per_rank, stage_layers
from pipeline.train.parallel import mesh_layout, parallel_dims
from pipeline.train.tp import COLWISE, ROWWISE

REPO = Path(__file__).resolve().parent.parent

# -- the stage split -------------------------------------------------------------------------------


def test_stage_layers_is_contiguous_and_front_loaded() -> None:
    assert stage_layers(4, 1) == [range(0, 4)]
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(80, 4) == [range(0, 20), range(20, 40), range(40, 60), range(60, 80)]
    # Uneven: the first num_layers % pp stages get one more layer.
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert stage_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    for layers in range(1, 30):
        for pp in range(1, layers + 1):
            split = stage_layers(layers, pp)
            assert [i for r in split for i in r] == list(range(layers))
            assert max(map(len, split)) - min(map(len, split)) <= 1


def test_deepspeed_pipeline_partition_follows_the_same_rule() -> None:
    # PipelineModule(partition_method="type:...") weighs the decoder layers 1 and the embedding
    # and head modules 0, then calls partition_balanced: the same blocks as stage_layers.
    from deepspeed.runtime.utils import partition_balanced

    for layers in range(1, 25):
        for pp in range(1, layers + 1):
            bounds = partition_balanced([0] + [1] * layers + [0], pp)
            theirs = [range(max(0, bounds[s] - 1), min(layers, bounds[s + 1] - 1))
                      for s in range(pp)]
            assert theirs == stage_layers(layers, pp), (layers, pp)


def test_stage_layers_refuses_empty_stages() -> None:
    with pytest.raises(PipelineError, match=r"train\.pp: PP=3 exceeds the model's 2 layers"):
        stage_layers(2, 3)
    with pytest.raises(PipelineError, match=r"train\.pp"):
        stage_layers(2, 0)


# -- parameters per (stage, tp rank) ---------------------------------------------------------------
#: The multi-process tests' tiny Llama (tests/test_ddp.py BASE and friends): hidden 64, 4 heads,
#: intermediate 64; 4 layers so that pp 2 and 4 (and an uneven 3) have something to split.
VOCAB = 384
TINY = ModelShape(name="tiny-test", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                  num_layers=4, num_heads=4, num_kv_heads=4)


def test_hand_count_of_the_tiny_test_model() -> None:
    h, v = 64, VOCAB
    # q, k, v, o: 64 × 64 each; gate, up, down: 64 × 64 each; two norms of 64.
    layer = 4 * h * h + 3 * h * h + 2 * h
    assert layer == 28_800 == layer_params_per_tp_rank(TINY)
    # TP 2: every projection halves (q/k/v/gate/up by rows, o/down by columns), norms stay.
    assert layer_params_per_tp_rank(TINY, 2) == 7 * h * h // 2 + 2 * h == 14_464
    assert params_per_rank(TINY) == {(0, 0): 4 * layer + v * h + h + v * h}
    assert params_per_rank(TINY, tp=2, pp=2) == {
        (0, 0): 2 * 14_464 + v * h, (0, 1): 2 * 14_464 + v * h,
        (1, 0): 2 * 14_464 + h + v * h, (1, 1): 2 * 14_464 + h + v * h}
    # Uneven: 3 stages of 2, 1, 1 layers.
    assert params_per_rank(TINY, pp=3) == {
        (0, 0): 2 * layer + v * h, (1, 0): layer, (2, 0): layer + h + v * h}


def _hf_model(shape: ModelShape) -> torch.nn.Module:
    kwargs = shape.to_hf_config()
    kwargs.pop("model_type")
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**kwargs))


def _engine_rule(model: torch.nn.Module, shape: ModelShape, tp: int,
                 pp: int) -> dict[tuple[int, int], int]:
    """Each HF parameter's local size under the trainer's DTensor plan (pipeline/train/tp.py:
    COLWISE split on dim 0, weight and bias; ROWWISE weights on dim 1, bias whole; the rest
    whole), put on the stage that owns it by stage_layers."""
    owner = {i: s for s, r in enumerate(stage_layers(shape.num_layers, pp)) for i in r}
    out: dict[tuple[int, int], int] = {}
    for name, p in model.named_parameters():
        if name.startswith("model.layers."):
            index, sub = name.split(".")[2], ".".join(name.split(".")[3:])
            stage, module = owner[int(index)], sub.rsplit(".", 1)[0]
            if module in COLWISE or (module in ROWWISE and sub.endswith(".weight")):
                dim = 0 if module in COLWISE else 1
                assert p.shape[dim] % tp == 0
                local = p.numel() // tp
            else:
                local = p.numel()
        else:
            stage = 0 if "embed_tokens" in name else pp - 1
            local = p.numel()
        for r in range(tp):
            out[(stage, r)] = out.get((stage, r), 0) + local
    return out


@pytest.mark.parametrize("variant", [
    {}, {"num_kv_heads": 2}, {"attention_bias": True, "mlp_bias": True},
    {"num_layers": 5, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 96},
])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 3), (2, 4)])
def test_params_per_rank_equals_the_engine_split(variant: dict, tp: int, pp: int) -> None:
    shape = ModelShape(**{**TINY.__dict__, **variant})
    model = _hf_model(shape)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()
    if shape.num_kv_heads % tp:
        with pytest.raises(PipelineError, match=r"train\.tp: TP=4 does not divide .* KV heads"):
            params_per_rank(shape, tp=tp, pp=pp)
        return
    ours = params_per_rank(shape, tp=tp, pp=pp)
    assert ours == _engine_rule(model, shape, tp, pp)
    assert sum(ours[(s, 0)] for s in range(pp)) * tp >= shape.num_params()
    if tp == 1:
        assert sum(ours.values()) == shape.num_params()


def test_params_per_rank_refuses_tied_embeddings_with_a_pipeline() -> None:
    tied = ModelShape(**{**TINY.__dict__, "tie_word_embeddings": True})
    assert params_per_rank(tied) == {(0, 0): tied.num_params()}
    with pytest.raises(PipelineError, match=r"model\.tie_word_embeddings: false"):
        params_per_rank(tied, pp=2)


# -- the ladder only holds what the engines train --------------------------------------------------
BF16 = BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=16, precision="bf16",
                 activation_checkpointing=None)
CLUSTERS = [Cluster(nodes=1, gpus_per_node=8, host_mem_gb=512),
            Cluster(nodes=4, gpus_per_node=8, host_mem_gb=512)]


def _config_accepts(p) -> None:
    """The config's own validator (TrainConfig: the engines' rules) accepts the chosen rung."""
    TrainConfig(backend=p.strategy.engine, precision="bf16", grad_accum=p.dims.grad_accum,
                pp_schedule=p.strategy.pp_schedule, **p.train_settings())


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp", "ddp"])
@pytest.mark.parametrize("model", ["llama2-13b", "llama2-70b"])
def test_every_rung_is_one_the_engine_trains(engine: str, model: str) -> None:
    for cluster in CLUSTERS:
        rungs = ladder(PRESETS[model], cluster, engine, pinned=True)
        for s in rungs:
            assert s.unsupported() is None, s.label()
            p = plan(model=PRESETS[model], cluster=cluster, batch=BF16, strategy=s)
            assert p.strategy == s and p.unsupported is None
            _config_accepts(p)
        if engine == "deepspeed":
            assert not any((s.tp or 1) > 1 and (s.pp or 1) > 1 for s in rungs)
            assert not any((s.tp or 1) > 1 and s.zero_stage == 3 for s in rungs)
            assert not any((s.pp or 1) > 1 and s.zero_stage > 1 for s in rungs)
        if engine == "fsdp" and cluster.nodes == 4:
            assert any((s.tp or 1) > 1 and (s.pp or 1) > 1 for s in rungs)


def test_checkpointing_comes_before_tp_and_pp() -> None:
    # A DP rung that fits only with checkpointing is chosen before any TP or PP rung.
    for engine in ("deepspeed", "fsdp"):
        p = plan(model=PRESETS["llama2-70b"], cluster=CLUSTERS[1], batch=BF16,
                 strategy=Strategy(engine=engine))
        assert p.fits and p.batch.activation_checkpointing is True
        assert (p.dims.tp, p.dims.pp) == (1, 1)
        assert all((r.dims.tp, r.dims.pp) == (1, 1) for r in p.rejected)
        assert any(not r.activation_checkpointing and r.strategy == p.strategy
                   for r in p.rejected)  # the same rung without it was tried first
        assert p.chosen.label().endswith("+ activation checkpointing")
        assert "chosen by the planner" in " ".join(p.notes)
        assert p.train_settings()["activation_checkpointing"] is True
    # Pinned off: TP/PP is the way, and plan.md says what checkpointing would have done.
    off = plan(model=PRESETS["llama2-70b"], cluster=CLUSTERS[1],
               batch=BatchSpec(**{**BF16.__dict__, "activation_checkpointing": False}),
               strategy=Strategy(engine="fsdp"))
    assert not off.batch.activation_checkpointing
    assert any("train.activation_checkpointing is false: with it" in n for n in off.notes)


def test_ladder_notes_say_why_rungs_were_skipped() -> None:
    p = plan(model=PRESETS["llama2-70b"], cluster=CLUSTERS[1], batch=BF16,
             strategy=Strategy(zero_stage=2))
    assert p.dims.tp > 1 and p.dims.pp == 1
    text = " ".join(p.notes)
    assert "DeepSpeed cannot combine AutoTP with its PipelineModule" in text
    assert "train.backend=fsdp runs TP × PP × DP" in text


# -- llama2-70b on 4 × 8 GPUs of 80 GB, seq 4096: rendered, then parsed by the engines ----------------
DEFAULT = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
WORLD = 32


def _run(train: dict, gpu_mem_gb: float = 80, host_mem_gb: float = 512):
    raw = copy.deepcopy(DEFAULT)
    raw["model"] = {"preset": "llama2-70b"}
    raw["data"]["seq_len"] = 4096
    raw["cluster"] = {"nodes": 4, "gpus_per_node": 8, "gpu_mem_gb": gpu_mem_gb,
                      "host_mem_gb": host_mem_gb}
    raw["train"] = {"precision": "bf16", "micro_batch_size": 1, "grad_accum": 16,
                    "activation_checkpointing": True, "lr": 3e-4, "warmup_steps": 100,
                    "max_steps": 1000, **train}
    raw["runs"] = {"r": {}}
    return parse_config(raw).run("r")


def _deepspeed_parse(ds_config: dict, *, dp_grid: int | None):
    """DeepSpeed's own config parser at world size 32, without a process group: its world size
    comes from ``dist.get_world_size`` (patched), or, for a pipeline, from the grid the
    PipelineEngine passes as ``mpu``."""
    import deepspeed.runtime.config as ds_config_module

    class GridMPU:
        def get_data_parallel_world_size(self) -> int:
            return dp_grid

    dist = ds_config_module.dist
    with mock.patch.object(dist, "get_rank", return_value=0), \
            mock.patch.object(dist, "get_world_size", return_value=WORLD):
        return ds_config_module.DeepSpeedConfig(copy.deepcopy(ds_config),
                                                mpu=GridMPU() if dp_grid else None)


@pytest.mark.parametrize("train,cluster", [
    ({"backend": "deepspeed", "strategy": "auto"}, (80, 512)),         # ZeRO-3, data parallel
    ({"backend": "deepspeed", "zero_stage": 2, "tp": 8}, (80, 512)),   # AutoTP
    # PipelineModule: ZeRO-1 keeps 16-bit weights and gradients whole per stage, which 80 GB
    # does not hold for 70 B over 4 stages; H200 nodes (141 GB, 2 TB host) do.
    ({"backend": "deepspeed", "zero_stage": 1, "pp": 4}, (141, 2048)),
])
def test_rendered_70b_ds_config_loads_in_deepspeed_at_world_32(
        train: dict, cluster: tuple[float, float]) -> None:
    files = render_run(_run(train, *cluster), vocab_size=32000)
    run = parse_run_config(files["config.json"])
    topo, t = files["topology.json"], run.train
    assert topo["world_size"] == WORLD and (topo["tp"], topo["pp"]) == (t.tp, t.pp)
    ds = _deepspeed_parse(files["ds_config.json"], dp_grid=topo["dp"] if t.pp > 1 else None)
    micro, gas, dp = t.micro_batch_size, t.grad_accum, topo["dp"]
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (micro, gas)
    # DeepSpeed's batch is micro × gas × its world: the data-parallel ranks — and, with AutoTP
    # (no mpu), the TP ranks too, which read the same sequences.
    assert ds.train_batch_size == micro * gas * dp * (t.tp if t.pp == 1 else 1)
    assert topo["global_batch_size"] == micro * gas * dp
    assert ds.zero_optimization_stage == t.zero_stage
    assert (t.tp > 1) == ("tensor_parallel" in files["ds_config.json"])
    assert (t.pp > 1) == ("pipeline" in files["ds_config.json"])


def test_rendered_70b_3d_fsdp_plan_builds_the_trainer_mesh_at_world_32() -> None:
    files = render_run(_run({"backend": "fsdp", "tp": 4, "pp": 4}), vocab_size=32000)
    run = parse_run_config(files["config.json"])
    dims = parallel_dims(run)  # the trainer's layout from the rendered config
    assert (dims.world, dims.tp, dims.pp, dims.dp) == (WORLD, 4, 4, 2)
    names, shape = mesh_layout(dims, run.train.fsdp_sharding)
    assert files["fsdp.json"]["mesh"] == {"dim_names": list(names), "shape": list(shape)}
    assert names == ("pp", "dp_shard", "tp") and shape == (4, 2, 4)
    assert files["plan.json"]["fits"] and files["plan.json"]["unsupported"] is None
    b = files["plan.json"]["per_gpu_bytes"]
    assert b["model_states"] == b["params"] + b["grads"] + b["optimizer"]


def test_deepspeed_tp_with_pp_is_refused_before_anything_is_queued() -> None:
    with pytest.raises(PipelineError, match=r"train\.backend"):
        render_run(_run({"backend": "deepspeed", "zero_stage": 1, "tp": 4, "pp": 4}),
                   vocab_size=32000)
    p = plan(model=PRESETS["llama2-70b"], cluster=CLUSTERS[1], batch=BF16,
             strategy=Strategy(zero_stage=1, tp=4, pp=4))
    assert "train.backend=fsdp" in (p.unsupported or "")
    assert p.suggestion is not None and p.suggestion.strategy.unsupported() is None


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_auto_for_70b_on_4x8_picks_a_rung_the_engine_trains(engine: str) -> None:
    p = plan(model=PRESETS["llama2-70b"], cluster=Cluster(nodes=4, gpus_per_node=8,
                                                          host_mem_gb=512),
             batch=BF16, strategy=Strategy(engine=engine))
    assert p.fits and p.unsupported is None
    _config_accepts(p)
    dims = ParallelDims(nodes=4, gpus_per_node=8, tp=p.dims.tp, pp=p.dims.pp)
    mesh_layout(dims, p.strategy.fsdp_sharding or "FULL_SHARD")  # a valid layout at world 32
