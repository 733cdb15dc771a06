"""Batch load, reduced (issue 12): ``bench/batch.py``'s code path with 6 runs instead of 50.

One config of 6 tiny runs (1 node x 1 process, 3 steps each) sharing one tokenization goes
through ``snakemake --profile profiles/slurm`` up to training: 2 tokenize shard jobs through the
executor plugin, then 6 train rules that each submit one Slurm job through submitit and wait.
Every run must complete exactly once: train.done at the last step, one submission in job.json
and events.jsonl, one trainer start, each step once in metrics.jsonl, and exactly one Slurm job
per run (the one job.json names, COMPLETED, never restarted) and per shard, from Slurm's own
record (squeue polled throughout; sacct where the cluster has accounting), and no retry.
A second test feeds the audit runs that were lost, submitted twice or retried (no cluster).
"""

from __future__ import annotations

import json
from pathlib import Path

import slurmcluster

from bench import batch

RUNS = 6


def test_batch_every_run_completes_exactly_once(slurm_cluster: slurmcluster.ClusterInfo,
                                                slurm_workdir: Path) -> None:
    res = batch.run_batch(slurm_workdir / "wf", slurm_cluster, runs=RUNS, steps=3,
                          until="train", timeout=300)
    report = batch.summary(res)
    assert res["snakemake_rc"] == 0, report
    assert res["problems"] == {}, report
    assert res["incidents"] == {}, report  # no retries either: nothing failed in a clean batch
    assert (res["completed"], res["lost"], res["duplicates"]) == (RUNS, [], 0), report
    # Slurm's record: one job per shard and per run, nothing else from this workflow.
    assert res["slurm_jobs_by_kind"] == {"tokenize_shard": 2, "train": RUNS}, report
    assert res["states"] == {"COMPLETED": RUNS + 2}, report
    train = [j for j in res["jobs"] if j["kind"] == "train"]
    assert sorted(j["key"] for j in train) == batch.run_names(RUNS), report
    assert all(j["restarts"] == 0 for j in train), report
    assert batch.ok(res), report


def _fake_run(work: Path, run: str, *, job_ids: list[str], steps: int = 3, done: bool = True,
              starts: int = 1, retried: bool = False) -> None:
    """A run directory as the launcher and trainer leave it (job.json, events, metrics)."""
    d = work / "results" / "runs" / run
    d.mkdir(parents=True)
    (d / "job.json").write_text(json.dumps({"job_id": job_ids[-1], "launcher": "slurm"}))
    ev = [{"event": "launch.submit", "job_id": j} for j in job_ids]
    if retried:
        ev += [{"event": "launch.failure", "job_id": job_ids[-1]},
               {"event": "launch.requeue", "job_id": job_ids[-1]}]
    ev += [{"event": "start"}] * starts
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    last = steps if done else 1
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n"
                                             for s in range(1, last + 1)))
    if done:
        (d / "train.done").write_text(json.dumps({"step": steps}))


def test_audit_counts_duplicates_lost_runs_and_retries(tmp_path: Path) -> None:
    """The audit itself, without a cluster: it must not pass a batch that lost or doubled a run."""
    (tmp_path / "results" / "data").mkdir(parents=True)
    (tmp_path / "results" / "data" / "manifest.json").write_text("{}")
    shard = [batch.SlurmJob(str(i + 1), "uuid", f"rule_tokenize_shard_wildcards_{i:05d}", "",
                            "COMPLETED") for i in range(2)]

    def train(jid: str, run: str, state: str = "COMPLETED", restarts: int = 0) -> batch.SlurmJob:
        return batch.SlurmJob(jid, f"zs-{run}", "", "", state, restarts=restarts)

    _fake_run(tmp_path, "ok", job_ids=["3"])
    _fake_run(tmp_path, "twice", job_ids=["4", "5"])  # submitted again: two training jobs
    _fake_run(tmp_path, "lost", job_ids=["6"], done=False)
    _fake_run(tmp_path, "retried", job_ids=["7"], retried=True)
    jobs = [*shard, train("3", "ok"), train("4", "twice"), train("5", "twice"),
            train("6", "lost", "FAILED"), train("7", "retried", restarts=1)]
    res = batch.audit(tmp_path, ["ok", "twice", "lost", "retried"], 3, 2, jobs, full=False)
    assert res["duplicates"] == 1
    assert res["lost"] == ["lost"]
    assert res["completed"] == 3
    assert res["restarts"] == 1
    assert set(res["problems"]) == {"twice", "lost"}
    assert set(res["incidents"]) == {"retried"}
    assert res["slurm_jobs_by_kind"] == {"tokenize_shard": 2, "train": 5}
    # A shard tokenized twice is a duplicate too; a clean batch has no problems at all.
    clean = batch.audit(tmp_path, ["ok"], 3, 2, [*shard, train("3", "ok")], full=False)
    assert (clean["duplicates"], clean["problems"], clean["incidents"]) == (0, {}, {})
    again = batch.audit(tmp_path, ["ok"], 3, 2,
                        [*shard, batch.SlurmJob("9", "uuid", shard[0].comment, "", "COMPLETED"),
                         train("3", "ok")], full=False)
    assert again["duplicates"] == 1 and "(data)" in again["problems"]
