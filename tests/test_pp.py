"""Pipeline parallelism on the fsdp backend (issue 11): ``torch.distributed.pipelining`` stages
× DTensor TP × FSDP2, the real trainer under ``torchrun`` on gloo (CPU).

test_ddp's tokenized data and tiny Llama (2 decoder layers: one per stage). Every run has the
global batch of the pure-DP reference (16 sequences a step) and starts together with the others
so their start-up costs overlap:

- ``dp``: pure data parallelism, 2 processes × micro 4 × accumulation 2;
- ``gpipe`` / ``onef1b``: pp 2 on 2 processes (dp 1), micro 4 × 4 micro batches per step;
- ``tppp``: tp 2 × pp 2 on 4 processes (dp 1), micro 4 × 4;
- ``tpppdp``: tp 2 × pp 2 × dp 2 on 8 processes, micro 4 × 2;
- ``ppstop``: the ``onef1b`` run stopped by a STOP file after a few steps, re-rendered as pure
  DP (pp 1, dp 2) and resumed: the losses of an uninterrupted run.

Losses within 1e-3 relative of the DP run (AdamW; gradient clipping at 0.3 acts, so the norm
summed over stages must be the global one), the same sequences each step, the per-rank
parameter counts the planner predicts, and consolidation of a pipeline checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

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
from tests.test_resume import run_cli
from tests.test_tp import consumed

TRAIN = {**BASE["train"], "grad_clip": 0.3, "record_samples": True}
PP = {"train": {"pp": 2, "grad_accum": 4}}
RUNS = {
    "dp": {},
    "gpipe": {"train": {"pp": 2, "grad_accum": 4, "pp_schedule": "gpipe"}},
    "onef1b": PP,
    "tppp": {"cluster": {"gpus_per_node": 4}, "train": {"tp": 2, "pp": 2, "grad_accum": 4}},
    "tpppdp": {"cluster": {"gpus_per_node": 8}, "train": {"tp": 2, "pp": 2}},
    "ppstop": PP,
}
NPROC = {"dp": 2, "gpipe": 2, "onef1b": 2, "tppp": 4, "tpppdp": 8, "ppstop": 2}
#: (tp, pp) of each run, for the sample audit and the parameter counts.
LAYOUT = {"dp": (1, 1), "gpipe": (1, 2), "onef1b": (1, 2), "tppp": (2, 2), "tpppdp": (2, 2),
          "ppstop": (1, 2)}


def consumed_pp(run_dir: Path, nproc: int, tp: int, pp: int) -> dict[int, list[int]]:
    """The sequences the data-parallel ranks consumed per step; every stage read the same."""
    per_stage = nproc // pp
    first = consumed(run_dir, per_stage, tp)
    for stage in range(1, pp):
        for rank in range(per_stage):
            a = (run_dir / f"samples-rank{rank:05d}.jsonl").read_text()
            b = (run_dir / f"samples-rank{stage * per_stage + rank:05d}.jsonl").read_text()
            assert a == b, f"stage {stage} read another batch than stage 0"
    return first


@pytest.fixture(scope="module")
def runs(data_dir) -> dict[str, Path]:  # noqa: F811
    work = data_dir.parent
    cfg = {**BASE, "train": TRAIN, "runs": RUNS}
    dirs = train_together(data_dir, cfg, "pp-runs", NPROC, ("ppstop",), timeout=900)
    stop = dirs["ppstop"]
    # pp 2 → pp 1: the same run re-rendered as pure data parallelism (dp 2, micro 4 × 2).
    (work / "pp-config-dp.yaml").write_text(yaml.safe_dump({**cfg, "runs": {"ppstop": {}}}))
    run_cli("pipeline.render", "--config", str(work / "pp-config-dp.yaml"), "--run", "ppstop",
            "--out", str(stop), "--data-manifest", str(data_dir / "manifest.json"))
    resume(stop, data_dir, 2)
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe", "onef1b", "tppp", "tpppdp"])
def test_pipeline_losses_equal_pure_dp_with_the_same_global_batch(runs, name):
    dp = losses(runs["dp"])
    assert all(math.isfinite(x) for x in dp) and dp[-1] < dp[0]
    assert max_rel(losses(runs[name]), dp) < 1e-3
    # The clipped gradient norm summed over the stages (and TP meshes) is the global one.
    norms = [r["grad_norm"] for r in metrics(runs[name]).values()]
    ref = [r["grad_norm"] for r in metrics(runs["dp"]).values()]
    assert max_rel(norms, ref) < 1e-2
    assert ref[0] > TRAIN["grad_clip"]  # clipping really acted
    tp, pp = LAYOUT[name]
    assert consumed_pp(runs[name], NPROC[name], tp, pp) == consumed(runs["dp"], 2, 1)


@pytest.mark.slow
def test_pipeline_without_tp_matches_dp_closely(runs):
    """Pipelining alone changes no summation inside a matmul: much closer than TP's 1e-3."""
    for name in ("gpipe", "onef1b"):
        assert max_rel(losses(runs[name]), losses(runs["dp"])) < 1e-5, name


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_as_pure_data_parallel(runs):
    got = metrics(runs["ppstop"])
    assert list(got) == list(range(1, STEPS + 1))
    assert {r["attempt"] for r in got.values()} == {1, 2}
    first = min(s for s, r in got.items() if r["attempt"] == 2)
    assert first > 3  # resumed from its checkpoint, not from step 1
    assert max_rel(losses(runs["ppstop"]), losses(runs["onef1b"])) < 1e-5
    assert max_rel(losses(runs["ppstop"]), losses(runs["dp"])) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["onef1b", "tpppdp"])
def test_pipeline_checkpoint_consolidates_to_the_engine_logits(runs, data_dir, name):  # noqa: F811
    model, logits, probe = consolidated_probe(runs[name], data_dir, data_dir.parent / f"hf-{name}")
    assert model.model.layers[1].self_attn.q_proj.weight.shape == (32, 32)
    assert torch.allclose(logits, probe["logits"], rtol=1e-4, atol=1e-5), (
        (logits - probe["logits"]).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp", "onef1b", "tppp", "tpppdp"])
def test_each_rank_holds_the_parameters_the_planner_counts(runs, name):
    """The planner's per-rank count (stage × TP share, before DP sharding) equals what the real
    engine's ranks hold: the local shards of one (stage, TP rank) summed over its DP ranks."""
    from pipeline.config.files import load_run_config
    from pipeline.plan.run import planner_inputs
    from pipeline.plan.topology import params_per_rank

    events = map(json.loads, (runs[name] / "events.jsonl").read_text().splitlines())
    start = next(e for e in events if e["event"] == "start")
    tp, pp = LAYOUT[name]
    assert (start["tp"], start["pp"]) == (tp, pp)
    shards, dp = start["param_shards"], start["dp"]
    assert len(shards) == NPROC[name] == tp * pp * dp
    run = load_run_config(runs[name] / "config.json")
    done = json.loads((runs[name] / "train.done").read_text())
    model = planner_inputs(run, vocab_size=vocab_size(runs[name]))["model"]
    want = params_per_rank(model, tp=tp, pp=pp)
    got: dict[tuple[int, int], int] = {}
    for rank, n in enumerate(shards):
        key = (rank // (dp * tp), rank % tp)
        got[key] = got.get(key, 0) + n
    assert got == want
    if tp == 1:  # nothing replicated: the stages add up to the whole model
        assert sum(shards) == done["params"]


def vocab_size(run_dir: Path) -> int:
    """The model's vocabulary: the width of the probe's logits."""
    from safetensors import safe_open

    with safe_open(str(run_dir / "probe_logits.safetensors"), "pt") as f:
        return f.get_slice("logits").get_shape()[-1]
