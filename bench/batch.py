"""Batch load (issue 12): a many-run config through ``snakemake --profile profiles/slurm`` on the
test Slurm cluster; every run must complete exactly once.

    .venv/bin/python bench/batch.py [--runs 50] [--steps 3] [--until train] [--keep DIR]

Starts the local test cluster (root; ``bash tests/cluster/install.sh`` once; 2 nodes x 2 CPUs;
it waits for the cluster lock while another session's cluster runs) unless ``SLURM_CONF`` names
a running one (``tests/cluster/slurmcluster.py start``) or ``ZEROSNAKE_SLURM_PARTITION`` a
site's cluster (then ``ZEROSNAKE_SLURM_SHARED_DIR`` must hold the work folder). One config
holds ``--runs`` tiny runs (1 node x 1 process, a 1-layer 32-wide Llama, ``--steps`` steps, one
checkpoint at the end, a seed of their own) that share one tokenization (one tokenizer, 2 shard
jobs, one manifest). Snakemake runs the whole DAG (``--until train``: up to training) through
the real slurm profile: shard, consolidate and evaluate jobs go through the executor plugin;
each train rule submits one training job through submitit and waits for it.

While Snakemake runs, a watcher polls ``squeue -t all`` every 2 s (finished jobs stay listed for
MinJobAge, so none is missed) and keeps every job whose working directory is this workflow's,
with ``scontrol``'s restart count and times as each job ends; where the cluster keeps
accounting, ``sacct`` adds its rows at the end (the test cluster has no slurmdbd). The audit:

* problems (exactly-once broken): a run without ``train.done`` at the last step or without its
  model and evaluation; ``job.json``/``events.jsonl`` recording a second submission or a
  reattach (the train rule ran twice); not exactly one Slurm training job ``zs-<run>`` (the id
  job.json names, COMPLETED), consolidate job or evaluate job per run, or shard job per shard;
  a step missing from ``metrics.jsonl``; jobs from this workflow of another kind.
* incidents (a retry inside the one job): failure/requeue/hang events, Slurm restarts of a job,
  a second trainer start, steps computed again after a resume. The run still completed once.

It prints the wall time, the Slurm jobs by kind (with mean run and queue seconds), runs
completed, duplicates (extra Slurm jobs or submissions), retries and lost runs, then one JSON
line; the exit status is 1 when a run was lost or duplicated or anything else is a problem.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Run as a script, bench/ is sys.path[0], and bench/tokenize.py would shadow the standard
# library's tokenize (which inspect/linecache need): drop it.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
for _p in (REPO, REPO / "tests" / "cluster", REPO / "tests" / "slurm"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import pipeline_helpers as h  # noqa: E402
import slurmcluster  # noqa: E402
import yaml  # noqa: E402

#: Slurm states after which a job runs no more.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
#: Plugin rules that run once per run (their wildcard is the run's name).
PER_RUN_RULES = ("consolidate", "evaluate")


def run_names(n: int) -> list[str]:
    width = max(2, len(str(n - 1)))
    return [f"b{i:0{width}d}" for i in range(n)]


def batch_config(corpus: Path, runs: list[str], steps: int) -> dict[str, Any]:
    """One config, ``runs`` tiny single-process runs over one shared tokenization. Each run
    differs in its seed, so the runs are distinct experiments (and distinct rendered configs)."""
    cfg = h.config_dict(corpus, nodes=1, gpus_per_node=1, max_steps=steps,
                        checkpoint_every=steps)
    cfg["train"]["warmup_steps"] = min(cfg["train"]["warmup_steps"], steps)
    cfg["runs"] = {name: {"train": {"seed": 1000 + i}} for i, name in enumerate(runs)}
    return cfg


def snakemake_argv(work: Path, cluster: slurmcluster.ClusterInfo, until: str | None,
                   train_runtime_min: int = 30) -> list[str]:
    """``snakemake --profile profiles/slurm`` as a user on the login node would run it, with the
    cluster's partition and job env (on the command line, --set-resources replaces the
    profile's train block as a whole: launcher=slurm is repeated)."""
    job_env = ",".join(f"{k}={v}" for k, v in cluster.job_env().items())
    res = [f"slurm_partition={cluster.partition}", "runtime=10", "mem_mb=1000", "cpus_per_task=1"]
    train = ["train:launcher=slurm", f"train:slurm_partition={cluster.partition}",
             "train:cpus_per_task=1", f"train:runtime={train_runtime_min}", "train:poll_s=2"]
    if job_env:
        train.append(f"train:job_env={job_env}")
    if cluster.account:
        res.append(f"slurm_account={cluster.account}")
        train.append(f"train:slurm_account={cluster.account}")
    argv = [h.PY, "-m", "snakemake", "-s", str(h.REPO / "Snakefile"),
            "--configfile", str(work / "config" / "config.yaml"),
            "--profile", str(h.REPO / "profiles" / "slurm"), "--latency-wait", "5",
            "--set-resources", *train, "--default-resources", *res]
    if until:
        argv += ["--until", until]
    return argv


# --------------------------------------------------------------------------------------------
# Slurm's record of the jobs


@dataclass
class SlurmJob:
    job_id: str
    name: str
    comment: str
    workdir: str
    state: str
    states: list[str] = field(default_factory=list)  # every state seen, in order, no repeats
    seen_at: dict[str, float] = field(default_factory=dict)  # state -> first time seen in it
    restarts: int | None = None
    queue_s: float | None = None  # submit → start (scontrol)
    run_s: float | None = None  # start → end (scontrol)
    detailed: str = ""  # the state in which scontrol_details last read it
    source: set[str] = field(default_factory=set)  # squeue / scontrol / sacct

    @property
    def restarted(self) -> int:
        """Times Slurm ran the job again under the same id (scontrol's Restarts, or, once the
        job left scontrol, the RUNNING spells the watcher saw)."""
        return max(self.restarts or 0, self.states.count("RUNNING") - 1)

    def see(self, state: str) -> None:
        self.state = state
        self.seen_at.setdefault(state, time.time())
        if not self.states or self.states[-1] != state:
            self.states.append(state)


class SlurmWatch:
    """Polls ``squeue -t all`` and keeps every job submitted from ``workdir``. Finished jobs
    stay visible for MinJobAge (600 s on the test cluster, >= 300 s by Slurm's default), far
    longer than a poll interval, so no job is missed even when accounting is off."""

    FMT = "%i\x1f%T\x1f%Z\x1f%k\x1f%j\x1e"

    def __init__(self, workdir: Path, interval: float = 2.0) -> None:
        self.workdir = workdir.resolve()
        self.interval = interval
        self.jobs: dict[str, SlurmJob] = {}
        self.polls = 0
        self.failed_polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="squeue-watch", daemon=True)

    def __enter__(self) -> SlurmWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.poll()  # the final states

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        try:
            proc = subprocess.run(["squeue", "-h", "-t", "all", "-o", self.FMT],
                                  capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.failed_polls += 1
            return
        if proc.returncode != 0:
            self.failed_polls += 1
            return
        self.polls += 1
        ended: list[str] = []
        for record in proc.stdout.split("\x1e"):
            parts = record.lstrip("\n").split("\x1f", 4)
            if len(parts) != 5 or not parts[0]:
                continue
            jid, state, workdir, comment, name = parts
            if Path(workdir or "/nonexistent").resolve() != self.workdir:
                continue
            job = self.jobs.get(jid)
            if job is None:
                job = self.jobs[jid] = SlurmJob(jid, name, comment, workdir, state)
            job.see(state)
            job.source.add("squeue")
            if state in ENDED and job.detailed != state:
                ended.append(jid)
        # Restarts and times while scontrol still has the job (it ages out with squeue).
        if ended:
            scontrol_details(self.jobs, ended)


def _slurm_time(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def scontrol_details(jobs: dict[str, SlurmJob], ids: list[str] | None = None) -> None:
    """Each job's Restarts count (a requeue keeps the id: only this field shows it) and its
    submit/start/end times, from ``scontrol show job`` (jobs within MinJobAge): ``ids``, or
    every job."""
    out = []
    for one in ids or [None]:  # scontrol takes one id, or none for all
        try:
            proc = subprocess.run(["scontrol", "show", "job", "-o", *([one] if one else [])],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            continue
        out += proc.stdout.splitlines()
    for line in out:
        fields: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        job = jobs.get(fields.get("JobId", ""))
        if job is None:
            continue
        job.source.add("scontrol")
        job.detailed = fields.get("JobState", "")
        if fields.get("Restarts", "").isdigit():
            job.restarts = int(fields["Restarts"])
        submit, start, end = (_slurm_time(fields.get(k, "")) for k in
                              ("SubmitTime", "StartTime", "EndTime"))
        if submit and start and end and end >= start >= submit:
            job.queue_s, job.run_s = start - submit, end - start


def sacct_rows(workdir: Path, since: float) -> tuple[list[dict[str, str]] | None, str]:
    """Accounting's record of the jobs from ``workdir`` (one row per job and, with -D, per
    requeued attempt), or None with the reason when the cluster keeps no accounting (the local
    test cluster has no slurmdbd: squeue/scontrol are then the record)."""
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 60))
    try:
        proc = subprocess.run(
            ["sacct", "-X", "-D", "-n", "-P", "-S", start, "-o",
             "JobIDRaw,State,WorkDir,Comment,JobName"],
            capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"sacct: {err}"
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or ["sacct failed"])[-1]
    rows = []
    for line in proc.stdout.splitlines():
        parts = line.split("|", 4)
        if len(parts) == 5 and Path(parts[2] or "/nonexistent").resolve() == workdir.resolve():
            rows.append(dict(zip(("job_id", "state", "workdir", "comment", "name"), parts,
                                 strict=True)))
    return rows, "ok"


def classify(job: SlurmJob) -> tuple[str, str]:
    """(kind, key): the plugin's jobs by their rule and wildcard (its comment is
    ``rule_<rule>[_wildcards_<value>]``), training jobs by their name ``zs-<run>``."""
    if job.comment.startswith("rule_"):
        rule, _, wildcard = job.comment[len("rule_"):].partition("_wildcards_")
        return rule, wildcard
    if job.name.startswith("zs-"):
        return "train", job.name[len("zs-"):]
    return "other", job.name


# --------------------------------------------------------------------------------------------
# the audit


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def audit_run(run_dir: Path, steps: int, jobs: dict[str, list[SlurmJob]],
              full: bool) -> tuple[bool, list[str], list[str]]:
    """(completed, problems, incidents) for one run, from its artifacts and Slurm's record.

    A problem breaks "exactly once": no result, a second submission or Slurm job, a second
    execution of the train rule (a reattach: Snakemake runs once here), a job that did not
    complete. An incident is a retry inside the one job (a rank failure requeued the same job id
    and training resumed): the run still completed once, but a clean batch has none."""
    problems: list[str] = []
    incidents: list[str] = []
    done = _read_json(run_dir / "train.done")
    if not isinstance(done, dict):
        problems.append("no train.done")
    elif done.get("step") != steps:
        problems.append(f"train.done at step {done.get('step')}, not {steps}")
    rec = _read_json(run_dir / "job.json") or {}
    job_id = str(rec.get("job_id", ""))
    if rec.get("launcher") != "slurm" or not job_id:
        problems.append(f"job.json names no Slurm job: {rec or 'absent'}")
    if rec.get("history"):
        problems.append(f"job.json: earlier submissions {rec['history']}")
    ev = h.events(run_dir)
    submits = [str(e.get("job_id")) for e in ev if e["event"] == "launch.submit"]
    if submits != [job_id]:
        problems.append(f"launch.submit events for jobs {submits}, job.json {job_id}")
    reattach = [e for e in ev if e["event"] == "launch.reattach"]
    if reattach:
        problems.append(f"the train rule ran {1 + len(reattach)} times (reattached)")
    retry = Counter(e["event"] for e in ev if e["event"] in (
        "launch.requeue", "launch.failure", "launch.hang"))
    if retry:
        incidents.append(f"events {dict(retry)}")
    giveups = [e for e in ev if e["event"] == "launch.giveup"]
    if giveups:
        problems.append(f"launch.giveup {giveups}")
    starts = [e for e in ev if e["event"] == "start"]
    if len(starts) != 1:
        (problems if not starts else incidents).append(f"{len(starts)} trainer starts")
    seen = Counter(r["step"] for r in h.metrics(run_dir))
    if sorted(seen) != list(range(1, steps + 1)):
        problems.append(f"metrics hold steps {sorted(seen)}, not 1..{steps}")
    elif any(n != 1 for n in seen.values()):
        incidents.append(f"steps computed again after a resume: {dict(seen)}")
    train = jobs.get("train", [])
    if [j.job_id for j in train] != ([job_id] if job_id else []):
        problems.append(f"Slurm training jobs {[j.job_id for j in train]}, job.json {job_id}")
    for kind in ("train", *(PER_RUN_RULES if full else ())):
        got = jobs.get(kind, [])
        if kind != "train" and len(got) != 1:
            problems.append(f"{len(got)} {kind} jobs {[j.job_id for j in got]}")
        for j in got:
            if j.state != "COMPLETED":
                problems.append(f"{kind} job {j.job_id} ended {j.state}")
            if j.restarted:
                incidents.append(f"{kind} job {j.job_id} restarted {j.restarted}x by Slurm")
    if full:
        for rel in ("hf/config.json", "eval/metrics.json"):
            if not (run_dir / rel).is_file():
                problems.append(f"no {rel}")
    completed = isinstance(done, dict) and done.get("step") == steps and (
        not full or (run_dir / "eval" / "metrics.json").is_file())
    return completed, problems, incidents


def audit(work: Path, runs: list[str], steps: int, shards: int, slurm_jobs: list[SlurmJob],
          full: bool) -> dict[str, Any]:
    """Every run completed exactly once? Counts and the problems found, per run."""
    by_kind: dict[str, dict[str, list[SlurmJob]]] = {}
    for job in sorted(slurm_jobs, key=lambda j: int(j.job_id.split("_")[0])):
        kind, key = classify(job)
        by_kind.setdefault(kind, {}).setdefault(key, []).append(job)
    problems: dict[str, list[str]] = {}
    incidents: dict[str, list[str]] = {}
    completed = []
    for run in runs:
        per_run = {kind: keys.get(run, []) for kind, keys in by_kind.items()}
        ok, probs, incs = audit_run(work / "results" / "runs" / run, steps, per_run, full)
        if ok:
            completed.append(run)
        if probs:
            problems[run] = probs
        if incs:
            incidents[run] = incs
    # The shared data stage: one job per shard, all runs read its one manifest.
    shard_jobs = by_kind.get("tokenize_shard", {})
    data_probs = []
    # One source here: the wildcard is the shard number (with named sources, source_shard).
    if len(shard_jobs) != shards or not all(k.endswith(f"{i:05d}") for i, k in
                                            enumerate(sorted(shard_jobs))):
        data_probs.append(f"tokenize_shard jobs for {sorted(shard_jobs)}, expected one for "
                          f"each of {shards} shards")
    for key, js in shard_jobs.items():
        if len(js) != 1 or js[0].state != "COMPLETED":
            data_probs.append(f"tokenize_shard {key}: {[(j.job_id, j.state) for j in js]}")
    if not (work / "results" / "data" / "manifest.json").is_file():
        data_probs.append("no results/data/manifest.json")
    if data_probs:
        problems["(data)"] = data_probs
    unknown = {k: v for k, v in by_kind.items()
               if k not in ("train", "tokenize_shard", *PER_RUN_RULES)}
    stray = {kind: sorted(key for key in keys if key not in runs)
             for kind, keys in by_kind.items() if kind in ("train", *PER_RUN_RULES)}
    stray = {k: v for k, v in stray.items() if v}
    if unknown or stray:
        problems["(other jobs)"] = [f"unexpected jobs: {unknown or ''} {stray or ''}".strip()]
    # A duplicate: a second Slurm job for the same (kind, key), or a second submission that a
    # run's launcher recorded (whichever record shows more: they describe the same jobs).
    # Slurm restarting the same job id is a retry inside the one job: an incident, not this.
    extra = {(kind, key): len(js) - 1 for kind, keys in by_kind.items() for key, js in keys.items()}
    for run in runs:
        ev = h.events(work / "results" / "runs" / run)
        submits = len([e for e in ev if e["event"] == "launch.submit"])
        extra["train", run] = max(extra.get(("train", run), 0), submits - 1)
    duplicates = sum(n for n in extra.values() if n > 0)
    lost = [run for run in runs if run not in completed]
    return {
        "runs": len(runs),
        "completed": len(completed),
        "lost": lost,
        "duplicates": duplicates,
        "slurm_jobs": len(slurm_jobs),
        "slurm_jobs_by_kind": {k: sum(len(js) for js in keys.values())
                               for k, keys in sorted(by_kind.items())},
        "states": dict(Counter(j.state for j in slurm_jobs)),
        "restarts": sum(j.restarted for j in slurm_jobs),
        "problems": problems,
        "incidents": incidents,
    }


# --------------------------------------------------------------------------------------------
# the bench


def run_batch(work: Path, cluster: slurmcluster.ClusterInfo, *, runs: int, steps: int = 3,
              until: str | None = None, timeout: float = 3600.0) -> dict[str, Any]:
    """Write the batch config under ``work``, run Snakemake through the slurm profile, audit."""
    work = work.resolve()
    (work / "config").mkdir(parents=True, exist_ok=True)
    names = run_names(runs)
    corpus = h.write_corpus(work / "corpus.txt")
    cfg = batch_config(corpus, names, steps)
    (work / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = snakemake_argv(work, cluster, until)
    log_path = work / "snakemake.log"
    t0 = time.time()
    with SlurmWatch(work) as watch, log_path.open("w") as log:
        # Its own session: the notes saw a stray SIGTERM reach Snakemake otherwise.
        proc = subprocess.Popen(argv, cwd=work, env=h.env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            rc = proc.wait(timeout=120)
            rc = rc if rc else -15
        wall = time.time() - t0
    jobs = watch.jobs
    scontrol_details(jobs)
    rows, sacct_note = sacct_rows(work, t0)
    if rows is not None:
        # Accounting also keeps the jobs that left squeue; a job only it knows is still a job.
        # With -D it lists every attempt of a requeued job: one row more per restart.
        attempts = Counter(row["job_id"] for row in rows)
        for row in rows:
            job = jobs.get(row["job_id"])
            if job is None:
                job = jobs[row["job_id"]] = SlurmJob(row["job_id"], row["name"], row["comment"],
                                                     row["workdir"], "")
            if "squeue" not in job.source:
                job.see(row["state"].split()[0])  # rows come in attempt order
            job.source.add("sacct")
            job.restarts = max(job.restarts or 0, attempts[row["job_id"]] - 1)
        sacct_note = f"{len(rows)} rows"
    res = audit(work, names, steps, cfg["data"]["shards"], list(jobs.values()),
                full=until is None)
    res.update(wall_s=round(wall, 1), snakemake_rc=rc, steps=steps, until=until or "all",
               work=str(work), sacct=sacct_note, squeue_polls=watch.polls,
               failed_polls=watch.failed_polls,
               jobs=[{"id": j.job_id, "kind": classify(j)[0], "key": classify(j)[1],
                      "state": j.state, "states": j.states, "restarts": j.restarted,
                      "queue_s": j.queue_s, "run_s": j.run_s}
                     for j in sorted(jobs.values(), key=lambda j: int(j.job_id.split("_")[0]))])
    timing: dict[str, dict[str, float]] = {}
    for kind in res["slurm_jobs_by_kind"]:
        js = [j for j in jobs.values() if classify(j)[0] == kind and j.run_s is not None]
        if js:
            timing[kind] = {"run_s": round(sum(j.run_s for j in js) / len(js), 1),
                            "queue_s": round(sum(j.queue_s for j in js) / len(js), 1)}
    res["mean_seconds_by_kind"] = timing
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        res["problems"]["(snakemake)"] = [f"exit status {rc}; {log_path}:", *tail]
    return res


def summary(res: dict[str, Any]) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in res["slurm_jobs_by_kind"].items())
    lines = [
        f"batch: {res['runs']} runs x {res['steps']} steps (1 node x 1 process each), "
        f"target {res['until']}, snakemake exit {res['snakemake_rc']}",
        f"wall time        {res['wall_s']:.1f} s",
        f"Slurm jobs       {res['slurm_jobs']} ({kinds}); final states {res['states']}",
        "job seconds      " + ", ".join(
            f"{k} {t['run_s']:.0f} run + {t['queue_s']:.0f} queued"
            for k, t in res.get("mean_seconds_by_kind", {}).items()) + " (means)",
        f"runs completed   {res['completed']}/{res['runs']}",
        f"duplicates       {res['duplicates']}",
        f"retries          {res['restarts']} Slurm restart(s) of a job; runs with incidents: "
        f"{len(res['incidents'])}",
        f"lost             {len(res['lost'])}{' ' + ', '.join(res['lost']) if res['lost'] else ''}",
        f"record           squeue polled {res['squeue_polls']}x "
        f"({res['failed_polls']} failed); sacct: {res['sacct']}",
    ]
    for who, probs in res["problems"].items():
        lines.append(f"  problem {who}: " + "; ".join(probs[:6]))
    for who, incs in res["incidents"].items():
        lines.append(f"  incident {who}: " + "; ".join(incs[:6]))
    return "\n".join(lines)


def ok(res: dict[str, Any]) -> bool:
    return (res["snakemake_rc"] == 0 and res["completed"] == res["runs"] and not res["lost"]
            and res["duplicates"] == 0 and not res["problems"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=50, help="runs in the one config (default 50)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    p.add_argument("--until", choices=("train",), default=None,
                   help="stop after training (default: the whole DAG, consolidate + evaluate)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for Snakemake")
    p.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = p.parse_args(argv)
    if args.runs < 1 or args.steps < 1:
        p.error("--runs and --steps must be >= 1")
    cluster = None
    info = slurmcluster.site_cluster_from_env()
    if info is not None:
        shared = os.environ.get("ZEROSNAKE_SLURM_SHARED_DIR")
        if not shared and not args.keep:
            p.error("site cluster: set ZEROSNAKE_SLURM_SHARED_DIR (or --keep a shared folder)")
        work = args.keep or Path(tempfile.mkdtemp(prefix="zs-bench-batch-", dir=shared))
    elif os.environ.get("SLURM_CONF"):
        # A test cluster already running (slurmcluster.py start): its cluster.json says how.
        info = slurmcluster.ClusterInfo.from_json(
            (Path(os.environ["SLURM_CONF"]).parents[1] / "cluster.json").read_text())
        work = args.keep or Path(tempfile.mkdtemp(prefix="zs-bench-batch-"))
    else:
        work = args.keep or Path(tempfile.mkdtemp(prefix="zs-bench-batch-"))
        reason = slurmcluster.missing_requirements()
        if reason:
            print(f"no test cluster: {reason}", file=sys.stderr)
            return 2
        cluster = slurmcluster.TestCluster(work / "cluster")
        info = cluster.start()
        os.environ.update(info.client_env())
    work.mkdir(parents=True, exist_ok=True)
    try:
        res = run_batch(work / "wf", info, runs=args.runs, steps=args.steps, until=args.until,
                        timeout=args.timeout)
    finally:
        if cluster is not None:
            cluster.stop()
    print(summary(res))
    print(json.dumps({k: v for k, v in res.items() if k != "jobs"}))
    (work / "batch.json").write_text(json.dumps(res, indent=2))
    return 0 if ok(res) else 1


if __name__ == "__main__":
    sys.exit(main())
