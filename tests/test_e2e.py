"""The whole DAG through the real Snakemake, torchrun (2 CPU processes, gloo), FSDP2 and DeepSpeed.

One small config with four runs (FSDP2 fp32, DeepSpeed ZeRO-2 fp32, FSDP2 bf16, and FSDP2 with
TP 2 × PP 2 on 4 processes, the same global batch) is run once;
the tests then check the artifacts and what Snakemake reruns. Tests in this module run in file
order and share the work directory.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import PY, REPO, subprocess_env

pytestmark = pytest.mark.slow

SMALL = {
    "data": {
        "sources": [{"path": "<stdlib>/[a-f]*.py", "format": "txt"}],
        "tokenizer": {"vocab_size": 512},
        "seq_len": 64,
        "shards": 2,
        "val_fraction": 0.1,
    },
    "model": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
              "max_position_embeddings": 64, "attn_implementation": "eager"},
    "cluster": {"nodes": 1, "gpus_per_node": 2},
    "train": {"micro_batch_size": 8, "max_steps": 60, "warmup_steps": 5, "checkpoint_every": 20,
              "lr": 1e-2},
    "runs": {
        "fsdp": {},
        "ds": {"train": {"backend": "deepspeed", "zero_stage": 2}},
        "bf16": {"train": {"precision": "bf16"}},
        "tppp": {"cluster": {"gpus_per_node": 4}, "train": {"tp": 2, "pp": 2, "grad_accum": 2}},
    },
}


def snakemake(workdir: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--profile",
         str(REPO / "profiles" / "local"), "--configfile", str(workdir / "config.yaml"), *args],
        cwd=workdir, capture_output=True, text=True, env=subprocess_env(), timeout=timeout,
    )


def planned_jobs(workdir: Path) -> dict[str, int]:
    """Rule → job count of what a dry run would execute."""
    res = snakemake(workdir, "-n", "--quiet", "rules")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    counts = {}
    for m in re.finditer(r"^(\w+)\s+(\d+)$", out, re.M):
        if m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


@pytest.fixture(scope="module")
def dag(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("dag")
    (work / "config.yaml").write_text(yaml.safe_dump(SMALL))
    res = snakemake(work)
    if res.returncode != 0:
        logs = "\n".join(
            f"== {p}\n{p.read_text()[-3000:]}" for p in sorted((work / "results" / "logs").rglob("*.log"))
        )
        pytest.fail(f"snakemake failed:\n{res.stderr[-4000:]}\n{logs}")
    return work


@pytest.mark.parametrize("run", ["fsdp", "ds", "tppp"])
def test_consolidated_model_gives_the_trained_logits_fp32(dag, run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rd = dag / "results" / "runs" / run
    probe = load_file(str(rd / "probe_logits.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(rd / "hf", attn_implementation="eager")
    AutoTokenizer.from_pretrained(rd / "hf")  # the tokenizer files load offline too
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    # Same fp32 weights, same eager kernels: the numbers must agree to float32 round-off (TP
    # sums its matmuls in another order: a little more).
    assert torch.allclose(logits, probe["logits"], rtol=0, atol=1e-5 if run != "tppp" else 1e-4), (
        (logits - probe["logits"]).abs().max()
    )


def test_consolidated_model_gives_the_trained_logits_bf16(dag):
    from transformers import AutoModelForCausalLM

    rd = dag / "results" / "runs" / "bf16"
    probe = load_file(str(rd / "probe_logits.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(
        rd / "hf", attn_implementation="eager", dtype=torch.bfloat16
    )
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
    ref = probe["logits"]
    # Training computed in bf16 from the same fp32 master weights: one bf16 rounding step
    # (2^-8 relative) of the logit's magnitude, plus the accumulated rounding of a 2-layer net.
    tol = 2.0**-7 * ref.abs().clamp(min=1.0) + 0.05
    assert ((logits - ref).abs() <= tol).all(), (logits - ref).abs().max()


@pytest.mark.parametrize("run", ["fsdp", "ds", "bf16", "tppp"])
def test_evaluation_perplexity_is_finite_and_well_below_vocab(dag, run):
    m = json.loads((dag / "results" / "runs" / run / "eval" / "metrics.json").read_text())
    assert math.isfinite(m["perplexity"])
    assert m["perplexity"] < m["vocab_size"] / 4, m["perplexity"]
    assert (dag / "results" / "runs" / run / "eval" / "loss.png").stat().st_size > 10_000
    # The batch page (rule report) lists the run (its browser test: tests/test_report_html.py).
    assert f'<tr data-run="{run}">' in (dag / "results" / "report.html").read_text()
    steps = [json.loads(x)["step"] for x in (dag / "results" / "runs" / run / "metrics.jsonl").open()]
    assert steps == list(range(1, 61))
    # The lm-eval harness (in the test extra) ran the built-in held-out task on the HF model.
    harness = m["lm_eval"]
    if importlib.util.find_spec("lm_eval") is None:
        assert "not installed" in harness["skipped"]
    else:
        r = harness["results"]["zerosnake_heldout_continuation"]
        assert 0.0 <= r["acc,none"] <= 1.0 and r["sample_len"] >= 4, harness
        report = (dag / "results" / "runs" / run / "eval" / "report.md").read_text()
        assert "zerosnake_heldout_continuation" in report


def test_fsdp_and_deepspeed_compute_the_same_losses(dag):
    def losses(run):
        path = dag / "results" / "runs" / run / "metrics.jsonl"
        return [json.loads(x)["loss"] for x in path.open()]

    a, b = losses("fsdp"), losses("ds")
    assert max(abs(x - y) for x, y in zip(a[:20], b[:20], strict=True)) < 1e-5
    # TP × PP takes the same steps on the same global batch (AdamW magnifies TP's reordered sums).
    c = losses("tppp")
    assert max(abs(x - y) / y for x, y in zip(a[:20], c[:20], strict=True)) < 1e-3


def test_deleting_evaluation_reruns_only_evaluate(dag):
    metrics = dag / "results" / "runs" / "fsdp" / "eval" / "metrics.json"
    done = dag / "results" / "runs" / "fsdp" / "train.done"
    before = done.stat().st_mtime_ns
    metrics.unlink()
    assert planned_jobs(dag) == {"evaluate": 1, "report": 1, "all": 1}
    res = snakemake(dag)
    assert res.returncode == 0, res.stderr
    assert metrics.is_file()
    assert done.stat().st_mtime_ns == before


def test_changing_one_runs_lr_retrains_only_that_run(dag):
    cfg = yaml.safe_load((dag / "config.yaml").read_text())
    cfg["runs"]["ds"] = {"train": {"backend": "deepspeed", "zero_stage": 2, "lr": 1e-3}}
    (dag / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert planned_jobs(dag) == {"render": 1, "train": 1, "consolidate": 1, "evaluate": 1,
                                 "report": 1, "all": 1}
    manifest = dag / "results" / "data" / "manifest.json"
    fsdp_done = dag / "results" / "runs" / "fsdp" / "train.done"
    stamps = (manifest.stat().st_mtime_ns, fsdp_done.stat().st_mtime_ns)
    res = snakemake(dag)
    assert res.returncode == 0, res.stderr
    assert (manifest.stat().st_mtime_ns, fsdp_done.stat().st_mtime_ns) == stamps
    rendered = json.loads((dag / "results" / "runs" / "ds" / "ds_config.json").read_text())
    assert rendered["optimizer"]["params"]["lr"] == 1e-3
    # The old checkpoints belonged to another experiment: retired, and training restarted at 1.
    events = [json.loads(x) for x in (dag / "results" / "runs" / "ds" / "events.jsonl").open()]
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 2 and starts[-1]["resumed_from"] == 0
    assert list((dag / "results" / "runs" / "ds").glob("checkpoints.old-*"))


def test_killed_training_resumes_from_last_checkpoint(tmp_path):
    cfg = yaml.safe_load(yaml.safe_dump(SMALL))
    cfg["runs"] = {"fsdp": {}}
    cfg["train"].update(max_steps=80, checkpoint_every=10)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    metrics = tmp_path / "results" / "runs" / "fsdp" / "metrics.jsonl"
    proc = subprocess.Popen(
        [PY, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--profile",
         str(REPO / "profiles" / "local"), "--configfile", str(tmp_path / "config.yaml")],
        cwd=tmp_path, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 25:
                break
            assert proc.poll() is None, "snakemake ended before training got to step 25"
            time.sleep(0.2)
        else:
            pytest.fail("training never reached step 25")
    finally:
        # Kill the rule for real: Snakemake, the launcher, submitit's task, torchrun and the
        # ranks (Snakemake starts jobs in their own sessions, so a process-group kill is not it).
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            p.send_signal(signal.SIGKILL)
        proc.wait()
        psutil.wait_procs(tree, timeout=30)
    killed_at = len(metrics.read_text().splitlines())
    assert killed_at < 80

    assert snakemake(tmp_path, "--unlock").returncode == 0  # a SIGKILLed Snakemake leaves its lock
    res = snakemake(tmp_path)
    assert res.returncode == 0, res.stderr
    recs = [json.loads(x) for x in metrics.open()]
    second = [r["step"] for r in recs if r["attempt"] == 2]
    resumed_from = second[0] - 1
    assert resumed_from >= 10 and resumed_from % 10 == 0, second[:3]
    assert resumed_from <= killed_at
    assert second == list(range(resumed_from + 1, 81))
    done = json.loads((tmp_path / "results" / "runs" / "fsdp" / "train.done").read_text())
    assert done["step"] == 80
