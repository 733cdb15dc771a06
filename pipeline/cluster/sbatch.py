"""The Slurm submission of a training job, as a pure function: the exact sbatch argument list
and submission script that the launcher hands to sbatch (render previews the same).

Every user-supplied string (job name, partition, account, qos, constraint, exclude list, extra
options, the job's environment) stays out of the script: the strings go on sbatch's argv, one
argument each, which sbatch reads as data whatever they contain (quotes, ``$(...)``, a
newline); the environment travels in the pickled task. The script holds only what the launcher
computes (node and CPU counts, time, memory, the USR2 warning) and two paths, the job folder
(from the run directory) and the interpreter, in submitit's own layout, which its job
environment relies on (``srun --unbuffered``, ``SUBMITIT_EXECUTOR``). Both paths are quoted
wherever they appear (``shlex.quote``: by :func:`submitit_command`, and by submitit in the
``#SBATCH`` lines, whose parser honours shell quotes too), and refused when they hold a
control character: no quoting keeps a newline inside an ``#SBATCH`` line, the text after it
would run as a command (:func:`check_folder`).

Torch-free; imports submitit's script writer only (no executor, no Slurm commands).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from submitit.slurm.slurm import _make_sbatch_string

from pipeline.cluster.options import SBATCH_KEY_RE, LaunchOptions, check_numbers, check_text
from pipeline.errors import PipelineError

#: What ``job.json`` and ``launch.json`` show in place of the submission file's path (submitit
#: chooses it at submission: ``<folder>/.submission_file_<uuid>.sh``).
SUBMISSION_FILE = "<submission file>"


@dataclass(frozen=True)
class Submission:
    """What is handed to sbatch: ``[*argv, <submission file>]`` with ``script`` in that file."""

    argv: list[str]
    """``sbatch`` and its options (the submission file's path follows them)."""
    script: str
    """The submission file's text."""
    params: dict[str, Any] = field(default_factory=dict)
    """submitit's parameters the script was written from (the executor needs them too: tasks,
    time limit)."""

    def command(self, submission_file: str | Path = SUBMISSION_FILE) -> list[str]:
        """The whole sbatch command line for a submission file."""
        return [*self.argv, str(submission_file)]


def sbatch_options(opts: LaunchOptions) -> list[str]:
    """Options passed on sbatch's argv (every one a single argument: no shell, no quoting)."""
    out = [f"--job-name={opts.job_name}", "--requeue"]
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        value = getattr(opts, key)
        if value:
            out.append(f"--{key}={value}")
    for key, value in opts.sbatch.items():
        if not SBATCH_KEY_RE.match(key):
            raise PipelineError(f"extra sbatch option {key!r}: not an option name")
        flag = "--" + key.replace("_", "-")
        out.append(flag if value is True else f"{flag}={value}")
    for arg in opts.sbatch_extra:
        if not arg.startswith("--"):
            raise PipelineError(f"extra sbatch argument {arg!r} must start with --")
        out.append(arg)
    return out


def submitit_parameters(opts: LaunchOptions, *, nodes: int, gpus_per_node: int,
                        device: str) -> dict[str, Any]:
    """The script's settings, as submitit's Slurm executor names them. ``job_name`` and
    ``wckey`` are None: the name is on argv, and no line in the script should contradict it."""
    params: dict[str, Any] = {
        "job_name": None,
        "wckey": None,
        "nodes": nodes,
        "ntasks_per_node": 1,
        "cpus_per_task": opts.cpus_per_task,
        "time": opts.time_min,
        "signal_delay_s": opts.signal_delay_s,
    }
    if device != "cpu":
        params["gpus_per_node"] = gpus_per_node
    if opts.mem_gb:
        params["mem"] = f"{int(opts.mem_gb * 1024)}M"
    return params


def submitit_command(folder: str | Path, python: str | None = None) -> str:
    """The script's command: submitit's job runner on the pickled task in ``folder``
    (``SlurmExecutor._submitit_command_str``)."""
    python = shlex.quote(sys.executable) if python is None else python
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])


def check_folder(folder: str | Path) -> None:
    """Refuse a job folder the script cannot carry: a control character (a newline ends the
    line, the rest would run as a command), a backslash (sbatch's directive parser drops it,
    even between quotes: the logs would go elsewhere), or a ``%`` before the job id's ``%j``
    (Slurm and submitit read ``%j``, ``%t``, ... in these paths as the job's numbers)."""
    text = str(folder)
    what = "the job folder (under --run-dir)"
    check_text(text, what)
    if "\\" in text:
        raise PipelineError(f"{what} {text!r} holds a backslash, which sbatch drops from its "
                            "log paths: use a run directory whose path has none")
    if "%" in text.removesuffix("%j"):
        raise PipelineError(f"{what} {text!r} holds a '%', which Slurm reads as the start of "
                            "a file name pattern (%j: the job id): use a run directory whose "
                            "path has none")


def render_submission(opts: LaunchOptions, *, nodes: int, gpus_per_node: int, device: str,
                      folder: str | Path, python: str | None = None) -> Submission:
    """The submission of a run's training job: sbatch's argv and the script, exactly as
    submitted. ``folder``: submitit's job folder (``<run>/submitit/%j``); ``python``: the
    interpreter's shell word in the script (default: this one, quoted)."""
    check_numbers(opts)
    check_folder(folder)
    check_text(sys.executable if python is None else python, "the Python interpreter's path")
    params = submitit_parameters(opts, nodes=nodes, gpus_per_node=gpus_per_node, device=device)
    script = _make_sbatch_string(command=submitit_command(folder, python), folder=folder,
                                 **params)
    return Submission(argv=["sbatch", *sbatch_options(opts)], script=script, params=params)
