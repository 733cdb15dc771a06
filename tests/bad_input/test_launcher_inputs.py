"""Bad and hostile inputs of the train launcher, ``python -m pipeline.train launch``, on a real
rendered run: flags out of range, extra sbatch options in a broken form, sbatch failing, and
paths or flag values holding a line break that would reach the job's script. Each is refused
with one ``error:`` line naming the flag (or sbatch's own message), exit status 2, no
traceback, and every file of the project as it was; none of them gets as far as sbatch.

Slurm is stood in for by scripts on PATH (``sbatch`` records what it was given and answers
with Slurm's own messages), so a failing sbatch is a real failure of the command the launcher
runs, on any machine; the cases run with ``--launcher slurm`` and check that sbatch was never
called, so that a check that gave way would fail at once instead of training.

Cases per class: 28 out-of-range numbers, 11 option forms, 7 sbatch failures, 20 shell-from-a-
path cases (control characters in 9 flags and 7 paths, 2 other characters sbatch misreads,
the quoted script run for real, the workflow rules' quoting).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.bad_input.conftest import REPO, assert_refused, run, snapshot

RUN = "results/runs/fsdp"
DATA = "results/data"

FAKE_SBATCH = """#!/bin/sh
# sbatch's stand-in: records its arguments and the submission file, then answers as told.
printf '%s\\0' "$@" > "$FAKE_SLURM_OUT/argv"
for last; do :; done
cp "$last" "$FAKE_SLURM_OUT/script"
[ -n "$FAKE_SBATCH_STDOUT" ] && printf '%s\\n' "$FAKE_SBATCH_STDOUT"
[ -n "$FAKE_SBATCH_STDERR" ] && printf '%s\\n' "$FAKE_SBATCH_STDERR" >&2
exit "${FAKE_SBATCH_RC:-1}"
"""
FAKE_SRUN = """#!/bin/sh
printf '%s\\0' "$@" > "$FAKE_SLURM_OUT/srun"
"""
NO_CONTROLLER = ("sbatch: error: Batch job submission failed: Unable to contact slurm controller "
                 "(connect failure)")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as render writes it (config.json, launch.json, ...), once per module."""
    root = tmp_path_factory.mktemp("rendered")
    res = run(["-m", "pipeline.render", "--config", str(REPO / "config" / "config.yaml"),
               "--run", "fsdp", "--out", "run", "--vocab-size", "300"], root)
    assert res.returncode == 0, res.stderr[-2000:]
    return root / "run"


@pytest.fixture
def proj(rendered: Path, tmp_path: Path) -> Path:
    """A project with the rendered run and a data folder (read by the job, not the launcher)."""
    proj = tmp_path / "proj"
    shutil.copytree(rendered, proj / RUN)
    (proj / DATA).mkdir(parents=True)
    return proj


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """Environment with sbatch, srun and squeue stand-ins first on PATH; what sbatch got goes to
    ``FAKE_SLURM_OUT``."""
    bin_dir, out = tmp_path / "bin", tmp_path / "slurm-out"
    bin_dir.mkdir()
    out.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("squeue", "#!/bin/sh\nexit 1\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM_OUT": str(out)}


def _launch(*flags: str, run_dir: str = RUN, data_dir: str = DATA) -> list[str]:
    return ["-m", "pipeline.train", "launch", "--run-dir", run_dir, "--data-dir", data_dir, *flags]


def _refused(proj: Path, argv: list[str], *needles: str, **env: str) -> str:
    """``python <argv>`` in ``proj`` is refused with one error line holding every needle, and
    changes nothing under ``proj``; the error line."""
    before = snapshot(proj)
    res = run(argv, proj, timeout=120, **env)
    assert_refused(res, *needles, before=before, roots=[proj])
    assert res.returncode == 2, res.returncode
    errors = [line for line in (res.stderr + res.stdout).splitlines() if "error: " in line]
    assert len(errors) == 1, errors
    assert all(n in errors[0] for n in needles), errors[0]
    return errors[0]


def _sbatch_ran(env: dict[str, str]) -> bool:
    return (Path(env["FAKE_SLURM_OUT"]) / "argv").exists()


# --- numbers out of range --------------------------------------------------------------------

RANGE = [
    (["--poll-s", "nan"], "--poll-s nan", "from 0.1 to 3600"),
    (["--poll-s=inf"], "--poll-s inf", "from 0.1 to 3600"),
    (["--poll-s", "0"], "--poll-s 0", "from 0.1 to 3600"),
    (["--poll-s=-1"], "--poll-s -1", "seconds"),
    (["--poll-s", "1e400"], "--poll-s inf", "seconds"),
    (["--time-min", "-5"], "--time-min -5", "minutes from 1"),
    (["--time-min", "0"], "--time-min 0", "minutes from 1"),
    (["--time-min", "10000000"], "--time-min 10000000", "minutes"),
    (["--time-min", "nan"], "--time-min", "invalid int value"),
    (["--signal-delay-s", "-1"], "--signal-delay-s -1", "from 1 to 65535"),
    (["--signal-delay-s", "0"], "--signal-delay-s 0", "from 1 to 65535"),
    (["--signal-delay-s", "70000"], "--signal-delay-s 70000", "65535"),
    (["--signal-delay-s", "3600"], "--signal-delay-s 3600", "not under the time limit"),
    (["--time-min", "1", "--signal-delay-s", "90"], "--time-min 1", "not under the time limit"),
    (["--cpus-per-task", "0"], "--cpus-per-task 0", "CPUs from 1"),
    (["--cpus-per-task", "-2"], "--cpus-per-task -2", "CPUs"),
    (["--mem-gb", "nan"], "--mem-gb nan", "GB from"),
    (["--mem-gb=-1"], "--mem-gb -1", "0 or empty: unset"),
    (["--mem-gb", "inf"], "--mem-gb inf", "GB"),
    (["--mem-gb", "0.0001"], "--mem-gb 0.0001", "GB from 0.001"),
    (["--max-requeues", "-1"], "--max-requeues -1", "from 0"),
    (["--max-preemptions", "-3"], "--max-preemptions -3", "from 0"),
    (["--max-failures", "20000"], "--max-failures 20000", "to 10000"),
    (["--hang-timeout-s", "-1"], "--hang-timeout-s -1", "0: no watchdog"),
    (["--hang-startup-s", "-5"], "--hang-startup-s -5", "seconds"),
    (["--hang-save-s", "0"], "--hang-save-s 0", "--hang-timeout-s 0"),
    (["--launcher", "pbs"], "--launcher", "invalid choice"),
]


@pytest.mark.parametrize(("flags", "flag", "hint"), RANGE, ids=[" ".join(c[0]) for c in RANGE])
def test_number_out_of_range(proj: Path, slurm: dict[str, str], flags: list[str], flag: str,
                             hint: str) -> None:
    _refused(proj, _launch("--launcher", "slurm", *flags), flag, hint, **slurm)
    assert not _sbatch_ran(slurm)


def test_time_min_zero_on_the_local_launcher(proj: Path) -> None:
    line = _refused(proj, _launch("--time-min", "0"), "--time-min 0", "minutes from 1")
    assert "submitit" not in line and "pickle" not in line


# --- the form of extra sbatch options --------------------------------------------------------

FORMS = [
    (["--sbatch-extra=--comment='unbalanced"], "--sbatch-extra", "no closing quotation"),
    (["--sbatch-extra=--comment=\"half"], "--sbatch-extra", "no closing quotation"),
    (["--sbatch-extra=--comment=x\\"], "--sbatch-extra", "no escaped character"),
    (["--sbatch-extra=-p gpu"], "--sbatch-extra", "'-p' is not an --option"),
    (["--sbatch-extra=--reservation r1"], "--sbatch-extra", "'r1' is not an --option"),
    (["--sbatch", "a b=1"], "--sbatch 'a b=1'", "option's name"),
    (["--sbatch", "=x"], "--sbatch '=x'", "option's name"),
    (["--sbatch=--x=1"], "--sbatch '--x=1'", "option's name"),
    (["--job-env", "A B=1"], "--job-env 'A B=1'", "NAME=VALUE"),
    (["--job-env", "=1"], "--job-env '=1'", "NAME=VALUE"),
]


@pytest.mark.parametrize(("flags", "flag", "hint"), FORMS, ids=[" ".join(c[0]) for c in FORMS])
def test_option_form(proj: Path, slurm: dict[str, str], flags: list[str], flag: str,
                     hint: str) -> None:
    _refused(proj, _launch("--launcher", "slurm", *flags), flag, hint, **slurm)
    assert not _sbatch_ran(slurm)


def test_unbalanced_quote_on_the_local_launcher(proj: Path) -> None:
    _refused(proj, _launch("--sbatch-extra=--comment='a"), "--sbatch-extra",
             "no closing quotation")


# --- sbatch failing --------------------------------------------------------------------------


def test_sbatch_without_a_controller(proj: Path, slurm: dict[str, str]) -> None:
    _refused(proj, _launch("--launcher", "slurm"), "sbatch failed", NO_CONTROLLER,
             "no job was submitted", FAKE_SBATCH_STDERR=NO_CONTROLLER, **slurm)
    assert _sbatch_ran(slurm)  # the failure was sbatch's own, after the launcher's checks


def test_sbatch_refuses_the_partition(proj: Path, slurm: dict[str, str]) -> None:
    said = "sbatch: error: Batch job submission failed: Invalid partition name specified"
    _refused(proj, _launch("--launcher", "slurm", "--partition", "nope"), said,
             FAKE_SBATCH_STDERR=said, **slurm)
    argv = (Path(slurm["FAKE_SLURM_OUT"]) / "argv").read_bytes().split(b"\0")
    assert b"--partition=nope" in argv


def test_sbatch_with_no_configuration_says_every_line_on_one(proj: Path,
                                                             slurm: dict[str, str]) -> None:
    said = ("sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
            "sbatch: error: fetch_config: DNS SRV lookup failed\n"
            "sbatch: fatal: Could not establish a configuration source")
    _refused(proj, _launch("--launcher", "slurm"), "Unknown host", "DNS SRV lookup failed",
             "Could not establish a configuration source", FAKE_SBATCH_STDERR=said, **slurm)


def test_sbatch_failing_without_a_message(proj: Path, slurm: dict[str, str]) -> None:
    _refused(proj, _launch("--launcher", "slurm"), "sbatch failed (no message)",
             FAKE_SBATCH_RC="3", **slurm)


def test_sbatch_answer_without_a_job_id(proj: Path, slurm: dict[str, str]) -> None:
    _refused(proj, _launch("--launcher", "slurm"), "without a job id", "squeue",
             FAKE_SBATCH_STDOUT="sbatch: queued, somewhere", FAKE_SBATCH_RC="0", **slurm)


def test_no_slurm_commands_on_path(proj: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _refused(proj, _launch("--launcher", "slurm"), "sbatch, srun, squeue not found on PATH",
             "--launcher local", PATH=str(tmp_path / "empty"))


def test_sbatch_failing_keeps_the_files_already_there(proj: Path, slurm: dict[str, str]) -> None:
    old = proj / RUN / "submitit" / "41"
    old.mkdir(parents=True)
    (old / "41_0_log.out").write_text("an earlier job's log\n")
    (proj / RUN / "submitit" / "notes.txt").write_text("mine\n")
    # _refused's snapshot: submitit's pickled task and submission file are gone again, the
    # earlier job's folder and the user's file are as they were.
    _refused(proj, _launch("--launcher", "slurm"), NO_CONTROLLER,
             FAKE_SBATCH_STDERR=NO_CONTROLLER, **slurm)


# --- shell from a path: line breaks and what sbatch misreads ---------------------------------

CONTROL = {"newline": "\n", "carriage return": "\r", "tab": "\t", "escape": "\x1b",
           "line separator": "\u2028"}


@pytest.mark.parametrize("char", list(CONTROL.values()), ids=list(CONTROL))
def test_run_dir_with_a_control_character(proj: Path, slurm: dict[str, str], char: str) -> None:
    hostile = f"{RUN}{char}touch pwned"
    shutil.copytree(proj / RUN, proj / hostile)
    _refused(proj, _launch("--launcher", "slurm", run_dir=hostile), f"--run-dir {hostile!r}",
             "control character", **slurm)
    assert not _sbatch_ran(slurm) and not (proj / "pwned").exists()


def test_run_dir_with_a_newline_on_the_local_launcher(proj: Path) -> None:
    hostile = f"{RUN}\ntouch pwned"
    shutil.copytree(proj / RUN, proj / hostile)
    _refused(proj, _launch(run_dir=hostile), "--run-dir", "control character")


def test_data_dir_with_a_newline(proj: Path, slurm: dict[str, str]) -> None:
    hostile = f"{DATA}\ntouch pwned"
    (proj / hostile).mkdir()
    _refused(proj, _launch("--launcher", "slurm", data_dir=hostile), "--data-dir",
             "control character", **slurm)
    assert not _sbatch_ran(slurm)


@pytest.mark.parametrize(("name", "needle"), [("fsdp\\x", "backslash"), ("fsdp%x", "'%'")],
                         ids=["backslash", "percent"])
def test_run_dir_sbatch_would_misread(proj: Path, slurm: dict[str, str], name: str,
                                      needle: str) -> None:
    hostile = f"results/runs/{name}"
    shutil.copytree(proj / RUN, proj / hostile)
    _refused(proj, _launch("--launcher", "slurm", run_dir=hostile), "--run-dir", needle, **slurm)
    assert not _sbatch_ran(slurm)


FLAGS = [
    (["--job-name", "zs-r\nrm -rf ~"], "--job-name"),
    (["--partition", "gpu\n#SBATCH --exclusive"], "--partition"),
    (["--account", "acct\rother"], "--account"),
    (["--exclude", "n1\tn2"], "--exclude"),
    (["--constraint", "a100\x7f"], "--constraint"),
    (["--qos", "\x1b[31mhigh"], "--qos"),
    (["--job-env", "A=x\ny"], "--job-env"),
    (["--sbatch", "comment=a\nb"], "--sbatch"),
    (["--sbatch-extra=--comment='a\nb'"], "--sbatch-extra"),
]


@pytest.mark.parametrize(("flags", "flag"), FLAGS, ids=[c[1] for c in FLAGS])
def test_flag_with_a_control_character(proj: Path, slurm: dict[str, str], flags: list[str],
                                       flag: str) -> None:
    _refused(proj, _launch("--launcher", "slurm", *flags), flag, "control character", **slurm)
    assert not _sbatch_ran(slurm)


def test_printable_hostile_run_dir_stays_one_word_in_the_script(proj: Path,
                                                                slurm: dict[str, str]) -> None:
    """Quotes, ``$(...)``, backquotes, ``;``, ``#`` and spaces are a name, not a command: the
    script sbatch got passes the folder whole to srun and to the job's Python, and sbatch's
    own reading of its ``#SBATCH`` lines (shell quotes) gives the whole log paths."""
    hostile = "results/runs/a b #c $(touch pwned) 'q';`touch pwned2`"
    shutil.copytree(proj / RUN, proj / hostile)
    _refused(proj, _launch("--launcher", "slurm", run_dir=hostile), NO_CONTROLLER,
             FAKE_SBATCH_STDERR=NO_CONTROLLER, **slurm)
    out = Path(slurm["FAKE_SLURM_OUT"])
    script = (out / "script").read_text()
    subprocess.run(["bash", str(out / "script")], cwd=proj, env={**os.environ, **slurm},
                   check=True, timeout=60)
    folder = f"{(proj / hostile).resolve()}/submitit/%j"
    srun = (out / "srun").read_bytes().decode().split("\0")[:-1]
    assert srun[srun.index("--output") + 1] == f"{folder}/%j_%t_log.out"
    assert srun[-4:] == ["-u", "-m", "submitit.core._submit", folder]
    directives = [shlex.split(line.removeprefix("#SBATCH"))[0] for line in script.splitlines()
                  if line.startswith("#SBATCH")]
    assert f"--output={folder}/%j_0_log.out" in directives
    assert f"--error={folder}/%j_0_log.err" in directives
    assert not list(proj.rglob("pwned*"))


def test_workflow_rules_quote_every_shell_value() -> None:
    """Every ``{...}`` in a rule's ``shell:`` is ``:q``: a path or value from the config is one
    word of the command, whatever it holds."""
    unquoted, shells, blocks = [], 0, 0
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        text = smk.read_text()
        shells += text.count("shell:")
        for block in re.findall(r'shell:\n((?:\s+".*"\n)+)', text):
            blocks += 1
            for field in re.findall(r"\{([^{}]+)\}", block):
                if not field.endswith(":q"):
                    unquoted.append(f"{smk.name}: {{{field}}}")
    assert shells and blocks == shells, f"read {blocks} of {shells} shell: blocks"
    assert not unquoted, unquoted
