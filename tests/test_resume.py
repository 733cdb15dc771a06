"""Kill a rank anywhere, resume, and get exactly the uninterrupted run's weights and data order.

Real torchrun with 2 CPU processes on gloo, the real FSDP2 / DeepSpeed engines. Faults are real
too: a rank is SIGKILLed at a random step, or while a checkpoint is being written.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from tests.conftest import PY, subprocess_env

pytestmark = pytest.mark.slow

STEPS = 16
CONFIG = {
    "data": {"sources": [{"path": "<stdlib>/[a-c]*.py", "format": "txt"}],
             "tokenizer": {"vocab_size": 384}, "seq_len": 32, "shards": 2, "val_fraction": 0.1},
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
              "max_position_embeddings": 32, "attn_implementation": "eager"},
    "cluster": {"nodes": 1, "gpus_per_node": 2},
    "train": {"micro_batch_size": 4, "grad_accum": 2, "max_steps": STEPS, "warmup_steps": 2,
              "checkpoint_every": 3, "keep_last": 2, "record_samples": True},
    "runs": {
        "fsdp": {},
        "ds": {"train": {"backend": "deepspeed", "zero_stage": 2}},
    },
}


def run_cli(*argv: str) -> None:
    res = subprocess.run([PY, "-m", *argv], capture_output=True, text=True, env=subprocess_env())
    assert res.returncode == 0, res.stderr[-3000:]


def tokenize_for_tests(work: Path, config: dict) -> Path:
    """The tiny tokenized dataset these tests train on (2 shards, seq 32), built through the
    real tokenizer and tokenize commands from ``config``'s sources; returns the data dir."""
    from pipeline.config.files import expand_sources, parse_config

    files = [str(f) for f in expand_sources(parse_config(config).data.sources)]
    out = work / "data"
    run_cli("pipeline.tokenize", "tokenizer", "train", "--input", *files, "--vocab-size", "384",
            "--out", str(out / "tokenizer"), "--format", "txt")
    for shard in range(2):
        run_cli("pipeline.tokenize", "shard", "--input", *files, "--tokenizer",
                str(out / "tokenizer"), "--seq-len", "32", "--shards", "2", "--shard", str(shard),
                "--out", str(out), "--format", "txt", "--val-fraction", "0.1")
    run_cli("pipeline.tokenize", "gather", "--out", str(out), "--shards", "2",
            "--tokenizer", str(out / "tokenizer"))
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("resume-data")
    out = tokenize_for_tests(work, CONFIG)
    (work / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    return out


def render(data_dir: Path, run: str, run_dir: Path) -> Path:
    run_cli("pipeline.render", "--config", str(data_dir.parent / "config.yaml"), "--run", run,
            "--out", str(run_dir), "--data-manifest", str(data_dir / "manifest.json"))
    return run_dir


def torchrun(run_dir: Path, data_dir: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "pipeline.train", "worker", "--run-dir", str(run_dir), "--data-dir", str(data_dir)],
        env=subprocess_env(**env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def kill_a_rank(proc: subprocess.Popen) -> None:
    workers = psutil.Process(proc.pid).children()
    assert workers, "no worker processes to kill"
    random.choice(workers).send_signal(signal.SIGKILL)


def finish(proc: subprocess.Popen, expect_ok: bool) -> None:
    _, err = proc.communicate(timeout=300)
    if expect_ok:
        assert proc.returncode == 0, err[-3000:]
    else:
        assert proc.returncode != 0, "the killed job reported success"


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The consolidated weights of the final checkpoint (the consolidate stage's own reader)."""
    from pipeline.consolidate import load_dcp_model_state, load_deepspeed_model_state
    from pipeline.io import read_json

    done = read_json(run_dir / "train.done")
    ckpt = run_dir / "checkpoints" / done["checkpoint"]
    meta = read_json(ckpt / "manifest.json")
    if meta["backend"] == "deepspeed":
        return load_deepspeed_model_state(ckpt, meta["zero_stage"])
    return load_dcp_model_state(ckpt)


def consumed(run_dir: Path) -> dict[int, list[int]]:
    """Step → the global sample indices consumed (rank 0's then rank 1's; last attempt wins)."""
    by_step: dict[int, list[int]] = {}
    for rank in range(2):
        seen: dict[int, list[int]] = {}
        for line in (run_dir / f"samples-rank{rank:05d}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            seen[rec["step"]] = rec["indices"]
        for step, idx in seen.items():
            by_step.setdefault(step, []).extend(idx)
    return dict(sorted(by_step.items()))


@pytest.fixture(scope="module", params=["fsdp", "ds"])
def reference(request, data_dir, tmp_path_factory):
    run_dir = render(data_dir, request.param, tmp_path_factory.mktemp(f"ref-{request.param}"))
    proc = torchrun(run_dir, data_dir)
    _, err = proc.communicate(timeout=300)
    if (proc.returncode != 0 and "terminate called without an active exception" in err
            and steps_logged(run_dir) == 0):
        # An intermittent C++ abort of one rank before its first step (seen twice in about five
        # full CI runs, always here, never after step 1; open). The launcher retries such a
        # failure within max_failures; this reference runs without the launcher, so it retries
        # once itself, and only before any step: the reference stays uninterrupted.
        proc = torchrun(run_dir, data_dir)
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return request.param, run_dir


def test_kill_at_a_random_step_then_resume_is_bit_exact(reference, data_dir, tmp_path):
    run, ref_dir = reference
    run_dir = render(data_dir, run, tmp_path / run)
    kill_at = random.Random(os.getpid()).randint(4, STEPS - 3)
    proc = torchrun(run_dir, data_dir)
    while steps_logged(run_dir) < kill_at and proc.poll() is None:
        time.sleep(0.01)
    kill_a_rank(proc)
    finish(proc, expect_ok=False)
    assert not (run_dir / "train.done").exists()

    finish(torchrun(run_dir, data_dir), expect_ok=True)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed_from"] > 0, starts
    # DeepSpeed's partition was read straight into the engine's tensors, by their place in
    # the file: its fp32 master partition and the two moments the fresh engine made for the
    # load (its base optimizer has none before its first step); the resumed run is still
    # bit-exact, so DeepSpeed kept them as its state.
    loads = [e for e in events if e["event"] == "load"]
    assert len(loads) == 1 and loads[0]["read_into_engine"] == (3 if run == "ds" else 0), loads
    ref, got = final_weights(ref_dir), final_weights(run_dir)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    assert consumed(run_dir) == consumed(ref_dir)


def test_kill_while_writing_a_checkpoint_then_resume_is_bit_exact(reference, data_dir, tmp_path):
    run, ref_dir = reference
    run_dir = render(data_dir, run, tmp_path / run)
    ckpts = run_dir / "checkpoints"
    for _attempt in range(4):
        proc = torchrun(run_dir, data_dir)
        caught = None
        while proc.poll() is None:
            tmp = list(ckpts.glob(".tmp-step-*")) if ckpts.exists() else []
            if tmp and steps_logged(run_dir) >= 4:
                kill_a_rank(proc)
                caught = tmp[0].name
                break
            time.sleep(0.001)
        if caught is None:  # finished before we caught a save in flight: start over
            continue
        finish(proc, expect_ok=False)
        if (ckpts / caught).exists():  # killed mid-save: the partial folder stays behind
            break
    else:
        pytest.skip("could not catch a checkpoint save in flight in 4 attempts")
    # The half-written checkpoint is never resumed from; the previous complete one is.
    finish(torchrun(run_dir, data_dir), expect_ok=True)
    assert not list(ckpts.glob(".tmp-step-*"))
    ref, got = final_weights(ref_dir), final_weights(run_dir)
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    assert consumed(run_dir) == consumed(ref_dir)


def test_kill_during_a_background_save_never_loads_that_checkpoint(reference, data_dir, tmp_path):
    """train.checkpoint_async (the default): training goes on while a save is written; a job
    killed then leaves a folder without a manifest, and the resume takes the previous one."""
    from pipeline.checkpoint.async_save import SLOW_SAVE_ENV

    run, ref_dir = reference
    run_dir = render(data_dir, run, tmp_path / run)
    # A slow disk on demand: each background commit waits 4 s, holding the save in flight.
    proc = torchrun(run_dir, data_dir, **{SLOW_SAVE_ENV: "4"})
    pending = run_dir / "checkpoints" / ".tmp-step-000006"
    events = run_dir / "events.jsonl"

    def in_flight() -> bool:  # step 6's save began, training went on past it, not committed
        begun = set()
        for line in events.read_text().splitlines() if events.exists() else []:
            try:
                e = json.loads(line)
            except ValueError:  # a line being written
                continue
            if e.get("event") == "save":
                begun.add(e["step"])
        return (6 in begun and steps_logged(run_dir) >= 7
                and not (pending / "manifest.json").exists())

    while not in_flight() and proc.poll() is None:
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before its step-6 save was caught in flight"
    kill_a_rank(proc)
    finish(proc, expect_ok=False)
    assert pending.is_dir() and not (pending / "manifest.json").exists()
    assert not (run_dir / "checkpoints" / "step-000006").exists()

    finish(torchrun(run_dir, data_dir), expect_ok=True)
    starts = [json.loads(x) for x in events.read_text().splitlines() if '"start"' in x]
    assert starts[1]["resumed_from"] == 3, starts  # the last committed one, never step 6's
    ref, got = final_weights(ref_dir), final_weights(run_dir)
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    assert consumed(run_dir) == consumed(ref_dir)


# The checkpoint-folder protocol is engine-independent: the fsdp reference covers it.
@pytest.mark.parametrize("reference", ["fsdp"], indirect=True)
def test_a_corrupted_checkpoint_is_skipped_for_the_previous_one(reference, data_dir, tmp_path):
    run, ref_dir = reference
    run_dir = render(data_dir, run, tmp_path / run)
    proc = torchrun(run_dir, data_dir)
    while steps_logged(run_dir) < 8 and proc.poll() is None:
        time.sleep(0.01)
    kill_a_rank(proc)
    finish(proc, expect_ok=False)
    from pipeline.artifacts import checkpoint_steps

    (newest_step, newest), *_ = reversed(checkpoint_steps(run_dir / "checkpoints"))
    victim = next(p for p in newest.rglob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-7])  # truncated, as by a full disk
    finish(torchrun(run_dir, data_dir), expect_ok=True)
    starts = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
              if '"start"' in x]
    assert starts[1]["resumed_from"] < newest_step
    ref, got = final_weights(ref_dir), final_weights(run_dir)
    for key in ref:
        assert torch.equal(ref[key], got[key]), key


def write_config(data_dir: Path, name: str, **train) -> Path:
    cfg = yaml.safe_load(yaml.safe_dump(CONFIG))
    cfg["runs"] = {"r": {"train": train}}
    path = data_dir.parent / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


ENGINES = {"fsdp": {}, "ds": {"backend": "deepspeed", "zero_stage": 2}}


_WORLD_CHANGES: dict[str, tuple[str, Path, int]] = {}


@pytest.fixture(scope="module", params=list(ENGINES))
def world_change(request, data_dir, tmp_path_factory) -> tuple[str, Path, int]:
    return change_world(request.param, data_dir, tmp_path_factory)


def change_world(engine: str, data_dir: Path, tmp_path_factory) -> tuple[str, Path, int]:
    """Saved by 2 ranks, resumed by 1 with twice the accumulation: the same global batch, so
    the same experiment. fsdp: DCP reshards the state; DeepSpeed: its universal checkpoint,
    converted automatically beside the step folder. Once per engine and module."""
    if engine in _WORLD_CHANGES:
        return _WORLD_CHANGES[engine]
    run_dir = tmp_path_factory.mktemp(f"world-{engine}") / "r"
    two = write_config(data_dir, f"two-{engine}", **ENGINES[engine])
    run_cli("pipeline.render", "--config", str(two), "--run", "r", "--out", str(run_dir),
            "--data-manifest", str(data_dir / "manifest.json"))
    proc = torchrun(run_dir, data_dir)
    while steps_logged(run_dir) < 7 and proc.poll() is None:
        time.sleep(0.01)
    (run_dir / "STOP").touch()  # the stop request: ranks agree on a step, save, exit 75
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and not (run_dir / "train.done").exists(), err[-2000:]
    stopped_at = json.loads((run_dir / "stopped.json").read_text())["step"]
    assert stopped_at >= 7
    (run_dir / "STOP").unlink()

    cfg = yaml.safe_load(yaml.safe_dump(CONFIG))
    cfg["cluster"]["gpus_per_node"] = 1
    # keep_last is bookkeeping (not hashed): keeping every checkpoint lets the test inspect the
    # one the change resumed from.
    cfg["runs"] = {"r": {"train": {**ENGINES[engine], "grad_accum": 4, "keep_last": 10}}}
    one = data_dir.parent / f"one-{engine}.yaml"
    one.write_text(yaml.safe_dump(cfg))
    run_cli("pipeline.render", "--config", str(one), "--run", "r", "--out", str(run_dir),
            "--data-manifest", str(data_dir / "manifest.json"))
    res = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "-m", "pipeline.train", "worker", "--run-dir", str(run_dir), "--data-dir", str(data_dir)],
        env=subprocess_env(), capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    _WORLD_CHANGES[engine] = (engine, run_dir, stopped_at)
    return _WORLD_CHANGES[engine]


def test_resume_on_another_world_size_keeps_the_data_order(world_change, data_dir):
    _, run_dir, stopped_at = world_change
    starts = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
              if '"start"' in x]
    assert starts[-1]["resumed_from"] == stopped_at  # the 2-rank attempt's stop checkpoint
    # The 1-rank attempt consumed exactly what 2 ranks would have (rank 0 then rank 1 slices).
    from pipeline.data.loader import BatchLoader, PackedDataset

    ds = PackedDataset(data_dir, split="train")
    ref = [BatchLoader(ds, micro_batch_size=4, dp_rank=r, dp_size=2, seed=1234) for r in range(2)]
    expected = {}
    for step in range(1, STEPS + 1):
        micro = [[b.next_batch()["indices"] for b in ref] for _ in range(2)]
        expected[step] = sorted(i for m in micro for idx in m for i in idx)
    got = {}
    for line in (run_dir / "samples-rank00000.jsonl").read_text().splitlines():
        rec = json.loads(line)
        got[rec["step"]] = sorted(rec["indices"])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(stopped_at + 1, STEPS + 1):
        assert got[step] == expected[step], step


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in
            map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_deepspeed_on_another_world_size_loads_its_universal_conversion(
        world_change, data_dir, tmp_path_factory):
    """The DeepSpeed run continued from its universal checkpoint: converted once, verified,
    beside the step folder (which is left as it was); its losses after the change follow the
    fsdp run that made the same change within 1e-4 (same global batch, same sequences)."""
    engine, run_dir, stopped_at = world_change
    if engine != "ds":
        pytest.skip("the fsdp run is the reference of the deepspeed one")
    from pipeline.checkpoint.format import verify as verify_step
    from pipeline.checkpoint.universal import universal_dir, verify

    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["resumed_from"] for e in events if e["event"] == "start"][-1] == stopped_at
    step = run_dir / "checkpoints" / f"step-{stopped_at:06d}"
    universal = universal_dir(step)
    assert verify_step(step) is None  # the step folder still verifies: nothing written into it
    assert universal.is_dir() and verify(universal)
    assert not any(p.name.startswith(".tmp-") for p in step.parent.iterdir())
    _, fsdp_dir, _ = change_world("fsdp", data_dir, tmp_path_factory)
    ds, fs = _losses(run_dir), _losses(fsdp_dir)
    assert sorted(ds) == sorted(fs) == list(range(1, STEPS + 1))
    after = range(stopped_at + 1, STEPS + 1)
    assert max(abs(ds[s] - fs[s]) / fs[s] for s in after) < 1e-4


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(data_dir, tmp_path):
    run_dir = tmp_path / "nan"
    # train.lr is at most 1, which diverges at no known step: the trainer's fault injection
    # makes step 3's loss NaN on every rank.
    from pipeline.train.trainer import NAN_AT_STEP_ENV

    cfg = write_config(data_dir, "nan", warmup_steps=0, checkpoint_every=1)
    run_cli("pipeline.render", "--config", str(cfg), "--run", "r", "--out", str(run_dir),
            "--data-manifest", str(data_dir / "manifest.json"))
    proc = torchrun(run_dir, data_dir, **{NAN_AT_STEP_ENV: "3"})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "loss is nan at step" in err or "loss is inf at step" in err, err[-2000:]
    nan_step = next(json.loads(x)["step"] for x in (run_dir / "events.jsonl").read_text().splitlines()
                    if '"nan"' in x)
    from pipeline.checkpoint.format import latest_valid

    good = latest_valid(run_dir / "checkpoints")
    assert good is not None and good[0] == nan_step - 1
    assert not (run_dir / "train.done").exists()


@pytest.mark.parametrize("reference", ["fsdp"], indirect=True)
def test_checkpoints_over_other_data_are_a_clear_error(data_dir, tmp_path, reference):
    _, ref_dir = reference
    import shutil

    run_dir = tmp_path / "other"
    shutil.copytree(ref_dir, run_dir)
    (run_dir / "train.done").unlink()
    other = tmp_path / "data"
    shutil.copytree(data_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["sources"] = [*manifest.get("sources", []), {"path": "elsewhere", "bytes": 1}]
    (other / "manifest.json").write_text(json.dumps(manifest))
    proc = torchrun(run_dir, other)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "trained on another tokenized dataset" in err, err[-2000:]
