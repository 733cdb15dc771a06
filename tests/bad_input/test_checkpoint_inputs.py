"""Bad and hostile checkpoints ("untrusted bytes are data"): consolidate and a resume.

One FSDP2 run and one DeepSpeed ZeRO-2 run of the tiny model are trained once for the module
(one process each, 4 steps, checkpoints at steps 2 and 4), on the tokenized sample of
``tests/test_resume.py`` (its ``data_dir`` fixture). Every case copies a trained run dir, breaks
or plants something in its final checkpoint and runs the real command in a subprocess:
``python -m pipeline.consolidate`` or a resume (``python -m pipeline.train worker`` as a bare
single process, rank 0 of 1). Each refusal is checked with ``assert_refused``: exit status ≠ 0,
the message names the file, no traceback, the checkpoint and the output folder unchanged. A
planted pickle payload would create a marker file: it must never exist afterwards.

A manifest "rewritten to match" is the attacker who can write the whole checkpoint folder: the
checksums then verify, and only the allow-listed unpicklers stand between the bytes and code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.checkpoint.fastio import DIGEST, digest_file
from tests.bad_input.conftest import assert_refused, run, snapshot
from tests.conftest import PY, subprocess_env
from tests.test_resume import CONFIG, data_dir  # noqa: F401  (data_dir: the module fixture)

pytestmark = pytest.mark.slow

STEPS = 4


def _solo_env() -> dict[str, str]:
    """A bare ``python -m pipeline.train worker``: rank 0 of 1 (no torchrun, which adds its
    own failure report around the worker's message). Port 0: the world-of-one store binds a
    port of its own, so two workers started together cannot race for one chosen beforehand (a
    port picked free and released was taken by the other worker's gloo socket in CI)."""
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}


def _worker_argv(run_dir: Path, data: Path) -> list[str]:
    return ["-m", "pipeline.train", "worker", "--run-dir", str(run_dir), "--data-dir", str(data)]


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """``{"fsdp": run_dir, "ds": run_dir}``: both trained together, 1 process each."""
    work = tmp_path_factory.mktemp("bad-ckpt")
    cfg = yaml.safe_load(yaml.safe_dump(CONFIG))
    cfg["cluster"]["gpus_per_node"] = 1
    cfg["train"].update(max_steps=STEPS, checkpoint_every=2, keep_last=2, record_samples=False)
    cfg["runs"] = {"fsdp": {}, "ds": {"train": {"backend": "deepspeed", "zero_stage": 2}}}
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    procs = {}
    for name in cfg["runs"]:
        res = run(["-m", "pipeline.render", "--config", str(work / "config.yaml"), "--run", name,
                   "--out", str(work / name), "--data-manifest", str(data_dir / "manifest.json")],
                  work)
        assert res.returncode == 0, res.stderr[-3000:]
        procs[name] = subprocess.Popen(
            [PY, *_worker_argv(work / name, data_dir)], cwd=work,
            env=subprocess_env(**_solo_env()), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
    errors = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            errors[name] = err[-3000:]
    assert not errors, errors
    return {name: work / name for name in procs}


# --- helpers ---------------------------------------------------------------------------------


class Payload:
    """Unpickled, it would create ``path`` (run by any unpickler that resolves ``os.system``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def copy_run(trained: dict[str, Path], engine: str, dest: Path) -> tuple[Path, Path]:
    """A copy of a trained run dir and the path of its final checkpoint."""
    run_dir = dest / engine
    shutil.copytree(trained[engine], run_dir, symlinks=True)
    done = json.loads((run_dir / "train.done").read_text())
    return run_dir, run_dir / "checkpoints" / done["checkpoint"]


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def write_manifest(ckpt: Path, meta: dict) -> None:
    (ckpt / "manifest.json").write_text(json.dumps(meta))


def rewrite_manifest(ckpt: Path) -> None:
    """The manifest recomputed over the folder as it is now: the tampering "verifies"."""
    meta = manifest(ckpt)
    meta["files"] = {
        f.relative_to(ckpt).as_posix(): {DIGEST: digest_file(f), "bytes": f.stat().st_size}
        for f in sorted(ckpt.rglob("*")) if f.is_file() and f.name != "manifest.json"
    }
    write_manifest(ckpt, meta)


def plant(path: Path, marker: Path) -> None:
    """Replace ``path`` with a pickle whose loading would create ``marker``."""
    path.write_bytes(pickle.dumps(Payload(marker)))


def plant_torch(path: Path, marker: Path) -> None:
    """Replace a ``torch.save`` file with one that holds a foreign global (``os.system``)."""
    torch.save({"module": Payload(marker), "buffer_names": []}, path)


def consolidate(run_dir: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    return run(["-m", "pipeline.consolidate", "--run-dir", str(run_dir), "--data-dir", str(data),
                "--out", str(out)], run_dir.parent)


def resume(run_dir: Path, data: Path) -> subprocess.CompletedProcess:
    return run(_worker_argv(run_dir, data), run_dir.parent, **_solo_env())


def distcp(ckpt: Path) -> Path:
    return next((ckpt / "dcp").glob("*.distcp"))


# --- consolidate: the folder's integrity (each mutation → the file it names) -----------------


def _truncate(ckpt: Path, tmp: Path) -> str:
    f = distcp(ckpt)
    f.write_bytes(f.read_bytes()[:-7])
    return f.name


def _flip(ckpt: Path, tmp: Path) -> str:
    f = distcp(ckpt)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return f.name


def _missing(ckpt: Path, tmp: Path) -> str:
    f = distcp(ckpt)
    f.unlink()
    return f"dcp/{f.name} is missing"


def _extra(ckpt: Path, tmp: Path) -> str:
    (ckpt / "dcp" / "extra.bin").write_bytes(b"\0" * 64)
    return "dcp/extra.bin"


def _extra_with_altered_weights(ckpt: Path, tmp: Path) -> str:
    # The attack of the issue: altered weights and a manifest that lists nothing.
    _flip(ckpt, tmp)
    meta = manifest(ckpt)
    meta["files"] = {}
    write_manifest(ckpt, meta)
    return "lists no files"


def _dotdot(ckpt: Path, tmp: Path) -> str:
    outside = ckpt.parent.parent / "outside.bin"
    outside.write_bytes(b"x" * 8)
    meta = manifest(ckpt)
    meta["files"]["../../outside.bin"] = {DIGEST: digest_file(outside), "bytes": 8}
    write_manifest(ckpt, meta)
    return "'../../outside.bin'"


def _absolute(ckpt: Path, tmp: Path) -> str:
    outside = tmp / "abs.bin"
    outside.write_bytes(b"y" * 8)
    meta = manifest(ckpt)
    meta["files"][str(outside)] = {DIGEST: digest_file(outside), "bytes": 8}
    write_manifest(ckpt, meta)
    return str(outside)


def _symlink(ckpt: Path, tmp: Path) -> str:
    # Same bytes through a link: the sizes and checksums would match; links are refused.
    f = distcp(ckpt)
    target = tmp / "elsewhere.distcp"
    shutil.copy2(f, target)
    f.unlink()
    f.symlink_to(target)
    return f"dcp/{f.name} is a symbolic link"


def _not_json(ckpt: Path, tmp: Path) -> str:
    (ckpt / "manifest.json").write_text('{"files": {')
    return "manifest.json is not valid JSON"


def _no_files_key(ckpt: Path, tmp: Path) -> str:
    meta = manifest(ckpt)
    del meta["files"]
    write_manifest(ckpt, meta)
    return "manifest.json has no 'files' key"


def _entry_without_bytes(ckpt: Path, tmp: Path) -> str:
    meta = manifest(ckpt)
    rel = next(iter(meta["files"]))
    del meta["files"][rel]["bytes"]
    write_manifest(ckpt, meta)
    return f"the entry of {rel} has no valid 'bytes'"


def _step_not_a_number(ckpt: Path, tmp: Path) -> str:
    meta = manifest(ckpt)
    meta["step"] = "4; rm -rf ~"
    write_manifest(ckpt, meta)
    return "'step' is '4; rm -rf ~', not a number"


MUTATIONS: dict[str, Callable[[Path, Path], str]] = {
    "truncated-distcp": _truncate,
    "flipped-byte": _flip,
    "missing-file": _missing,
    "extra-file-not-in-manifest": _extra,
    "empty-files-list-altered-weights": _extra_with_altered_weights,
    "manifest-path-dotdot": _dotdot,
    "manifest-path-absolute": _absolute,
    "symlink-in-checkpoint": _symlink,
    "manifest-not-json": _not_json,
    "manifest-missing-key": _no_files_key,
    "manifest-entry-missing-key": _entry_without_bytes,
    "manifest-step-not-a-number": _step_not_a_number,
}


@pytest.mark.parametrize("case", list(MUTATIONS))
def test_consolidate_refuses_a_checkpoint_that_does_not_verify(case, trained, data_dir, tmp_path):  # noqa: F811
    run_dir, ckpt = copy_run(trained, "fsdp", tmp_path)
    needle = MUTATIONS[case](ckpt, tmp_path)
    outs = tmp_path / "outs"
    outs.mkdir()
    before = snapshot(run_dir, outs)
    res = consolidate(run_dir, data_dir, outs / "hf")
    assert_refused(res, "does not verify", ckpt.name, needle, before=before, roots=[run_dir, outs])


def test_a_symlinked_checkpoint_folder_is_refused(trained, data_dir, tmp_path):  # noqa: F811
    # A link that stays inside checkpoints/ (one leaving it is refused as a path already).
    run_dir, ckpt = copy_run(trained, "fsdp", tmp_path)
    real = ckpt.parent / "real-step"
    ckpt.rename(real)
    ckpt.symlink_to(real, target_is_directory=True)
    outs = tmp_path / "outs"
    outs.mkdir()
    before = snapshot(run_dir, outs)
    res = consolidate(run_dir, data_dir, outs / "hf")
    assert_refused(res, f"{ckpt.name} is a symbolic link", before=before, roots=[run_dir, outs])


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "../checkpoints/../../x"])
def test_train_done_naming_a_path_outside_is_refused(name, trained, data_dir, tmp_path):  # noqa: F811
    run_dir, _ = copy_run(trained, "fsdp", tmp_path)
    done = json.loads((run_dir / "train.done").read_text())
    done["checkpoint"] = name
    (run_dir / "train.done").write_text(json.dumps(done))
    outs = tmp_path / "outs"
    outs.mkdir()
    before = snapshot(run_dir, outs)
    res = consolidate(run_dir, data_dir, outs / "hf")
    assert_refused(res, "train.done", repr(name), before=before, roots=[run_dir, outs])


# --- code execution: planted pickles ----------------------------------------------------------


@pytest.mark.parametrize("rewritten", [False, True], ids=["manifest-stale", "manifest-rewritten"])
def test_a_planted_dcp_metadata_payload_never_runs_in_consolidate(rewritten, trained, data_dir,  # noqa: F811
                                                                  tmp_path):
    run_dir, ckpt = copy_run(trained, "fsdp", tmp_path)
    marker = tmp_path / "PWNED"
    plant(ckpt / "dcp" / ".metadata", marker)
    if rewritten:
        rewrite_manifest(ckpt)
    outs = tmp_path / "outs"
    outs.mkdir()
    before = snapshot(run_dir, outs)
    res = consolidate(run_dir, data_dir, outs / "hf")
    needles = ["dcp/.metadata", "does not verify"] if not rewritten else [".metadata", "allow-list"]
    assert_refused(res, *needles, before=before, roots=[run_dir, outs])
    assert not marker.exists(), "the planted pickle ran"


def test_a_deepspeed_file_with_a_foreign_global_is_refused_by_consolidate(trained, data_dir,  # noqa: F811
                                                                          tmp_path):
    run_dir, ckpt = copy_run(trained, "ds", tmp_path)
    marker = tmp_path / "PWNED"
    plant_torch(ckpt / "ds" / "mp_rank_00_model_states.pt", marker)
    rewrite_manifest(ckpt)
    outs = tmp_path / "outs"
    outs.mkdir()
    before = snapshot(run_dir, outs)
    res = consolidate(run_dir, data_dir, outs / "hf")
    assert_refused(res, "mp_rank_00_model_states.pt", "system", before=before, roots=[run_dir, outs])
    assert not marker.exists(), "the planted pickle ran"


# --- code execution: a resume -----------------------------------------------------------------


def _plant_dcp_metadata(ckpt: Path, marker: Path) -> str:
    plant(ckpt / "dcp" / ".metadata", marker)
    return ".metadata"


def _plant_ds_optimizer(ckpt: Path, marker: Path) -> str:
    f = next((ckpt / "ds").glob("*optim_states.pt"))
    plant_torch(f, marker)
    return f.name


def _plant_rng(ckpt: Path, marker: Path) -> str:
    torch.save({"torch": Payload(marker)}, ckpt / "rng" / "rank-00000.pt")
    return "rank-00000.pt"


def _plant_dcp_bytes_entry(ckpt: Path, marker: Path) -> str:
    """A non-tensor DCP entry (an optimizer hyper-parameter, which DCP's own planner loads with
    ``torch.load(weights_only=False)``) pointed at a planted ``torch.save`` payload."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from pipeline.checkpoint.tensors import read_dcp_metadata

    meta = read_dcp_metadata(ckpt / "dcp")
    fqn = next(k for k, v in meta.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) and k.startswith("optim.param_groups"))
    index = next(k for k in meta.storage_data if k.fqn == fqn)
    info = meta.storage_data[index]
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    target = ckpt / "dcp" / info.relative_path
    info.offset, info.length = target.stat().st_size, len(buf.getvalue())
    with target.open("ab") as f:
        f.write(buf.getvalue())
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(meta))
    return f"refused to unpickle the entry {fqn!r}"


def _trainer_state(ckpt: Path, marker: Path) -> str:
    (ckpt / "trainer.json").write_text('{"step": "4", "evil": true}')
    return "trainer.json: not a trainer state"


RESUME_PLANTS = {
    "fsdp-dcp-metadata": ("fsdp", _plant_dcp_metadata),
    "fsdp-dcp-non-tensor-entry": ("fsdp", _plant_dcp_bytes_entry),
    "deepspeed-optimizer-states": ("ds", _plant_ds_optimizer),
    "rng-state": ("fsdp", _plant_rng),
    "trainer-json-not-a-state": ("fsdp", _trainer_state),
}


@pytest.mark.parametrize("case", list(RESUME_PLANTS))
def test_a_planted_payload_in_a_verifying_checkpoint_never_runs_on_resume(case, trained, data_dir,  # noqa: F811
                                                                         tmp_path):
    engine, plant_fn = RESUME_PLANTS[case]
    run_dir, ckpt = copy_run(trained, engine, tmp_path)
    (run_dir / "train.done").unlink()
    marker = tmp_path / "PWNED"
    needle = plant_fn(ckpt, marker)
    rewrite_manifest(ckpt)  # the checksums verify: only the allow-lists stand in the way
    ckpts = run_dir / "checkpoints"
    before = snapshot(ckpts)
    res = resume(run_dir, data_dir)
    assert_refused(res, needle, before=before, roots=[ckpts])
    assert not marker.exists(), "the planted pickle ran"
    assert not (run_dir / "train.done").exists()


def test_a_planted_payload_that_does_not_verify_is_skipped_on_resume(trained, data_dir, tmp_path):  # noqa: F811
    """Without a matching manifest the newest checkpoint does not verify: it is skipped (never
    opened) and the run resumes from the previous one, as from any corrupt checkpoint."""
    run_dir, ckpt = copy_run(trained, "fsdp", tmp_path)
    (run_dir / "train.done").unlink()
    marker = tmp_path / "PWNED"
    plant(ckpt / "dcp" / ".metadata", marker)
    res = resume(run_dir, data_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback (most recent call last)" not in res.stderr
    assert "dcp/.metadata" in res.stderr and "moved aside" in res.stderr
    assert not marker.exists(), "the planted pickle ran"
    # Moved aside whole (the planted file inside), never deleted; step 4 was saved again.
    (aside,) = [p for p in (run_dir / "checkpoints").iterdir() if ".damaged-" in p.name]
    assert aside.name.startswith(ckpt.name) and (aside / "dcp" / ".metadata").is_file()
    assert (ckpt / "manifest.json").is_file()
    starts = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
              if '"start"' in x]
    assert starts[-1]["resumed_from"] == STEPS - 2


def test_a_resume_with_every_checkpoint_damaged_stops_naming_them(trained, data_dir, tmp_path):  # noqa: F811
    """No silent restart from step 0: every folder is moved aside (contents kept) and the
    worker stops with one line naming them; nothing is trained."""
    run_dir, _ = copy_run(trained, "ds", tmp_path)
    (run_dir / "train.done").unlink()
    steps = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert len(steps) == 2
    for step in steps:  # one torn file each, of another kind per folder
        victim = sorted(f for f in step.rglob("*") if f.is_file() and f.name != "manifest.json")
        victim[len(victim) // 2].write_bytes(b"torn")
    metrics = (run_dir / "metrics.jsonl").read_text()
    res = resume(run_dir, data_dir)
    assert_refused(res, "no checkpoint in", "moved aside", steps[-1].name + ".damaged-")
    aside = sorted(p.name.split(".")[0] for p in (run_dir / "checkpoints").iterdir())
    assert aside == [s.name for s in steps]  # both still there, under their new names
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # no step trained


def test_a_linked_step_folder_does_not_stop_the_run(trained, data_dir, tmp_path):  # noqa: F811
    """The newest step folder is a link to a folder elsewhere: the resume moves the link aside
    (the target untouched), resumes from the previous step, and saves that step again: the
    run finishes instead of failing each save until its failure budget is spent."""
    run_dir, ckpt = copy_run(trained, "fsdp", tmp_path)
    (run_dir / "train.done").unlink()
    elsewhere = tmp_path / "elsewhere"
    shutil.move(ckpt, elsewhere)
    ckpt.symlink_to(elsewhere, target_is_directory=True)
    target = snapshot(elsewhere)
    res = resume(run_dir, data_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (run_dir / "train.done").exists()
    assert ckpt.is_dir() and not ckpt.is_symlink() and (ckpt / "manifest.json").is_file()
    assert snapshot(elsewhere) == target
    assert any(p.is_symlink() for p in (run_dir / "checkpoints").iterdir())


def test_the_launcher_ends_with_the_ranks_refusal(trained, data_dir, tmp_path):  # noqa: F811
    """Through the real launcher (submitit's local executor, torchrun): a rank's refusal is
    the launcher's one line, not torchrun's wrapper around the rank's traceback."""
    run_dir, ckpt = copy_run(trained, "fsdp", tmp_path)
    (run_dir / "train.done").unlink()
    needle = _trainer_state(ckpt, tmp_path / "unused")
    rewrite_manifest(ckpt)
    res = run(["-m", "pipeline.train", "launch", "--run-dir", str(run_dir), "--data-dir",
               str(data_dir), "--launcher", "local", "--max-failures=0"], tmp_path, timeout=600)
    assert_refused(res, needle, "rank 0")
    last = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert last and needle in last[-1] and "see the rank logs above" not in last[-1]
