"""``train.compile: true`` (issue 14): every decoder layer compiled with ``torch.compile``
(Inductor's C++ kernels on CPU), the losses of the eager run.

Real ``torchrun`` with 2 CPU processes on gloo, the real trainer, a tiny Llama on test_resume's
tokenized data; fp32, 10 steps, clipping off:

- fsdp and ddp, each compiled and eager: losses within 1e-5 of each other at every step, both
  compiled runs say they compiled both layers on both ranks, and their checkpoints hold exactly
  the eager runs' tensor names (in-place compile: no ``_orig_mod.``), so either resumes the other;
- on CPU ``mfu`` is null in every metrics record and events.jsonl says why, once;
- without a working C++ compiler a compiled run stops before its first step with one line
  naming ``train.compile`` and exit status 2 (a real missing compiler: ``CXX`` names none).
- DeepSpeed ZeRO-3 with compile is refused by ``pipeline.config.schema check`` (exit 2, the reason).

The compiled runs start one after the other: the second finds the first's graph in Inductor's
on-disk cache (the default ``/tmp/torchinductor_<user>``, so a rerun of the test is faster too).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.artifacts import latest_checkpoint, read_events
from tests.conftest import PY, subprocess_env
from tests.test_ddp import BASE, losses, metrics, torchrun
from tests.test_ddp import data_dir as data_dir  # the shared fixture
from tests.test_resume import run_cli

pytestmark = pytest.mark.slow

TRAIN = {**BASE["train"], "checkpoint_every": 10, "keep_last": 1}
RUNS = {
    "fsdp": {},
    "fsdp-compiled": {"train": {"compile": True}},
    "ddp": {"train": {"backend": "ddp"}},
    "ddp-compiled": {"train": {"backend": "ddp", "compile": True}},
    "nocxx": {"cluster": {"gpus_per_node": 1}, "train": {"compile": True}},
    "pp-compiled": {"train": {"compile": True, "pp": 2}},  # one layer per stage
}
COMPILED = "train.compile: 2 decoder layers compiled"


@pytest.fixture(scope="module")
def runs(data_dir) -> tuple[dict[str, Path], dict[str, str]]:
    """Every run rendered; eager runs and the first compiled one together, then the second
    compiled one (its graph is then in the cache). Returns run dirs and each run's stderr."""
    work = data_dir.parent / "compile"
    work.mkdir()
    (work / "config.yaml").write_text(yaml.safe_dump({**BASE, "train": TRAIN, "runs": RUNS}))
    dirs = {name: work / "runs" / name for name in RUNS}
    for name, run_dir in dirs.items():
        run_cli("pipeline.render", "--config", str(work / "config.yaml"), "--run", name,
                "--out", str(run_dir), "--data-manifest", str(data_dir / "manifest.json"))
    stderr, errors = {}, {}
    for batch in (["fsdp", "ddp", "fsdp-compiled"], ["ddp-compiled", "pp-compiled"]):
        procs = {name: torchrun(dirs[name], data_dir, 2) for name in batch}
        for name, proc in procs.items():
            _, stderr[name] = proc.communicate(timeout=900)
            if proc.returncode != 0:
                errors[name] = (proc.returncode, stderr[name][-3000:])
    assert not errors, errors
    return dirs, stderr


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_compiled_losses_equal_eager(runs, backend):
    dirs, stderr = runs
    eager, compiled = losses(dirs[backend]), losses(dirs[f"{backend}-compiled"])
    assert len(eager) == len(compiled) == 10
    diff = max(abs(a - b) for a, b in zip(eager, compiled, strict=True))
    assert diff <= 1e-5, (diff, eager, compiled)
    assert eager[-1] < eager[0] - 0.1  # it trained: the comparison is not of two constants
    # Both ranks compiled both layers; the eager run compiled nothing.
    assert stderr[f"{backend}-compiled"].count(COMPILED) == 2, stderr[f"{backend}-compiled"]
    assert COMPILED not in stderr[backend]


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_compiled_checkpoint_has_the_eager_names(runs, backend):
    from pipeline.checkpoint.tensors import read_dcp_metadata

    dirs, _ = runs
    names = {}
    for name in (backend, f"{backend}-compiled"):
        ckpt = latest_checkpoint(dirs[name])
        assert ckpt is not None and ckpt.name == "step-000010"
        names[name] = set(read_dcp_metadata(ckpt / "dcp").state_dict_metadata)
    assert names[backend] == names[f"{backend}-compiled"]
    assert any(".layers.1.mlp.down_proj.weight" in n for n in names[backend])
    assert not any("_orig_mod" in n for n in names[backend])


def test_mfu_is_null_on_cpu_with_the_reason(runs):
    dirs, _ = runs
    assert all(rec["mfu"] is None for rec in metrics(dirs["fsdp"]).values())
    notes = read_events(dirs["fsdp"], "mfu")
    assert len(notes) == 1 and notes[0]["mfu"] is None
    assert "no MFU on cpu" in notes[0]["reason"]


def test_no_cxx_compiler_is_a_clear_error(runs, data_dir):
    dirs, _ = runs
    env = subprocess_env(CXX=str(dirs["nocxx"] / "no-such-c++"), RANK="0", WORLD_SIZE="1",
                         LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    res = subprocess.run([PY, "-m", "pipeline.train", "worker", "--run-dir", str(dirs["nocxx"]),
                          "--data-dir", str(data_dir)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "train.compile on CPU needs a C++ compiler" in errors[0]
    assert "no-such-c++" in errors[0] and "Traceback" not in res.stderr
    assert not (dirs["nocxx"] / "metrics.jsonl").exists()  # stopped before its first step


def test_zero3_is_refused_before_anything_runs(tmp_path):
    # DeepSpeed's ZeRO-3 parameter gathering is a forward hook torch.compile cannot trace (seen:
    # fullgraph fails on DeepSpeedZeRoOffload's _pre_forward_module_hook): the config says so.
    cfg = {**BASE, "train": {**TRAIN, "backend": "deepspeed", "zero_stage": 3, "compile": True},
           "runs": {"z3": {}}}
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([PY, "-m", "pipeline.config", "check", str(tmp_path / "my.yaml")],
                         cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "train.compile with ZeRO-3" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("name", ["fsdp-compiled", "ddp-compiled", "pp-compiled"])
def test_every_rank_ran_compiled_graphs(runs, name):
    """Dynamo's own count after the first step, gathered from every rank into the ``compile``
    event: a pipeline stage (one decoder layer each here) compiled and ran its layer too."""
    dirs, _ = runs
    events = read_events(dirs[name], "compile")
    assert len(events) == 1 and events[0]["step"] == 1, events
    graphs = events[0]["graphs"]
    assert len(graphs) == 2 and all(g > 0 for g in graphs), graphs
    assert not read_events(dirs["fsdp"], "compile")
