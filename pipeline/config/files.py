"""Config files: read strictly, merged as a workflow start merges them, and checked; the
``python -m pipeline.config`` command; command-line options that mirror config fields. The typed
classes are :mod:`pipeline.config.schema` (which re-exports these names).

Config files combine as a workflow start reads them (:func:`workflow_config_raw`, used by the
Snakefile and by ``python -m pipeline.config check``): ``config/config.yaml`` from the working
directory, then each ``--configfile``, then ``--config`` values, each deep-merged over the ones
before, except that a file's ``runs:`` replaces the earlier runs as a whole (a user's batch of
runs never inherits the default ``fsdp`` and ``deepspeed`` runs) and lists are replaced. Every
file is read strictly (:func:`load_yaml`): a duplicate key is an error naming it and its line.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_args

import yaml

from pipeline.config.schema import (
    _SECTION,
    Config,
    RunConfig,
    SourceConfig,
    _validate,
    model_base,
)
from pipeline.errors import PipelineError
from pipeline.io import deep_merge
from pipeline.text.sources import expand_paths

if TYPE_CHECKING:
    from pydantic import BaseModel



def parse_config(raw: dict[str, Any]) -> Config:
    """Validate a config dict (e.g. Snakemake's ``config``), every run's effective config, and
    the local paths it names (``model.init_from``, ``data.tokenizer.path``)."""

    if not isinstance(raw, dict):
        raise PipelineError("invalid config: the top level must be a mapping")
    cfg: Config = _validate(Config, raw)
    for name in cfg.runs:
        cfg.run(name)  # raises with the run's key path on impossible combinations
    _check_paths(cfg)
    return cfg


def _check_paths(cfg: Config) -> None:
    """A local input the config names must be there now, not when a job reaches it."""
    problems: list[str] = []
    tok = cfg.data.tokenizer.path
    if tok is not None and not Path(tok).exists():
        problems.append(f"  data.tokenizer.path: {tok!r} does not exist (a local HF tokenizer "
                        "directory or tokenizer.json)")
    for name, over in cfg.runs.items():
        init = cfg.run(name).model.init_from
        if init is None:
            continue
        key = f"runs.{name}.model.init_from" if "init_from" in (over.model or {}) \
            else "model.init_from"
        if not (Path(init) / "config.json").is_file():
            what = "is not an HF model directory (no config.json)" if Path(init).is_dir() \
                else "does not exist"
            line = f"  {key}: {init!r} {what}"
            if line not in problems:
                problems.append(line)
    if problems:
        raise PipelineError("invalid config:\n" + "\n".join(problems))


# -- reading and merging config files --------------------------------------------------------------
#: The workflow's own default config. The Snakefile's ``configfile:`` reads it relative to the
#: directory Snakemake runs in; ``config check`` reads it from the same place.
DEFAULT_CONFIG = Path("config") / "config.yaml"
_MAX_CONFIG_BYTES = 4 << 20
_MAX_CONFIG_VALUES = 1_000_000
_MAX_CONFIG_DEPTH = 32


def _refuse_duplicate_keys(root: yaml.Node, where: str) -> None:
    """A key given twice in one mapping (YAML and JSON loaders keep the last one silently)."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    visited: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in visited:  # an alias: checked where its anchor is
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for k, v in node.value:
                if k.tag == "tag:yaml.org,2002:merge":
                    stack.append((v, path))
                    continue
                name = k.value if isinstance(k, yaml.ScalarNode) else "<complex key>"
                key = f"{path}.{name}" if path else str(name)
                line = k.start_mark.line + 1
                if isinstance(k, yaml.ScalarNode):
                    if (k.tag, k.value) in seen:
                        raise PipelineError(
                            f"config file {where}, line {line}: duplicate key {key} (first at "
                            f"line {seen[(k.tag, k.value)]}); a YAML loader would silently keep "
                            "only the last one: remove one of them or merge the two blocks"
                        )
                    seen[(k.tag, k.value)] = line
                stack.append((v, key))


def _refuse_huge(data: Any, where: str) -> None:
    """Aliases expand: a few lines of YAML can stand for billions of values (or a cycle); and
    a config nested deeper than any real one would overflow the recursive merge and checks."""
    budget = _MAX_CONFIG_VALUES
    stack = [(data, 0)]
    while stack:
        obj, depth = stack.pop()
        budget -= 1
        if budget < 0:
            raise PipelineError(f"config file {where}: expands to more than "
                                f"{_MAX_CONFIG_VALUES:,} values (recursive or nested YAML aliases?)")
        if depth > _MAX_CONFIG_DEPTH:
            raise PipelineError(f"config file {where}: nested more than {_MAX_CONFIG_DEPTH} "
                                "levels deep")
        if isinstance(obj, dict):
            stack.extend((v, depth + 1) for v in obj.values())
        elif isinstance(obj, list):
            stack.extend((v, depth + 1) for v in obj)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _JsonDuplicate(key)
        out[key] = value
    return out


class _JsonDuplicate(ValueError):
    pass


def load_yaml(path: str | Path) -> Any:
    """Read one config file (JSON or YAML, as Snakemake reads ``--configfile``) strictly: a
    duplicate key, a file that is not UTF-8 text, or one whose aliases expand past a million
    values is an error naming the file (and the key and line)."""
    p = Path(path)
    try:
        if p.stat().st_size > _MAX_CONFIG_BYTES:
            raise PipelineError(f"config file {p} is larger than {_MAX_CONFIG_BYTES >> 20} MiB")
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PipelineError(f"config file {p} does not exist") from None
    except UnicodeDecodeError as err:
        raise PipelineError(f"config file {p} is not UTF-8 text ({err.reason} at byte "
                            f"{err.start})") from None
    except OSError as err:
        raise PipelineError(f"config file {p} cannot be read: {err.strerror or err}") from None
    if "\x00" in text:
        raise PipelineError(f"config file {p} holds a NUL byte (not a text file)")
    try:  # JSON first, as Snakemake's loader does (`1e9` is a number in JSON, a string in YAML)
        data = json.loads(text, object_pairs_hook=_json_pairs)
    except _JsonDuplicate as dup:
        _load_yaml_text(text, p)  # reports the duplicate with its line
        raise PipelineError(f"config file {p}: duplicate key {dup} (a JSON loader keeps only "
                            "the last one)") from None
    except RecursionError:
        raise PipelineError(f"config file {p}: nested too deeply") from None
    except ValueError:
        data = _load_yaml_text(text, p)
    _refuse_huge(data, str(p))
    return data


def _load_yaml_text(text: str, p: Path) -> Any:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, str(p))
        data = loader.construct_document(node)
    except yaml.YAMLError as err:
        raise PipelineError(f"config file {p} is not valid YAML: {err}") from None
    except RecursionError:
        raise PipelineError(f"config file {p}: nested too deeply") from None
    finally:
        loader.dispose()
    if isinstance(data, dict) and data.get("__use_yte__"):
        # Snakemake renders YTE templates in config files that ask for it; so do we.
        try:
            import yte

            data = yte.process_yaml(text, require_use_yte=True)
        except ImportError:
            raise PipelineError(f"config file {p} uses YTE templating (__use_yte__) but yte "
                                "is not installed") from None
        except Exception as err:  # a template error is the user's to fix
            raise PipelineError(f"config file {p}: YTE template error: {err}") from None
    return data


def merge_config(base: dict[str, Any], override: Any, *, where: str = "") -> dict[str, Any]:
    """``override`` (one config file, or ``--config`` values) merged over ``base``, as the
    workflow merges config files: every section is deep-merged, except ``runs``, which an
    override that has it replaces as a whole (a user's batch of runs never inherits the
    default's ``fsdp`` and ``deepspeed`` runs). Lists (``data.sources``) are replaced. A
    ``model.preset`` or ``model.init_from`` replaces the earlier model's shape
    (:func:`~pipeline.config.schema.model_base`)."""
    if override is None:  # an empty file
        return copy.deepcopy(base)
    if not isinstance(override, dict):
        raise PipelineError(f"invalid config{' file ' + where if where else ''}: the top level "
                            f"must be a mapping (got {type(override).__name__})")
    if "runs" in override:
        base = {k: v for k, v in base.items() if k != "runs"}
    if isinstance(base.get("model"), dict):
        base = {**base, "model": model_base(base["model"], override.get("model"))}
    return deep_merge(base, override)


def config_files(user_files: list[str | Path], *, replace_default: bool = False,
                 default: Path = DEFAULT_CONFIG) -> list[Path]:
    """The files a workflow start reads, in merge order: the default (when present in the
    working directory, as Snakemake's ``configfile:`` reads it, and unless replaced), then each
    ``--configfile``."""
    files = [] if replace_default or not default.exists() else [default]
    return files + [Path(f) for f in user_files]


def workflow_config_raw(user_files: list[str | Path], overrides: dict[str, Any] | None = None,
                        *, replace_default: bool = False) -> dict[str, Any]:
    """The raw config a workflow start validates: :func:`config_files` read strictly
    (:func:`load_yaml`) and merged in order (:func:`merge_config`), then ``--config`` values."""
    raw: dict[str, Any] = {}
    for f in config_files(user_files, replace_default=replace_default):
        raw = merge_config(raw, load_yaml(f), where=str(f))
    if overrides:
        raw = merge_config(raw, dict(overrides), where="--config")
    return raw


def load_config(path: str | Path) -> Config:
    """Read and validate one config file (strictly: :func:`load_yaml`)."""
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise PipelineError(f"invalid config file {path}: the top level must be a mapping")
    return parse_config(raw)


def parse_run_config(raw: dict[str, Any]) -> RunConfig:
    """Validate one run's effective config (as ``Config.run`` returns it, dumped to JSON)."""

    return _validate(RunConfig, raw)


def load_run_config(path: str | Path) -> RunConfig:
    """Read a rendered run's ``config.json``; a missing, unreadable or invalid one is an error
    naming the file."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{p} does not exist: render the run first (the render rule "
                            "writes it)") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise PipelineError(f"{p} is not a readable run config ({err}); render the run "
                            "again") from None
    if not isinstance(raw, dict):
        raise PipelineError(f"{p}: a run config must be a JSON object; render the run again")
    try:
        return parse_run_config(raw)
    except PipelineError as err:
        raise PipelineError(f"{p}: {err}") from None


def expand_sources(sources: list[SourceConfig]) -> list[Path]:
    """All input files of ``data.sources``, expanded exactly as the tokenizer and tokenize
    stages expand them (:func:`pipeline.text.sources.expand_paths`); a source that matches nothing is
    an error."""
    out: list[Path] = []
    for i, src in enumerate(sources):
        files = expand_paths(src.path)
        if not files:
            raise PipelineError(
                f"data.sources.{i}.path: {src.path!r} matches no file; check the path or glob "
                "(relative paths are relative to the directory Snakemake runs in)"
            )
        out.extend(Path(f) for f in files)
    return out


def field_default(cls: type[BaseModel], name: str) -> Any:
    """The default of a config field (``field_default(DataConfig, "val_fraction")``): what a
    command-line option that mirrors the field defaults to."""
    info = cls.model_fields[name]
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    if info.is_required():
        raise KeyError(f"{cls.__name__}.{name} has no default")
    return info.default


def field_choices(cls: type[BaseModel], name: str) -> tuple[Any, ...]:
    """The values a ``Literal`` config field allows, in their declared order."""
    choices = tuple(a for a in get_args(cls.model_fields[name].annotation) if a is not None)
    if not choices or any(not isinstance(c, str | int) for c in choices):
        raise TypeError(f"{cls.__name__}.{name} is not a Literal field")
    return choices


def field_help(cls: type[BaseModel], name: str, *, default: bool = True) -> str:
    """Help text of a command-line option that mirrors a config field: the field's docstring,
    its config key and (unless ``default=False``) its default; ready for argparse."""
    text = " ".join((cls.model_fields[name].description or "").split()).replace("``", "")
    text = text.rstrip(".")

    key = f"{_SECTION[cls]}.{name}" if cls in _SECTION else name
    tail = f"config: {key}"
    if default:
        tail += f"; default: {field_default(cls, name)}"
    return f"{text} ({tail})".replace("%", "%%")


def mirror_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    cls: type[BaseModel],
    name: str,
    **kwargs: Any,
) -> argparse.Action:
    """Add a command-line option that mirrors a config field: the field's default, help text
    (:func:`field_help`) and, for a ``Literal`` field, its choices; ``kwargs`` override them
    (``required=True`` keeps the option without a default)."""
    info = cls.model_fields[name]
    own = None if info.is_required() else field_default(cls, name)
    if "default" not in kwargs and not kwargs.get("required"):
        kwargs["default"] = own
    same = "default" in kwargs and kwargs["default"] == own
    kwargs.setdefault("help", field_help(cls, name, default=same))
    if isinstance(own, bool):
        kwargs.setdefault("action", "store_true" if not own else argparse.BooleanOptionalAction)
    elif "choices" not in kwargs:
        try:
            kwargs["choices"] = field_choices(cls, name)
        except TypeError:
            base = kwargs.get("type") or _number_type(info.annotation)
            if base is not None:
                # The field's own limits, checked as the option is parsed: a command given
                # `--seq-len 1000000000000` stops there, before it allocates anything.
                kwargs["type"] = base
                kwargs.setdefault("action", _Checked)
                kwargs["check"] = field_check(cls, name, base)
    return parser.add_argument(flag, **kwargs)


class _Checked(argparse.Action):
    """Store the option's (converted) value when ``check`` finds no problem with it, else
    argparse's ``error: --flag VALUE: problem`` (exit status 2)."""

    def __init__(self, *args: Any, check: Callable[[Any], str | None], **kwargs: Any) -> None:
        self.check = check
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        problem = self.check(values)
        if problem:
            parser.error(f"{option_string} {values}: {problem}")
        setattr(namespace, self.dest, values)


def _number_type(annotation: Any) -> type | None:
    """``int`` or ``float`` for a field typed so (``int | None`` too), else None."""
    for t in (annotation, *get_args(annotation)):
        if t in (int, float):
            return t
    return None


def field_check(cls: type[BaseModel], name: str, base: type = int) -> Callable[[Any], str | None]:
    """What is wrong with a value for a numeric config field (its limits; no infinities or
    NaN), naming the config key; None when nothing is."""
    from pydantic import ConfigDict, TypeAdapter, ValidationError

    info = cls.model_fields[name]
    key = f"{_SECTION[cls]}.{name}" if cls in _SECTION else name
    adapter = TypeAdapter(Annotated[(base, *info.metadata)],
                          config=ConfigDict(allow_inf_nan=False))

    def check(value: Any) -> str | None:
        try:
            adapter.validate_python(value)
        except ValidationError as err:
            msg = (err.errors()[0]["msg"].replace("Input should be", "must be")
                   .replace("less than or equal to", "at most")
                   .replace("greater than or equal to", "at least"))
            return f"{msg} (config: {key})"
        return None

    return check


def in_range(low: float, high: float, what: str = "a value") -> dict[str, Any]:
    """``add_argument`` keywords that hold an option mirroring no config field (a count, a
    size) to ``[low, high]``: ``error: --flag VALUE: give ... from low to high`` (exit 2)."""

    def check(value: Any) -> str | None:
        return None if low <= value <= high else f"give {what} from {low:,} to {high:,}"

    return {"action": _Checked, "check": check}
