"""Tensor and pipeline parallelism on the deepspeed backend (issue 11): AutoTP and
``PipelineModule``, the real trainer.

Real ``torchrun`` on gloo (CPU), the render stage and the worker, test_ddp's tokenized data and
tiny Llama (2 layers, 4 heads). All runs start together so that their start-up costs overlap
(DeepSpeed's start-up is slow and erratic under load):

- ``dsdp``: pure data parallelism with ZeRO-1, 2 processes × micro 4 × accumulation 2 (global
  batch 16);
- ``autotp``: ``train.tp: 2`` (AutoTP) on 2 processes, micro 8 × accumulation 2: the same
  global batch, so the same sequences per step (both TP ranks read the whole batch);
- ``dspp``: ``train.pp: 2`` (a ``PipelineModule`` of 2 stages), micro 8 × accumulation 2 (the
  step's micro batches flow through the pipeline): the same again;
- ``dspp0``: the same pipeline without ZeRO (DeepSpeed then clips with its own
  ``clip_grad_norm_``, whose norm covers every stage only because ``ds_pipe`` marks the
  parameters; its checkpoint keeps the weights in the ``layer_XX`` files only);
- ``dsppstop``: the ``dspp`` run stopped by a STOP file after a few steps (per-layer and
  per-stage checkpoint files) and resumed on the same layout: the uninterrupted run's losses.

Gradient clipping at 0.3 acts (DeepSpeed's own default of 1.0 would act differently: the
rendered ``gradient_clipping`` is train.grad_clip). Losses equal the DP run's within 1e-4
relative (the issue asks 1e-3 with AdamW, which magnifies the changed reduction order; seen
here: 1.6e-7); each checkpoint consolidates into a directory whose ``from_pretrained`` model
gives the engine's probe logits. Render checks and the pipeline layers against HF's own
forward and loss (no processes) close the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import consolidated_probe
from tests.test_ddp import (  # noqa: F401
    BASE,
    STEPS,
    data_dir,
    losses,
    max_rel,
    metrics,
    resume,
    train_together,
)
from tests.test_tp import consumed

TRAIN = {**BASE["train"], "backend": "deepspeed", "zero_stage": 1, "grad_clip": 0.3,
         "record_samples": True}
PP = {"train": {"pp": 2, "micro_batch_size": 8}}
RUNS = {
    "dsdp": {},
    "autotp": {"train": {"tp": 2, "micro_batch_size": 8}},
    "dspp": PP,
    "dspp0": {"train": {**PP["train"], "zero_stage": 0}},
    "dsppstop": PP,
}
NPROC = dict.fromkeys(RUNS, 2)
#: Stopped after a few steps, then resumed on the same layout.
STOPPED = ("dsppstop",)
#: DeepSpeed's start-up took up to ~5 minutes on a loaded 2-core machine.
TIMEOUT = 900


@pytest.fixture(scope="module")
def runs(data_dir) -> dict[str, Path]:  # noqa: F811
    cfg = {**BASE, "train": TRAIN, "runs": RUNS}
    dirs = train_together(data_dir, cfg, "ds-parallel", NPROC, STOPPED, timeout=TIMEOUT)
    for name in STOPPED:
        resume(dirs[name], data_dir, NPROC[name], timeout=TIMEOUT)
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["autotp", "dspp", "dspp0"])
def test_losses_equal_pure_dp_with_the_same_global_batch(runs, name):
    dp = losses(runs["dsdp"])
    assert all(math.isfinite(x) for x in dp) and dp[-1] < dp[0]
    assert max_rel(losses(runs[name]), dp) < 1e-4
    if name == "dspp0":  # DeepSpeed reports no gradient norm without ZeRO (null → NaN)
        return
    # The clipped gradient norm is the global one (over TP shards, over pipeline stages).
    norms = [r["grad_norm"] for r in metrics(runs[name]).values()]
    ref = [r["grad_norm"] for r in metrics(runs["dsdp"]).values()]
    assert max_rel(norms, ref) < 1e-2
    assert ref[0] > TRAIN["grad_clip"]  # clipping really acted
    # The same sequences every step as the pure-DP run; both TP ranks (both stages) read the
    # same batch.
    assert consumed(runs[name], 2, 2) == consumed(runs["dsdp"], 2, 1)
    manifest = json.loads(
        (runs[name] / "checkpoints" / "step-000010" / "manifest.json").read_text())
    assert manifest["backend"] == "deepspeed" and manifest["world_size"] == 2


@pytest.mark.slow
def test_stopped_pipeline_run_resumes_with_the_uninterrupted_losses(runs):
    ref, got = metrics(runs["dspp"]), metrics(runs["dsppstop"])
    assert list(got) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "lr", "grad_norm"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-6), (step, key)
    assert {r["attempt"] for r in got.values()} == {1, 2}
    assert consumed(runs["dsppstop"], 2, 2) == consumed(runs["dspp"], 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dsdp", "autotp", "dspp", "dspp0"])
def test_checkpoint_consolidates_to_the_engine_logits(runs, data_dir, name):  # noqa: F811
    model, logits, probe = consolidated_probe(runs[name], data_dir,
                                              data_dir.parent / f"hf-{name}")
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (32, 32)
    assert torch.allclose(logits, probe["logits"], rtol=1e-4, atol=1e-5), (
        (logits - probe["logits"]).abs().max())


# -- render and the pipeline's layers (no processes) ---------------------------------------------


def _rendered(**train):
    from pipeline.config.files import parse_run_config
    from pipeline.plan.run import render_run

    run = parse_run_config({**BASE, "name": "r", "train": {**TRAIN, **train}})
    return run, render_run(run, vocab_size=384)["ds_config.json"]


def test_render_writes_the_keys_deepspeed_reads_for_autotp_and_pipelines():
    from pipeline.plan.deepspeed_config import PIPELINE_ENGINE_KEYS
    from pipeline.plan.preflight import validate_ds_config

    # AutoTP: DeepSpeed's batch check counts the TP ranks (micro × accumulation × world).
    run, cfg = _rendered(tp=2, micro_batch_size=8)
    assert cfg["tensor_parallel"] == {"autotp_size": 2} and "pipeline" not in cfg
    assert cfg["train_batch_size"] == 8 * 2 * 2 and run.global_batch_size == 16
    assert validate_ds_config(cfg, world_size=2) == []
    # PipelineModule: stages are a constructor argument; the batch check uses the pipeline
    # grid's data-parallel size (1 here).
    run, cfg = _rendered(pp=2, micro_batch_size=8)
    assert set(cfg["pipeline"]) <= set(PIPELINE_ENGINE_KEYS) and "tensor_parallel" not in cfg
    assert cfg["train_batch_size"] == 8 * 2 * 1 == run.global_batch_size
    assert validate_ds_config(cfg, world_size=2, data_parallel_size=1) == []
    # DeepSpeed clips at 1.0 when the key is absent: it is always written, from train.grad_clip.
    for layout in ({"tp": 2}, {"pp": 2}, {}):
        assert _rendered(grad_clip=0.0, **layout)[1]["gradient_clipping"] == 0.0


def test_pipeline_layers_compute_hf_logits_and_loss():
    """The wrappers, run in order, are the HF model's forward; the loss is HF's ``labels=``."""
    from pipeline.config.schema import ModelConfig
    from pipeline.model.build import build_model
    from pipeline.train.ds_pipe import DecoderPipe, EmbedPipe, HeadPipe, causal_lm_loss

    model = build_model(ModelConfig(**BASE["model"]), vocab_size=384, eos_id=0, bos_id=None,
                        seed=0)
    model.eval()
    ids = torch.randint(0, 384, (3, 32), generator=torch.Generator().manual_seed(0))
    inner = model.model
    layers = [EmbedPipe(inner.embed_tokens)]
    layers += [DecoderPipe(layer, inner.rotary_emb, eager=True) for layer in inner.layers]
    layers.append(HeadPipe(inner.norm, model.lm_head))
    with torch.no_grad():
        x = ids
        for layer in layers:
            x = layer(x)
        ref = model(input_ids=ids, labels=ids)
    assert torch.allclose(x, ref.logits, rtol=1e-5, atol=1e-6)
    assert causal_lm_loss(x, ids).item() == pytest.approx(ref.loss.item(), rel=1e-6)
