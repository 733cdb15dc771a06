"""The auto ladder, the layout arithmetic and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.errors import PipelineError
from pipeline.plan import PRESETS, BatchSpec, Cluster, ParallelDims, Strategy, plan
from pipeline.plan.__main__ import main
from pipeline.plan.strategy import ladder

BATCH = BatchSpec(seq_len=4096, micro_batch_size=1, grad_accum=8, activation_checkpointing=True)
#: Host RAM of the GPU nodes these cases describe (the config default, cluster.host_mem_gb, is
#: smaller; DeepSpeed's estimators count host RAM even without offload).
HOST_GB = 512
GPU_JOB = ["--engine", "deepspeed", "--gpus-per-node", "8", "--host-mem-gb", str(HOST_GB),
           "--precision", "bf16", "--seq-len", "4096", "--micro-batch", "1"]


def test_llama2_7b_on_8_and_32_gpus_picks_zero1() -> None:
    for nodes in (1, 4):
        p = plan(model=PRESETS["llama2-7b"], cluster=Cluster(nodes=nodes, gpus_per_node=8,
                                                             host_mem_gb=HOST_GB), batch=BATCH)
        assert p.fits
        assert p.strategy.label() == "ZeRO-1"
        # Plain DP (20 bytes/param + activations) was tried first and rejected, with its numbers.
        assert [r.strategy.zero_stage for r in p.rejected] == [0]
        assert "short by" in p.rejected[0].reason
        assert p.rejected[0].memory.total > p.gpu_budget >= p.memory.total


def test_small_gpus_climb_the_ladder_in_order() -> None:
    p = plan(model=PRESETS["llama2-13b"], cluster=Cluster(nodes=1, gpus_per_node=8,
                                                          gpu_mem_gb=24, host_mem_gb=HOST_GB),
             batch=BATCH)
    labels = [r.strategy.label() for r in p.rejected]
    assert labels[:4] == ["DP (ZeRO-0)", "ZeRO-1", "ZeRO-2", "ZeRO-3"][:len(labels[:4])]
    assert p.fits
    totals = [r.memory.total for r in p.rejected]
    assert all(t > p.gpu_budget for t in totals)


def test_70b_on_one_node_needs_offload_or_more() -> None:
    p = plan(model=PRESETS["llama2-70b"], cluster=Cluster(nodes=1, gpus_per_node=8,
                                                          host_mem_gb=2048), batch=BATCH)
    assert p.fits
    assert p.strategy.zero_stage == 3 and p.strategy.offload_optimizer


def test_headroom_changes_the_choice() -> None:
    # 32 GB: ZeRO-3 fits the whole card, not half of it (at 40 GB it fits both since the
    # planner's peak stopped adding gradients and buffers to every activation).
    kw = {"model": PRESETS["llama2-7b"], "cluster": Cluster(nodes=1, gpus_per_node=8,
                                                              gpu_mem_gb=32), "batch": BATCH}
    loose, tight = plan(**kw, headroom=0.0), plan(**kw, headroom=0.5)
    assert len(tight.rejected) > len(loose.rejected)
    assert loose.strategy.label() != tight.strategy.label()


def test_pinned_request_that_does_not_fit_gets_a_suggestion() -> None:
    p = plan(model=PRESETS["llama2-7b"], cluster=Cluster(nodes=1, gpus_per_node=8,
                                                         host_mem_gb=HOST_GB),
             batch=BATCH, strategy=Strategy(zero_stage=0))
    assert not p.fits
    assert p.suggestion is not None and p.suggestion.fits
    assert p.suggestion.strategy.label() == "ZeRO-1"


def test_pinned_stage_keeps_offload_auto() -> None:
    p = plan(model=PRESETS["llama2-13b"], cluster=Cluster(nodes=1, gpus_per_node=8,
                                                          gpu_mem_gb=48, host_mem_gb=1024),
             batch=BATCH, strategy=Strategy(zero_stage=2))
    assert p.strategy.label() == "ZeRO-2 + optimizer offload" and p.fits
    assert [r.strategy.label() for r in p.rejected] == ["ZeRO-2"]


def test_fsdp_ladder() -> None:
    rungs = [s.fsdp_sharding for s in ladder(PRESETS["llama2-7b"], Cluster(nodes=2), "fsdp")]
    assert rungs[:4] == ["NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD"]
    p = plan(model=PRESETS["llama2-7b"], cluster=Cluster(nodes=2), batch=BATCH,
             strategy=Strategy(engine="fsdp"))
    assert p.fits and p.strategy.engine == "fsdp"


def test_tp_candidates_exact() -> None:
    tps = sorted({s.tp for s in ladder(PRESETS["llama2-13b"], Cluster(nodes=2, gpus_per_node=8))})
    assert tps == [1, 2, 4, 8]
    tps = sorted({s.tp for s in ladder(PRESETS["tiny"], Cluster(nodes=1, gpus_per_node=8))})
    assert tps == [1, 2, 4]  # 4 heads
    pps = sorted({s.pp for s in ladder(PRESETS["llama2-13b"], Cluster(nodes=4))})
    assert pps == [1, 2, 4]


def test_parallel_dims_arithmetic() -> None:
    d = ParallelDims(nodes=4, gpus_per_node=8, tp=4, pp=2, micro_batch_size=2, grad_accum=3)
    assert (d.world, d.dp, d.global_batch_size) == (32, 4, 24)
    assert d.deepspeed_batch_world == 4  # pipeline: the grid's DP size
    d = ParallelDims(nodes=4, gpus_per_node=8, tp=2, micro_batch_size=1, grad_accum=2)
    assert d.dp == 16 and d.deepspeed_train_batch_size == 64  # AutoTP counts TP ranks
    with pytest.raises(PipelineError, match=r"cluster\.nodes"):
        ParallelDims(nodes=0, gpus_per_node=8)


def test_invalid_inputs_raise_pipeline_error() -> None:
    with pytest.raises(PipelineError, match=r"train\.micro_batch_size"):
        BatchSpec(micro_batch_size=0)
    with pytest.raises(PipelineError, match=r"train\.zero_stage"):
        Strategy(zero_stage=4)
    with pytest.raises(PipelineError, match=r"train\.precision"):
        BatchSpec(precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="accounting"):
        plan(model=PRESETS["tiny"], cluster=Cluster(), batch=BATCH, accounting="x")  # type: ignore[arg-type]


def test_cli_json(capsys) -> None:
    # The CLI's defaults are the config's (a small CPU run): name the GPU job planned here.
    rc = main(["--model", "llama2-7b", "--nodes", "4", "--grad-accum", "8",
               "--activation-checkpointing", "--json", *GPU_JOB])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["strategy"] == "ZeRO-1"
    b = out["per_gpu_bytes"]
    assert set(b) == {"params", "grads", "optimizer", "model_states", "activations", "buffers",
                      "total"}
    # Model states as one figure beside its parts (the ZeRO paper's Table 1 figure).
    assert b["model_states"] == b["params"] + b["grads"] + b["optimizer"]
    assert out["activation_checkpointing"] is True
    assert out["host_bytes_per_node"] > 0
    assert out["topology"]["world_size"] == 32


def test_cli_params_paper(capsys) -> None:
    rc = main(["--params", "7.5e9", "--nodes", "8", "--zero-stage", "3",
               "--accounting", "paper", "--json", *GPU_JOB, "--seq-len", "1024"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["num_params"] == 7_500_000_000
    b = out["per_gpu_bytes"]
    assert round((b["params"] + b["grads"] + b["optimizer"]) / 1e9, 1) == 1.9


@pytest.mark.parametrize("argv,needle", [
    (["--nodes", "0"], "cluster.nodes"),
    (["--model", "no-such-model"], "preset"),
    (["--model", "llama2-7b", "--tp", "3"], "train.tp"),
    (["--model", "llama2-7b", "--strategy", "FULL_SHARD", "--zero-stage", "2"],
     "train.zero_stage"),
])
def test_cli_invalid_input_exit_2(argv: list[str], needle: str, capsys) -> None:
    try:
        rc = main(argv)
    except SystemExit as exit_:  # an option past its config key's limit: refused as parsed
        rc = exit_.code
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_cli_json_stdout_is_pure_json() -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeline.plan", "--model", "tiny", "--json",
                           "--gpus-per-node", "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == "tiny"


def test_cli_as_module_exit_status() -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeline.plan", "--micro-batch", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "train.micro_batch_size" in proc.stderr


def test_cli_leaves_checkpointing_to_the_planner_unless_told(capsys) -> None:
    # llama2-70b on 4 × 8 GPUs of 80 GB, seq 4096: ZeRO-3 fits only with checkpointing, and the
    # planner takes that before any TP/PP rung (never DeepSpeed's impossible TP × PP).
    job = ["--model", "llama2-70b", "--nodes", "4", "--grad-accum", "16", "--json", *GPU_JOB]
    assert main(job) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["strategy"] == "ZeRO-3 + activation checkpointing"
    assert out["activation_checkpointing"] is True and out["unsupported"] is None
    assert (out["topology"]["tp"], out["topology"]["pp"]) == (1, 1)
    main([*job, "--no-activation-checkpointing"])
    out = json.loads(capsys.readouterr().out)
    assert out["activation_checkpointing"] is False
    assert all(not r["activation_checkpointing"] for r in out["rejected"])
    assert main([*job, "--activation-checkpointing", "--no-activation-checkpointing"]) == 2
