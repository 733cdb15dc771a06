"""Experiment trackers: TensorBoard, MLflow and Weights & Biases, one tracker run per run dir.

``train.trackers`` names them. Rank 0's recorder (``pipeline.train.recorder``) logs every
number of each ``metrics.jsonl`` record (``train/<key>`` at the record's step) and, when a
tracker run is opened, the run's config; the evaluate stage logs its results (``eval/<key>``)
into the same tracker runs. Shared by train and evaluate (stages do not import each other);
torch is imported only for TensorBoard, when it is chosen.

**One tracker run per run dir, across requeues.** ``trackers.json`` in the run dir
(:data:`pipeline.artifacts.TRACKERS`) holds each tracker's run id (MLflow's run id and tracking
URI, W&B's run id, project and folder): a requeued or resumed attempt continues that run
(MLflow: logs to the same run id; W&B: ``resume="allow"`` with the same id). A run whose config
changed starts over from step 0 (its old checkpoints are moved aside), so it gets new tracker
runs: the file records the checkpoint's config hash (``pipeline.checkpoint.format.config_hash``).

**Every step once.** A resumed attempt repeats the steps after its checkpoint. MLflow would keep
both values of a repeated step (its history is append-only), TensorBoard draws both, and W&B
drops a step below its current one. So each tracker logs a step only when it is beyond the
last step it already holds: MLflow's own history says so; for TensorBoard and W&B (offline runs
cannot be asked) it is the newest step in ``metrics.jsonl`` written since the tracker run was
opened (``since_attempt``: metrics records carry their attempt). The recorder logs a step to the
trackers before it appends it to ``metrics.jsonl``, and TensorBoard is flushed every step, so
a step in ``metrics.jsonl`` is in every tracker even when the attempt is killed, except W&B:
its service process writes asynchronously and may drop a SIGKILLed attempt's buffered steps
(tests/test_trackers.py: those are missing, never doubled). The tracker keeps the first
value of a repeated step, as W&B itself does; ``metrics.jsonl``'s readers keep the last (same
loss and data: the repeat replays the same batches; only timings differ).

Where the trackers write: MLflow to ``MLFLOW_TRACKING_URI`` (else a file store in
``<results>/mlruns`` beside ``runs/``, one store for the whole batch: ``mlflow ui
--backend-store-uri results/mlruns``), experiment ``MLFLOW_EXPERIMENT_NAME`` (else
``zerosnake``); W&B to project ``WANDB_PROJECT`` (else ``zerosnake``), files under
``WANDB_DIR`` (else the run dir), online unless ``WANDB_MODE=offline``.

**A tracker never holds up a stage.** Every tracker call (creating or reopening its run, a
step's numbers, the evaluation's, closing) runs with a bound (``ZEROSNAKE_TRACKER_TIMEOUT_S``,
default 30 s; :mod:`pipeline.observe.bounded`); MLflow's HTTP client gets a request timeout of
that bound and one retry unless ``MLFLOW_HTTP_REQUEST_TIMEOUT`` / ``_MAX_RETRIES`` say otherwise
(its defaults, 120 s and 7 retries with backoff, wait minutes on a server that does not
answer), W&B an ``init_timeout`` of it. A failure or timeout is one warning naming the tracker
and where it writes; the stage goes on without that tracker (training tries it again after
:data:`pipeline.observe.bounded.RETRY_AFTER_S`: the steps in between are missing from it, never
doubled). A tracker whose run could not be created is not recorded in ``trackers.json`` (the
next attempt tries again); one that cannot be reopened keeps its entry. A missing package is a
user's setting, refused with the key and how to install it: by the workflow's start-up check
and ``python -m pipeline.config check`` (:mod:`pipeline.observe.packages`), before anything is
queued.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any

from pipeline import artifacts as af
from pipeline.errors import PipelineError
from pipeline.io import write_json_atomic
from pipeline.observe.bounded import Guarded, bounded, call_timeout, reason, warn
from pipeline.observe.packages import missing

#: What each tracker imports, imported before any bounded call: an import takes seconds on a
#: busy node and is no sign of a server that does not answer.
_MODULES = {"tensorboard": ("tensorboard", "torch.utils.tensorboard"),
            "mlflow": ("mlflow.entities", "mlflow.tracking"), "wandb": ("wandb",)}
DEFAULT_PROJECT = "zerosnake"
#: MLflow's params: at most 100 per batch call, values at most 6000 characters.
_MLFLOW_PARAMS_PER_CALL = 100
_MLFLOW_PARAM_LEN = 6000


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scalars(rec: dict[str, Any], prefix: str) -> dict[str, float]:
    """The finite numbers of a (nested) record as ``prefix/key[/subkey]`` → float. Characters
    MLflow refuses in a key (lm-eval's ``acc,none``) become ``_``."""
    out: dict[str, float] = {}
    for key, value in rec.items():
        name = f"{prefix}/{re.sub(r'[^A-Za-z0-9_./ -]', '_', str(key))}"
        if isinstance(value, dict):
            out.update(scalars(value, name))
        elif _number(value):
            out[name] = float(value)
    return out


def flatten_config(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys → strings (MLflow params)."""
    out: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = str(value)[:_MLFLOW_PARAM_LEN]
    return out


def _import(name: str) -> None:
    """Import what tracker ``name`` uses; a package that is missing or broken is the same clear
    error as the login node's check (:mod:`pipeline.observe.packages`; the training node's
    environment may differ)."""
    try:
        for module in _MODULES[name]:
            importlib.import_module(module)
    except ImportError:
        raise missing(name) from None


class TensorBoardTracker:
    """TensorBoard event files in ``<run_dir>/tb`` (one folder per run dir: continued as is)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, entry: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / af.TB_DIR))

    @staticmethod
    def create(run_dir: Path, run_name: str, config: dict[str, Any]) -> dict[str, Any]:
        return {"dir": af.TB_DIR}

    @staticmethod
    def target(run_dir: Path, entry: dict[str, Any] | None) -> str:
        return str(run_dir / af.TB_DIR)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a killed attempt must not lose steps metrics.jsonl has

    def last_step(self) -> int | None:
        return None  # not queried: metrics.jsonl's mark

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run, reopened by its id on every attempt (``MlflowClient``: no global state)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, entry: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=_mlflow_uri(entry["tracking_uri"]))
        self.run_id = entry["run_id"]

    @staticmethod
    def create(run_dir: Path, run_name: str, config: dict[str, Any]) -> dict[str, Any]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = MLflowTracker.target(run_dir, None)
        client = MlflowClient(tracking_uri=_mlflow_uri(uri))
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        exp = client.get_experiment_by_name(exp_name)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            try:
                exp_id = client.create_experiment(exp_name)
            except Exception:  # another run created it meanwhile (MlflowException)
                exp_id = client.get_experiment_by_name(exp_name).experiment_id
        run = client.create_run(exp_id, run_name=run_name, tags={"zerosnake.run_dir": str(run_dir)})
        params = [Param(k, v) for k, v in flatten_config(config).items()]
        for i in range(0, len(params), _MLFLOW_PARAMS_PER_CALL):
            client.log_batch(run.info.run_id, params=params[i:i + _MLFLOW_PARAMS_PER_CALL])
        return {"tracking_uri": uri, "experiment_id": exp_id, "run_id": run.info.run_id}

    @staticmethod
    def target(run_dir: Path, entry: dict[str, Any] | None) -> str:
        """The tracking URI the run's entry names, else the one a new run would use."""
        if entry is not None:
            return str(entry.get("tracking_uri"))
        return os.environ.get("MLFLOW_TRACKING_URI") or (
            (run_dir.resolve().parent.parent / "mlruns").as_uri())

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in metrics.items()])

    def last_step(self) -> int | None:
        """The newest step the run holds (its own record: exact even after a kill)."""
        history = self.client.get_metric_history(self.run_id, "train/loss")
        return max((m.step for m in history), default=0)

    def close(self) -> None:
        # Not set_terminated: the run stays open for the next attempt and the evaluation.
        pass


def _mlflow_uri(uri: str) -> str:
    """MLflow ≥ 3.7 refuses its file store unless asked for it: the store this module picks by
    default (no server, no database) is one, so opt in for file URIs only. A server gets a
    request timeout of the call's bound and one retry (MLflow's own defaults retry for minutes;
    a call is given up at the bound anyway, and its abandoned thread should end soon after)."""
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(call_timeout()))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    return uri


class WandbTracker:
    """One W&B run, resumed by its id (``resume="allow"``) on every attempt; offline runs leave
    one ``offline-run-*`` folder per attempt, all with the same id (``wandb sync`` joins them)."""

    name = "wandb"

    def __init__(self, run_dir: Path, entry: dict[str, Any], config: dict[str, Any] | None = None
                 ) -> None:
        import wandb

        folder = Path(entry.get("dir") or run_dir)  # None: the run dir, wherever it is now
        folder.mkdir(parents=True, exist_ok=True)
        # init_timeout: W&B's own wait for its server (90 s by default) would outlive the
        # call's bound, and its service holds the process's exit until it ends.
        self.run = wandb.init(
            id=entry["id"], project=entry["project"], name=entry["name"], dir=str(folder),
            resume="allow", config=config,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                    init_timeout=call_timeout()),
        )

    @staticmethod
    def create(run_dir: Path, run_name: str, config: dict[str, Any]) -> dict[str, Any]:
        return {"id": f"{run_name}-{uuid.uuid4().hex[:8]}", "name": run_name,
                "project": os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                "dir": os.environ.get("WANDB_DIR")}

    @staticmethod
    def target(run_dir: Path, entry: dict[str, Any] | None) -> str:
        project = (entry or {}).get("project") or os.environ.get("WANDB_PROJECT") \
            or DEFAULT_PROJECT
        if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
            return f"project {project}, {os.environ['WANDB_MODE']}"
        return f"project {project} at {os.environ.get('WANDB_BASE_URL') or 'api.wandb.ai'}"

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def last_step(self) -> int | None:
        return None  # an offline run cannot be asked: metrics.jsonl's mark

    def summary(self, metrics: dict[str, float]) -> None:
        self.run.summary.update(metrics)

    def close(self) -> None:
        self.run.finish()


BACKENDS: dict[str, Any] = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker,
                            "wandb": WandbTracker}
#: The string fields each tracker's entry in trackers.json needs to reopen its run.
_ENTRY_KEYS = {"tensorboard": (), "mlflow": ("tracking_uri", "run_id"),
               "wandb": ("id", "project", "name")}


def _last_logged(run_dir: Path, since_attempt: int) -> int:
    """The newest step in metrics.jsonl written by attempt ``since_attempt`` or later: what a
    tracker opened at that attempt already holds."""
    steps = [r["step"] for r in af.read_jsonl(run_dir / af.METRICS)
             if type(r.get("step")) is int and type(r.get("attempt")) is int
             and r["attempt"] >= since_attempt]
    return max(steps, default=0)


def read_state(path: Path) -> dict[str, Any]:
    """``trackers.json`` as ``{"config_hash", "runs": {name: entry}}``; a file that cannot be
    read or is not that shape is reported and taken as empty (its tracker runs are not
    continued: new ones are made), never a failed stage."""
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
        if not (isinstance(state, dict) and isinstance(state.get("runs", {}), dict)):
            raise ValueError(f"a JSON {type(state).__name__} without a runs object")
    except (OSError, ValueError, RecursionError) as err:
        warn(f"{path} cannot be read ({reason(err, 0)}); its tracker runs are not continued")
        return {}
    return state


def _valid(name: str, entry: Any, since: bool) -> bool:
    """An entry of trackers.json that reopens tracker ``name``'s run."""
    return (isinstance(entry, dict)
            and all(isinstance(entry.get(k), str) and entry[k] for k in _ENTRY_KEYS[name])
            and (not since or type(entry.get("since_attempt")) is int))


def _open(name: str, run_dir: Path, entry: dict[str, Any],
          config: dict[str, Any] | None) -> tuple[Any, int | None]:
    """Reopen tracker ``name``'s run: (the tracker, the newest step it holds, when it can say)."""
    tracker = (WandbTracker(run_dir, entry, config) if name == "wandb"
               else BACKENDS[name](run_dir, entry))
    return tracker, tracker.last_step()


class Trackers:
    """The run's open trackers. :meth:`for_training` opens (or creates) them for an attempt;
    :meth:`for_evaluation` reopens the ones training created. Every call to a tracker is
    bounded and its failure a warning (the module docstring)."""

    def __init__(self, run_dir: Path, opened: list[tuple[Any, int, Guarded]]) -> None:
        self.run_dir = run_dir
        self.opened = opened  # (tracker, last step it holds, its guard)

    @staticmethod
    def _label(name: str, run_dir: Path, entry: dict[str, Any] | None) -> str:
        return f"tracker {name} ({BACKENDS[name].target(run_dir, entry)})"

    @classmethod
    def for_training(cls, run_dir: Path, names: list[str], config: dict[str, Any],
                     config_hash: str, attempt: int) -> Trackers:
        """Open each tracker of ``names`` for attempt ``attempt``: the tracker run recorded in
        ``trackers.json`` when it was opened for this config, else a new one (recorded once it
        exists). A missing package is a :class:`PipelineError`; a tracker that fails or does not
        answer is warned about and left out."""
        for name in names:
            _import(name)
        timeout = call_timeout()
        path = run_dir / af.TRACKERS
        # Checked field by field (af.TRACKERS_SHAPE): a malformed record is an error naming
        # it before any tracker is opened (nothing of the user's run ids is replaced).
        state = af.read_trackers(run_dir) or {}
        if state.get("config_hash") != config_hash:
            state = {"config_hash": config_hash, "runs": {}}
        runs = state.setdefault("runs", {})
        for name in names:
            if _valid(name, runs.get(name), since=True):
                continue
            runs.pop(name, None)
            try:
                entry = bounded(BACKENDS[name].create, run_dir, run_dir.name, config,
                                timeout=timeout)
            except Exception as err:
                warn(f"{cls._label(name, run_dir, None)}: creating its run failed "
                     f"({reason(err, timeout)}); training goes on without it")
                continue
            runs[name] = {**entry, "since_attempt": attempt}
            write_json_atomic(path, state)  # each run as soon as it exists
        write_json_atomic(path, state)
        opened = []
        for name in names:
            if name not in runs:
                continue
            entry, label = runs[name], cls._label(name, run_dir, runs[name])
            try:
                tracker, own = bounded(_open, name, run_dir, entry, config, timeout=timeout)
            except Exception as err:
                warn(f"{label}: reopening its run failed ({reason(err, timeout)}); this "
                     "attempt goes on without it")
                continue
            last = own if own is not None else _last_logged(run_dir, entry["since_attempt"])
            opened.append((tracker, last, Guarded(label, timeout)))
        return cls(run_dir, opened)

    @classmethod
    def for_evaluation(cls, run_dir: Path, names: list[str]) -> Trackers:
        """The trackers training opened for this run (those of ``names`` it recorded; none
        when training recorded none). Never raises: the evaluation is written already (and
        evaluate checked trackers.json before it began)."""
        runs = read_state(run_dir / af.TRACKERS).get("runs") or {}
        timeout = call_timeout()
        opened = []
        for name in names:
            if name not in runs or name not in BACKENDS:
                continue
            entry = runs[name]
            if not _valid(name, entry, since=False):
                warn(f"{run_dir / af.TRACKERS}: its {name} entry does not name a run; the "
                     "evaluation is not logged to it")
                continue
            label = cls._label(name, run_dir, entry)
            try:
                _import(name)
            except PipelineError as err:
                warn(f"{label}: {err}; the evaluation is not logged to it")
                continue
            try:
                tracker = bounded(BACKENDS[name], run_dir, entry, timeout=timeout)
            except Exception as err:
                warn(f"{label}: reopening its run failed ({reason(err, timeout)}); the "
                     "evaluation is not logged to it")
                continue
            opened.append((tracker, 0, Guarded(label, timeout)))
        return cls(run_dir, opened)

    def log_step(self, rec: dict[str, Any]) -> None:
        """A metrics.jsonl record's numbers (``train/<key>``), to each tracker that does not
        hold its step yet (and answers)."""
        step = rec["step"]
        metrics = scalars({k: v for k, v in rec.items() if k not in ("step", "attempt")},
                          "train")
        for i, (tracker, last, guard) in enumerate(self.opened):
            if step > last and guard.call(f"logging step {step}", tracker.log, metrics, step):
                self.opened[i] = (tracker, step, guard)

    def log_eval(self, results: dict[str, Any], step: int) -> None:
        """The evaluation's numbers (``eval/<key>``) at the evaluated step; W&B's in the run's
        summary too (W&B refuses a step below the run's current one)."""
        metrics = scalars(results, "eval")
        for tracker, _, guard in self.opened:
            if isinstance(tracker, WandbTracker):
                guard.call("logging the evaluation", tracker.summary, metrics)
            else:
                guard.call("logging the evaluation", tracker.log, metrics, step)

    def close(self) -> None:
        for tracker, _, guard in self.opened:
            guard.call("closing its run", tracker.close, after_pause=False)
        self.opened = []
