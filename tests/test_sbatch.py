"""The launcher's options and its Slurm submission, without a cluster.

* :class:`pipeline.cluster.options.LaunchOptions` is the one definition of every launcher setting:
  the CLI flags, the train rule's resources and the profiles' names all come from it.
* :func:`pipeline.cluster.sbatch.render_submission` is what is submitted: a hostile job name is pinned
  by a golden file, and the executor hands sbatch exactly that argv and script (a stand-in
  ``sbatch`` on PATH records what it got).

Regenerate the golden files after an intended change with
``UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch.py`` and review the diff.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.cluster import options as launchopts
from pipeline.cluster.options import LAUNCH_RESOURCES, LaunchOptions, launch_argv
from pipeline.cluster.sbatch import SUBMISSION_FILE, render_submission
from tests.conftest import PY, REPO, subprocess_env

GOLDEN = REPO / "tests" / "golden" / "sbatch"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
HOSTILE = "it's \"quoted\" $(touch /tmp/pwned) `touch /tmp/pwned2`\nnext line \\ back\\slash"


def _hostile_submission():
    opts = LaunchOptions(
        job_name=HOSTILE, partition="gpu debug", account="acct; rm -rf /", exclude="n1,n2",
        time_min=30, cpus_per_task=4, mem_gb=1.5, signal_delay_s=120,
        sbatch={"comment": HOSTILE, "exclusive": True}, sbatch_extra=[f"--comment={HOSTILE}"],
    )
    return render_submission(opts, nodes=2, gpus_per_node=4, device="cuda",
                             folder="/path/to/results/runs/r/submitit/%j", python="python")


def test_hostile_job_name_matches_golden() -> None:
    sub = _hostile_submission()
    files = {"hostile.argv.json": json.dumps(sub.command(), indent=2) + "\n",
             "hostile.sh": sub.script}
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (GOLDEN / name).write_text(text)
    for name, text in files.items():
        assert (GOLDEN / name).read_text() == text, f"{name} differs from golden"
    # Every user string is one argument, unchanged; none of them is in the script.
    assert f"--job-name={HOSTILE}" in sub.argv and f"--comment={HOSTILE}" in sub.argv
    assert "--partition=gpu debug" in sub.argv and "--exclusive" in sub.argv
    assert "pwned" not in sub.script and "rm -rf" not in sub.script
    assert "#SBATCH --signal=USR2@120" in sub.script and "#SBATCH --time=30" in sub.script


def test_bad_extra_options_are_refused() -> None:
    from pipeline.errors import PipelineError

    with pytest.raises(PipelineError, match="not an option name"):
        render_submission(LaunchOptions(sbatch={"a b": "x"}), nodes=1, gpus_per_node=1,
                          device="cpu", folder="/x/%j")
    with pytest.raises(PipelineError, match="must start with --"):
        render_submission(LaunchOptions(sbatch_extra=["-p", "x"]), nodes=1, gpus_per_node=1,
                          device="cpu", folder="/x/%j")


FAKE_SBATCH = """#!/bin/sh
# Records its arguments and the submission file, then answers like sbatch.
printf '%s\\0' "$@" > "$FAKE_SBATCH_OUT/argv"
for last; do :; done
cp "$last" "$FAKE_SBATCH_OUT/script"
echo "Submitted batch job 4242"
"""


def test_executor_submits_exactly_the_rendered_submission(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.train.submit import ArgvSlurmExecutor

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", "#!/bin/sh\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SBATCH_OUT", str(out))
    folder = tmp_path / "run dir" / "submitit" / "%j"
    sub = render_submission(LaunchOptions(job_name=HOSTILE, sbatch_extra=[f"--comment={HOSTILE}"]),
                            nodes=2, gpus_per_node=1, device="cpu", folder=folder)
    executor = ArgvSlurmExecutor(folder, sub, max_num_timeout=3)
    job = executor.submit(print, "hello")
    assert job.job_id == "4242"
    argv = (out / "argv").read_bytes().split(b"\0")[:-1]
    assert [a.decode() for a in argv[:-1]] == sub.argv[1:]
    assert (out / "script").read_text() == sub.script
    assert sub.command(SUBMISSION_FILE)[-1] == SUBMISSION_FILE


# --------------------------------------------------------------------------------------------
# options defined once


def test_resources_cli_and_defaults_agree() -> None:
    p = argparse.ArgumentParser()
    launchopts.add_arguments(p)
    # The rule's default resources, passed as the rule passes them, give the default options.
    assert launchopts.from_args(p.parse_args(launch_argv(LAUNCH_RESOURCES))) == LaunchOptions()
    assert launchopts.from_args(p.parse_args([])) == LaunchOptions()
    opts = launchopts.from_args(p.parse_args(launch_argv(
        {"runtime": 7, "slurm_partition": "x y", "slurm_mem_gb": 2, "job_env": "A=1,B=2",
         "sbatch_extra": "--reservation='r 1' --exclusive"})))
    assert (opts.time_min, opts.partition, opts.mem_gb) == (7, "x y", 2.0)
    assert opts.job_env == {"A": "1", "B": "2"}
    assert opts.sbatch_extra == ["--reservation=r 1", "--exclusive"]
    assert opts.account is None  # "" is unset
    # Every field has a docstring, and the flag's help shows it.
    docs = launchopts.field_docs()
    assert set(docs) == {f for f in LaunchOptions.__dataclass_fields__}
    assert "squeue polls" in p.format_help()


def test_profile_resource_names_are_launcher_settings() -> None:
    prof = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    train = prof["set-resources"]["train"]
    assert set(train) <= set(LAUNCH_RESOURCES), set(train) - set(LAUNCH_RESOURCES)
    assert train["launcher"] == "slurm"


def test_launch_help_imports_no_torch() -> None:
    proc = subprocess.run([PY, "-X", "importtime", "-m", "pipeline.train", "launch", "--help"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--signal-delay-s" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "torch" not in imported and "submitit" not in imported
