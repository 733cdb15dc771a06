"""Every setting of the train launcher, defined once: default, type and docstring.

:class:`LaunchOptions` is the single source. From it come

* the flags of ``python -m pipeline.train launch`` (:func:`add_arguments`, :func:`from_args`):
  defaults from the fields, help from their docstrings;
* the train rule's ``resources:`` defaults (:data:`LAUNCH_RESOURCES`) and the argument list the
  rule passes (:func:`launch_argv`), so that a profile's ``set-resources: train: ...`` reaches
  the launcher under the resource names the profiles use;
* the node task's policy: the job pickles the same object (budgets, exclude list, job env).

Imports neither torch nor submitit: the Snakefile, render and the login node read it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import re
import shlex
import textwrap
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import PipelineError

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env(items: list[str] | str) -> dict[str, str]:
    """``NAME=VALUE[,NAME=VALUE]`` items (repeatable) → an environment mapping."""
    out: dict[str, str] = {}
    for item in [items] if isinstance(items, str) else items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not _ENV_NAME_RE.match(key):
                raise PipelineError(f"--job-env {part!r}: expected NAME=VALUE")
            out[key] = value
    return out


def parse_sbatch(items: list[str]) -> dict[str, str | bool]:
    """``KEY=VALUE`` or bare ``KEY`` items → extra sbatch options (``True``: a bare flag)."""
    out: dict[str, str | bool] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key:
            raise PipelineError(f"--sbatch {item!r}: expected KEY=VALUE or KEY")
        out[key] = value if sep else True
    return out


def parse_sbatch_extra(items: list[str] | str) -> list[str]:
    """Extra sbatch arguments given as strings, split like a shell would (never run by one)."""
    out: list[str] = []
    for item in [items] if isinstance(items, str) else items:
        out += shlex.split(item)
    return out


def _meta(*, resource: str | None = None, choices: tuple[str, ...] = (),
          repeat: Callable[[list[str]], Any] | None = None,
          metavar: str | None = None, bounds: tuple[float, float] | None = None) -> dict[str, Any]:
    """What the CLI and the rule need to know about a field. ``resource``: its name among the
    train rule's resources (None: not a resource); ``repeat``: a repeatable flag, whose
    strings this function turns into the value; ``bounds``: a number's range (every count and
    duration has one: the launcher sleeps, waits and retries by them)."""
    return {"resource": resource, "choices": choices, "repeat": repeat, "metavar": metavar,
            "bounds": bounds}


#: A year in minutes and in seconds; retries a person would never wait for.
_MAX_MIN = 525_600
_MAX_S = 60 * _MAX_MIN
_MAX_RETRIES = 100_000


def _opt(default: Any = None, **meta: Any) -> Any:
    """A scalar field with a default and :func:`_meta`'s metadata."""
    return field(default=default, metadata=_meta(**meta))


@dataclass(kw_only=True)
class LaunchOptions:
    """How the train stage's job is submitted: resources and budgets, not experiment settings
    (those are in the run's config). The profile sets them (``set-resources: train:``)."""

    launcher: str = _opt("local", resource="launcher", choices=("local", "slurm"))
    """Where the job runs: ``local`` (submitit's local executor, this host) or ``slurm``."""
    partition: str | None = _opt(resource="slurm_partition")
    """Partition of the training job (empty: the cluster's default)."""
    account: str | None = _opt(resource="slurm_account")
    """Account to charge (empty: none)."""
    qos: str | None = _opt(resource="slurm_qos")
    """Quality of service (empty: none)."""
    constraint: str | None = _opt(resource="constraint")
    """Node features, e.g. ``a100`` (empty: any)."""
    exclude: str | None = _opt(resource="slurm_exclude")
    """Nodes not to use, comma-separated; a node that fails the rendezvous is added to the
    job's list automatically."""
    time_min: int = _opt(60, resource="runtime", bounds=(1, _MAX_MIN))
    """Time limit of one job attempt, minutes; requeues continue the run."""
    cpus_per_task: int = _opt(2, resource="cpus_per_task", bounds=(1, 100_000))
    """CPUs per node task (one task per node runs torchrun and its ranks)."""
    mem_gb: float | None = _opt(None, resource="slurm_mem_gb", bounds=(0, 1_000_000))
    """Memory per node in GB (0 or empty: the partition's default)."""
    signal_delay_s: int = _opt(90, resource="signal_delay_s", bounds=(0, _MAX_S))
    """Seconds before the time limit when USR2 asks the job to stop, save and requeue; keep it
    above the checkpoint save time (the launcher warns if not) plus ~30 s."""
    max_requeues: int = _opt(3, resource="max_requeues", bounds=(0, _MAX_RETRIES))
    """Requeues after a time-limit warning before giving up."""
    max_preemptions: int = _opt(10, resource="max_preemptions", bounds=(0, _MAX_RETRIES))
    """Requeues after a preemption (a signal well before the limit) before giving up."""
    max_failures: int = _opt(2, resource="max_failures", bounds=(0, _MAX_RETRIES))
    """Requeues after a rank or node failure, from the last complete checkpoint."""
    hang_timeout_s: int = _opt(300, resource="hang_timeout_s", bounds=(0, _MAX_S))
    """Seconds a rank may go without finishing a step before the job's node task declares it
    hung (frozen, stuck in a collective), names it, kills the ranks (SIGKILL) and retries from
    the last checkpoint within max_failures; 0 turns the watchdog off. Keep it above the
    slowest step and well under the time limit."""
    hang_startup_s: int = _opt(900, resource="hang_startup_s", bounds=(0, _MAX_S))
    """The watchdog's allowance from torchrun's start to the end of the first step (process
    group, checkpoint load, the first step's warm-up)."""
    hang_save_s: int = _opt(900, resource="hang_save_s", bounds=(0, _MAX_S))
    """The watchdog's allowance for a checkpoint save."""
    job_name: str = _opt("zerosnake")
    """Job name as Slurm shows it (the train rule passes ``zs-<run>``)."""
    poll_s: float = _opt(5.0, resource="poll_s", bounds=(0.1, 3600))
    """Seconds between two squeue polls of the waiting launcher."""
    job_env: dict[str, str] = field(default_factory=dict, metadata=_meta(
        resource="job_env", repeat=parse_env, metavar="NAME=VALUE[,NAME=VALUE]"))
    """Environment of the node tasks and ranks, e.g. ``GLOO_SOCKET_IFNAME=eth0`` (repeatable)."""
    sbatch: dict[str, str | bool] = field(default_factory=dict, metadata=_meta(
        repeat=parse_sbatch, metavar="KEY=VALUE"))
    """Extra sbatch option (repeatable), e.g. ``reservation=myres`` (``--reservation=myres``);
    a bare ``KEY`` is a flag."""
    sbatch_extra: list[str] = field(default_factory=list, metadata=_meta(
        resource="sbatch_extra", repeat=parse_sbatch_extra, metavar="ARGS"))
    """Extra sbatch arguments as one string, e.g. ``--reservation=x --exclusive``; split like a
    shell would, passed as arguments, never run by one."""

    @property
    def exclude_hosts(self) -> list[str]:
        """:attr:`exclude` as a list of host names."""
        return [h for h in (self.exclude or "").split(",") if h]


# --------------------------------------------------------------------------------------------
# introspection


@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(LaunchOptions)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            out[node.target.id] = " ".join(nxt.value.value.split())
    return out


def _fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(LaunchOptions)


@functools.cache
def _types() -> dict[str, Any]:
    return typing.get_type_hints(LaunchOptions)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _scalar_type(name: str) -> type:
    """The type a scalar field's CLI string converts to (``X | None`` → ``X``)."""
    tp = _types()[name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def flag_of(name: str) -> str:
    """The CLI flag of a field: ``time_min`` → ``--time-min``."""
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------------------------
# the CLI


def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """One flag per field: default from the field, help from its docstring. An empty string
    (or 0 for a number that may be unset) means "unset" for the optional ones."""
    docs = field_docs()
    for f in _fields():
        default = _default(f)
        help_ = docs.get(f.name, "").replace("``", "").replace("%", "%%")
        meta = f.metadata
        if meta["repeat"] is not None:
            parser.add_argument(flag_of(f.name), dest=f.name, action="append", default=[],
                                metavar=meta["metavar"], help=help_)
            continue
        kind = _scalar_type(f.name)
        shown = "unset" if default is None else default
        parser.add_argument(
            flag_of(f.name), dest=f.name,
            type=str if kind is str else _number(kind, optional=default is None,
                                                  bounds=meta["bounds"]),
            default=default, choices=meta["choices"] or None, metavar=meta["metavar"],
            help=f"{help_} (default: {shown})",
        )


def _number(kind: type, *, optional: bool,
            bounds: tuple[float, float] | None = None) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if optional and text.strip() == "":
            return None
        value = kind(text)
        # 0 unsets an optional number (from_args); NaN fails the range test too.
        if bounds is not None and not (optional and value == 0) \
                and not bounds[0] <= value <= bounds[1]:
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: give a number from {bounds[0]:,} to {bounds[1]:,}")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in its error message
    return convert


def from_args(args: argparse.Namespace) -> LaunchOptions:
    """The options the parsed flags give."""
    values: dict[str, Any] = {}
    for f in _fields():
        value = getattr(args, f.name)
        if f.metadata["repeat"] is not None:
            value = f.metadata["repeat"](value)
        elif _types()[f.name] != _scalar_type(f.name) and not value:
            value = None  # "" or 0: unset
        values[f.name] = value
    return LaunchOptions(**values)


# --------------------------------------------------------------------------------------------
# the train rule


def _resource_default(f: dataclasses.Field) -> int | str:
    """A field's default as a Snakemake resource (int or str only; "" or 0 for unset)."""
    value = _default(f)
    if value is None:
        return 0 if _scalar_type(f.name) in (int, float) else ""
    if isinstance(value, (dict, list)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: The train rule's ``resources:`` (``resources: **LAUNCH_RESOURCES``), defaults from the fields.
LAUNCH_RESOURCES: dict[str, int | str] = {
    f.metadata["resource"]: _resource_default(f) for f in _fields() if f.metadata["resource"]
}


def _lookup(resources: Any, name: str) -> Any:
    if isinstance(resources, Mapping):
        return resources.get(name, LAUNCH_RESOURCES[name])
    return getattr(resources, name, LAUNCH_RESOURCES[name])


def launch_argv(resources: Any) -> list[str]:
    """The launcher's flags for the rule's resources (a Snakemake ``Resources`` object or a
    mapping), one ``--flag=value`` argument each (an empty value stays one argument)."""
    out = []
    for f in _fields():
        name = f.metadata["resource"]
        if name:
            value = _lookup(resources, name)
            out.append(f"{flag_of(f.name)}={'' if value is None else value}")
    return out
