"""The training pipeline on a real Slurm cluster (issue 6).

1. a 2-node training job (1 process per node, gloo) finishes, both nodes took part;
2. a short time limit: warning → checkpoint → requeue (same job) → resume → finish, with the
   final weights equal to an uninterrupted run's;
3. a rank killed: the job requeues itself from the last checkpoint and finishes;
4. ``snakemake --profile profiles/slurm`` end to end, then a single-stage rerun;
5. the login-node ``snakemake`` killed during training and restarted: one training job;
6. hostile strings reach sbatch as data.

Every test asserts on artifacts: run-dir files (job.json, events.jsonl, metrics.jsonl,
nodes/*.json, checkpoints, weights) and Slurm's own record (squeue).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
from pathlib import Path

import pipeline_helpers as h
import pytest
import slurmcluster
import torch
import yaml

from pipeline.train.submit import measured_save_seconds, save_time_warning


@pytest.fixture(scope="module")
def shared(slurm_cluster: slurmcluster.ClusterInfo,
           tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder the host and every node see (module scope: the data is made once)."""
    if slurm_cluster.managed:
        return tmp_path_factory.mktemp("pipeline")
    base = os.environ.get("ZEROSNAKE_SLURM_SHARED_DIR")
    if not base:
        pytest.skip("site cluster: set ZEROSNAKE_SLURM_SHARED_DIR to a folder every node sees")
    path = Path(base) / f"zerosnake-pipeline-{os.getpid()}"
    path.mkdir(parents=True)
    return path


@pytest.fixture(scope="module")
def corpus(shared: Path) -> Path:
    return h.write_corpus(shared / "corpus.txt")


@pytest.fixture(scope="module")
def data_dir(shared: Path, corpus: Path) -> Path:
    return h.prepare_data(shared, corpus)


def _job_env_args(cluster: slurmcluster.ClusterInfo) -> list[str]:
    # The interface the ranks talk over (eth0 inside the test nodes), as the profile gives it.
    return [f"--job-env={k}={v}" for k, v in cluster.job_env().items()]


def _two_nodes(cluster: slurmcluster.ClusterInfo) -> None:
    if len(cluster.nodes) < 2:
        pytest.skip("the partition has fewer than two nodes")


def _assert_steps_contiguous(run_dir: Path, max_steps: int) -> list[dict]:
    """Within each attempt the steps follow each other; each attempt starts right after the
    checkpoint it resumed from; the last record of every step covers 1..max_steps."""
    recs = h.metrics(run_dir)
    starts = [e for e in h.events(run_dir) if e["event"] == "start"]
    by_attempt: dict[int, list[int]] = {}
    for r in recs:
        by_attempt.setdefault(r["attempt"], []).append(r["step"])
    for attempt, steps in by_attempt.items():
        assert steps == list(range(steps[0], steps[0] + len(steps))), (attempt, steps[:5])
        resumed = starts[attempt - 1]["resumed_from"]
        assert steps[0] == resumed + 1, (attempt, steps[0], resumed)
    last = {r["step"]: r for r in recs}
    assert sorted(last) == list(range(1, max_steps + 1))
    return recs


# --------------------------------------------------------------------------------------------
# 1. two nodes, one process each


def test_two_node_training(slurm_cluster: slurmcluster.ClusterInfo, shared: Path, corpus: Path,
                           data_dir: Path) -> None:
    _two_nodes(slurm_cluster)
    run_dir = h.render(shared / "t1", h.config_dict(corpus, nodes=2, gpus_per_node=1,
                                                   max_steps=30, checkpoint_every=10))
    proc = h.run(h.launch_argv(run_dir, data_dir, partition=slurm_cluster.partition,
                               job_name="zs-t1", extra=_job_env_args(slurm_cluster)),
                 timeout=240)
    assert json.loads(proc.stdout.splitlines()[-1])["step"] == 30
    job = json.loads((run_dir / "job.json").read_text())
    assert h.squeue(job["job_id"], "%T").strip() == "COMPLETED"
    assert "--job-name=zs-t1" in job["sbatch_argv"]
    # Both nodes ran their torchrun to success in the same attempt of the same job.
    nodes = h.node_records(run_dir)
    assert len(nodes) == 2, nodes
    assert {n["node_rank"] for n in nodes} == {0, 1}
    assert all(n["rc"] == 0 and n["job_id"] == job["job_id"] and n["restart"] == 0
               for n in nodes)
    hosts = {n["host"] for n in nodes}
    assert len(hosts) == 2, hosts
    if slurm_cluster.managed:
        assert hosts == set(slurm_cluster.nodes[:2])
    # The checkpoint was written by a world of 2 ranks (one per node).
    manifest = json.loads((run_dir / "checkpoints" / "step-000030" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {f"rng/rank-{r:05d}.pt" for r in (0, 1)} <= set(manifest["files"])
    assert [r["step"] for r in h.metrics(run_dir)] == list(range(1, 31))
    # Save durations are measured from the checkpoints: the submission-time warning works.
    assert (measured_save_seconds(run_dir) or 0) > 0
    assert "shorter than the measured checkpoint time" in (save_time_warning(run_dir, 0) or "")
    assert save_time_warning(run_dir, 3600) is None


def test_two_nodes_tensor_parallel_inside_data_parallel_across(
        slurm_cluster: slurmcluster.ClusterInfo, shared: Path, corpus: Path,
        data_dir: Path) -> None:
    """2 nodes × 2 processes: TP = 2 inside each node (DTensor over the node's two ranks), DP = 2
    across the nodes (FSDP2), the layout the planner gives 3-D runs (TP never spans nodes)."""
    _two_nodes(slurm_cluster)
    cfg = h.config_dict(corpus, nodes=2, gpus_per_node=2, max_steps=6, checkpoint_every=3)
    cfg["train"]["tp"] = 2
    run_dir = h.render(shared / "t1tp", cfg)
    proc = h.run(h.launch_argv(run_dir, data_dir, partition=slurm_cluster.partition,
                               job_name="zs-t1tp", extra=_job_env_args(slurm_cluster)),
                 timeout=300)
    assert json.loads(proc.stdout.splitlines()[-1])["step"] == 6
    nodes = h.node_records(run_dir)
    assert len({n["host"] for n in nodes}) == 2 and all(n["rc"] == 0 for n in nodes)
    start = next(e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
                 if e["event"] == "start")
    assert (start["tp"], start["dp"], len(start["param_shards"])) == (2, 2, 4)
    manifest = json.loads((run_dir / "checkpoints" / "step-000006" / "manifest.json").read_text())
    assert manifest["world_size"] == 4
    assert [r["step"] for r in h.metrics(run_dir)] == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) for r in h.metrics(run_dir))


# --------------------------------------------------------------------------------------------
# 2. time limit → warning → checkpoint → requeue → resume → finish

TIME_LIMIT_STEPS = 900


def _timed_config(corpus: Path) -> dict:
    # 50-100 ms a step: 45-90 s of training, longer than the first attempt can run before the
    # warning. slurmctld checks limits every 30 s and signals once the time left is within
    # signal_delay_s + 30 s: with a 1 min limit and a 1 s delay, 29-59 s after the start; the
    # kill comes at a later check, >= 30 s after the warning: ample for a sub-second save.
    cfg = h.config_dict(corpus, nodes=2, gpus_per_node=1, max_steps=TIME_LIMIT_STEPS,
                        checkpoint_every=250)
    cfg["model"].update(hidden_size=128, intermediate_size=256, num_layers=2)
    cfg["train"]["micro_batch_size"] = 8
    return cfg


def test_time_limit_checkpoint_requeue_resume(slurm_cluster: slurmcluster.ClusterInfo,
                                              shared: Path, corpus: Path,
                                              data_dir: Path) -> None:
    _two_nodes(slurm_cluster)
    cfg = _timed_config(corpus)
    limited = h.render(shared / "t2", cfg)
    reference = h.render(shared / "t2-ref", cfg)
    common = dict(partition=slurm_cluster.partition)
    env_args = _job_env_args(slurm_cluster)
    # The uninterrupted reference runs at the same time (1 CPU per node each: both fit).
    procs = {
        "limited": subprocess.Popen(
            h.launch_argv(limited, data_dir, time_min=1, signal_delay_s=1, job_name="zs-t2",
                          extra=[*env_args, "--max-requeues", "8"], **common),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=h.env()),
        "reference": subprocess.Popen(
            h.launch_argv(reference, data_dir, time_min=20, job_name="zs-t2-ref",
                          extra=env_args, **common),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=h.env()),
    }
    outs = {}
    for name, p in procs.items():
        try:
            out, err = p.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            pytest.fail(f"{name} launch still waiting after 420 s")
        assert p.returncode == 0, f"{name}: {err[-6000:]}"
        outs[name] = out
    job_id = json.loads((limited / "job.json").read_text())["job_id"]
    ev = h.events(limited)
    signals = [e for e in ev if e["event"] == "launch.signal"]
    requeues = [e for e in ev if e["event"] == "launch.requeue"]
    assert signals and all(e["cause"] == "timeout" for e in signals), signals
    assert requeues and all(e["reason"] == "timeout" and e["job_id"] == job_id
                            for e in requeues), requeues
    # Same job id on every attempt, restarted by Slurm (SLURM_RESTART_COUNT >= 1).
    nodes = h.node_records(limited)
    assert {n["job_id"] for n in nodes} == {job_id}
    assert max(n["restart"] for n in nodes) >= 1
    assert h.squeue(job_id, "%T").strip() == "COMPLETED"
    starts = [e for e in ev if e["event"] == "start"]
    assert len(starts) >= 2 and starts[1]["resumed_from"] > 0, starts
    # Every warning ended in a complete save at an agreed step before the requeue.
    # (A warning that lands on the last step ends the job instead: at most one such save.)
    dump = "\n".join(json.dumps(e) for e in ev)
    saved = [e for e in ev if e["event"] == "launch.saved"]
    stopped = [e for e in saved if e["stopped_at"]]
    finished = [e for e in ev if e["event"] == "launch.finished_at_signal"]
    assert len(stopped) == len(requeues) and len(finished) <= 1, dump
    assert len(saved) == len(stopped) + len(finished), dump
    assert [e["checkpoint"] for e in stopped] == [f"step-{e['stopped_at']:06d}" for e in stopped]
    _assert_steps_contiguous(limited, TIME_LIMIT_STEPS)
    assert json.loads((reference / "train.done").read_text())["step"] == TIME_LIMIT_STEPS
    assert not [e for e in h.events(reference) if e["event"] == "launch.requeue"]
    a = h.final_weights(limited, data_dir)
    b = h.final_weights(reference, data_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The save the warning triggered was measured: a lead time below it warns at submission.
    assert save_time_warning(limited, 0) is not None


# --------------------------------------------------------------------------------------------
# 3. a rank dies → requeue from the last complete checkpoint → finish


def test_rank_killed_requeues_from_checkpoint(slurm_cluster: slurmcluster.ClusterInfo,
                                              shared: Path, corpus: Path,
                                              data_dir: Path) -> None:
    _two_nodes(slurm_cluster)
    if not slurm_cluster.managed:
        pytest.skip("kills a rank by PID: needs the local test cluster's shared PID namespace")
    cfg = _timed_config(corpus)
    cfg["train"].update(max_steps=300, checkpoint_every=50)
    run_dir = h.render(shared / "t3", cfg)
    proc = subprocess.Popen(
        h.launch_argv(run_dir, data_dir, partition=slurm_cluster.partition, job_name="zs-t3",
                      extra=_job_env_args(slurm_cluster)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=h.env())
    try:
        # Past the first checkpoint (step 50), kill rank 1 (on the second node) outright.
        h.wait_for(lambda: len(h.metrics(run_dir)) >= 70, 180, "step 70")
        pids = h.worker_pids(run_dir, rank=1)
        assert pids, "rank 1's process not found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        _out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-6000:]
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    ev = h.events(run_dir)
    failures = [e for e in ev if e["event"] == "launch.failure"]
    requeues = [e for e in ev if e["event"] == "launch.requeue"]
    assert len(failures) == 1 and failures[0]["trained"] and failures[0]["rdzv_failed"] == []
    assert [e["reason"] for e in requeues] == ["failure"]
    assert requeues[0]["exclude"] == []  # training had started: no node is blamed
    starts = [e for e in ev if e["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed_from"] >= 50, starts
    assert starts[1]["resumed_from"] % 50 == 0  # from a complete checkpoint
    assert json.loads((run_dir / "train.done").read_text())["step"] == 300
    assert {n["job_id"] for n in h.node_records(run_dir)} == {job_id}
    assert max(n["restart"] for n in h.node_records(run_dir)) == 1
    last = {r["step"] for r in h.metrics(run_dir)}
    assert last == set(range(1, 301))


# --------------------------------------------------------------------------------------------
# 4./5. Snakemake


def _workflow_dir(shared: Path, name: str, corpus: Path, cfg: dict) -> Path:
    work = shared / name
    (work / "config").mkdir(parents=True)
    (work / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    return work


def _snakemake_argv(work: Path, profile: str, cluster: slurmcluster.ClusterInfo,
                    *extra: str) -> list[str]:
    job_env = ",".join(f"{k}={v}" for k, v in cluster.job_env().items())
    return [
        h.PY, "-m", "snakemake", "-s", str(h.REPO / "Snakefile"), "--configfile",
        str(work / "config" / "config.yaml"), "--profile", str(h.REPO / "profiles" / profile),
        "--latency-wait", "5",
        # On the command line, --set-resources replaces the profile's train block as a whole.
        "--set-resources", "train:launcher=slurm", f"train:slurm_partition={cluster.partition}",
        "train:cpus_per_task=1", "train:runtime=15", "train:poll_s=1",
        f"train:job_env={job_env}",
        *extra,
    ]


def test_snakemake_slurm_profile_end_to_end(slurm_cluster: slurmcluster.ClusterInfo,
                                            shared: Path, corpus: Path) -> None:
    _two_nodes(slurm_cluster)
    cfg = h.config_dict(corpus, nodes=2, gpus_per_node=1, max_steps=20, checkpoint_every=10)
    work = _workflow_dir(shared, "t4", corpus, cfg)
    res = ["--default-resources", f"slurm_partition={slurm_cluster.partition}", "runtime=10",
           "mem_mb=1000", "cpus_per_task=1"]
    if slurm_cluster.account:
        res.append(f"slurm_account={slurm_cluster.account}")
    argv = _snakemake_argv(work, "slurm", slurm_cluster, *res)
    proc = h.run(argv, timeout=420, cwd=work, check=False)
    assert proc.returncode == 0, proc.stderr[-8000:]
    run_dir = work / "results" / "runs" / "r"
    for rel in ("train.done", "hf/config.json", "eval/metrics.json", "eval/report.md"):
        assert (run_dir / rel).is_file(), rel
    assert (work / "results" / "data" / "manifest.json").is_file()
    # Shards, consolidate and evaluate ran as Slurm jobs of the executor plugin: their logs
    # name the job, and Slurm still lists those jobs (MinJobAge).
    plugin_jobs = _plugin_jobs(work)
    assert {"tokenize_shard", "consolidate", "evaluate"} <= set(plugin_jobs), plugin_jobs
    assert len(plugin_jobs["tokenize_shard"]) == 2
    for ids in plugin_jobs.values():
        for jid in ids:
            assert h.squeue(jid, "%T").strip() == "COMPLETED", jid
    # Training went through submitit on two nodes.
    job = json.loads((run_dir / "job.json").read_text())
    assert h.squeue(job["job_id"], "%T").strip() == "COMPLETED"
    assert len({n["host"] for n in h.node_records(run_dir)}) == 2
    # The status table reads the same artifacts and Slurm's state.
    table = h.run([h.PY, "-m", "pipeline.status", "--results", str(work / "results")],
                  timeout=60).stdout.splitlines()
    assert table[0].split()[:4] == ["run", "stage", "job", "slurm"]
    assert table[1].split()[:5] == ["r", "evaluated", job["job_id"], "COMPLETED", "20/20"]
    assert table[1].split()[6] == "step-000020"
    # A single-stage rerun: evaluate again, nothing upstream.
    done_mtime = (run_dir / "train.done").stat().st_mtime
    eval_mtime = (run_dir / "eval" / "metrics.json").stat().st_mtime
    proc = h.run([*argv, "--forcerun", "evaluate"], timeout=300, cwd=work, check=False)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert (run_dir / "eval" / "metrics.json").stat().st_mtime > eval_mtime
    assert (run_dir / "train.done").stat().st_mtime == done_mtime
    again = _plugin_jobs(work)
    assert len(again["evaluate"]) == 2 and again["tokenize_shard"] == plugin_jobs["tokenize_shard"]
    assert again.get("consolidate") == plugin_jobs["consolidate"]
    assert json.loads((run_dir / "job.json").read_text())["job_id"] == job["job_id"]


def _plugin_jobs(work: Path) -> dict[str, list[str]]:
    """Slurm job ids of the executor plugin's jobs by rule, from Slurm's own record: the plugin
    names every job of one Snakemake run by that run's uuid (in .snakemake/) and sets the
    comment to ``rule_<rule>[_wildcards_...]``. Only jobs of this workflow directory count."""
    out: dict[str, list[str]] = {}
    proc = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i\x1f%k\x1f%Z"],
                          capture_output=True, text=True, timeout=30)
    for line in proc.stdout.splitlines():
        jid, comment, cwd = [*line.split("\x1f"), "", ""][:3]
        if not comment.startswith("rule_") or Path(cwd) != work:
            continue
        rule = comment[len("rule_"):].split("_wildcards_")[0]
        out.setdefault(rule, []).append(jid)
    return {k: sorted(v, key=int) for k, v in out.items()}


def test_login_snakemake_killed_then_restarted_reattaches(
        slurm_cluster: slurmcluster.ClusterInfo, shared: Path, corpus: Path) -> None:
    _two_nodes(slurm_cluster)
    cfg = _timed_config(corpus)
    cfg["train"].update(max_steps=400, checkpoint_every=100)
    work = _workflow_dir(shared, "t5", corpus, cfg)
    run_dir = work / "results" / "runs" / "r"
    # The data stages run on this host (profile local); training goes to Slurm.
    argv = _snakemake_argv(work, "local", slurm_cluster, "--until", "train")
    first = subprocess.Popen(argv, cwd=work, env=h.env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        h.wait_for(lambda: len(h.metrics(run_dir)) >= 20, 300, "training to run")
        job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
        # The login node's session dies: Snakemake and its launcher, all at once.
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert h.squeue(job_id, "%T").strip() in ("RUNNING", "COMPLETING", "PENDING")
    h.run([*argv, "--unlock"], timeout=120, cwd=work)
    proc = h.run(argv, timeout=300, cwd=work, check=False)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert json.loads((run_dir / "train.done").read_text())["step"] == 400
    ev = h.events(run_dir)
    assert [e["job_id"] for e in ev if e["event"] == "launch.submit"] == [job_id]
    assert [e["job_id"] for e in ev if e["event"] == "launch.reattach"] == [job_id]
    assert h.jobs_named("zs-r", work) == [job_id]  # one training job, not two
    assert json.loads((run_dir / "job.json").read_text())["job_id"] == job_id


# --------------------------------------------------------------------------------------------
# 6. hostile strings

HOSTILE = "evil; touch PWNED1 \"dq\" 'sq' $(touch PWNED2) `touch PWNED3` && touch PWNED4 # %j"
HOSTILE_NL = "evil\\n \\ back\ntouch PWNED5 # $(touch PWNED6)"


def test_hostile_strings_reach_sbatch_as_data(slurm_cluster: slurmcluster.ClusterInfo,
                                              shared: Path, corpus: Path,
                                              data_dir: Path) -> None:
    work = shared / "t6"
    work.mkdir()
    run_dir = h.render(work / "run", h.config_dict(corpus, nodes=1, gpus_per_node=1,
                                                  max_steps=5, checkpoint_every=5))
    # A newline (or any control character) in a job option is refused before anything is
    # submitted, naming the option; nothing of the text runs.
    for flag_args in (["--job-name", HOSTILE_NL], ["--sbatch", f"comment={HOSTILE_NL}"]):
        refused = h.run([*h.launch_argv(run_dir, data_dir, partition=slurm_cluster.partition,
                                        extra=[*_job_env_args(slurm_cluster)]), *flag_args],
                        timeout=120, cwd=work, check=False)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "control character" in refused.stderr and flag_args[0] in refused.stderr
        assert not (run_dir / "job.json").exists()
    name = HOSTILE
    # The comment twice: as KEY=VALUE, then as a shell-quoted extra argument (split like a
    # shell would, never run by one); sbatch keeps the last.
    argv = h.launch_argv(run_dir, data_dir, partition=slurm_cluster.partition, job_name=name,
                         extra=[*_job_env_args(slurm_cluster), "--sbatch", f"comment=x {HOSTILE}",
                                "--sbatch-extra=" + shlex.join([f"--comment={HOSTILE}"])])
    h.run(argv, timeout=240, cwd=work)
    job = json.loads((run_dir / "job.json").read_text())
    assert h.squeue(job["job_id"], "%j") == name + "\n"
    assert h.squeue(job["job_id"], "%k") == HOSTILE + "\n"
    assert json.loads((run_dir / "train.done").read_text())["step"] == 5
    assert job["sbatch_argv"][1:4] == [f"--job-name={name}", "--requeue",
                                       f"--partition={slurm_cluster.partition}"]
    assert job["sbatch_argv"][-3:-1] == [f"--comment=x {HOSTILE}", f"--comment={HOSTILE}"]
    pwned = sorted(p.name for p in list(work.rglob("PWNED*")) + list(Path.cwd().glob("PWNED*")))
    assert not pwned, f"a hostile string ran as a command: {pwned}"
