"""The hang watchdog and goodput on the test cluster (issue 12), in one 2-node job:

1. a preemption warning (USR2 through ``scancel --signal``, as Slurm sends it): the job saves
   and requeues itself;
2. in the next attempt rank 1 is frozen with SIGSTOP: the node task running it names the rank
   and its host (``launch.hang``), kills its torchrun, the head node requeues the job from the
   last checkpoint (a failure within the budget, long before the time limit);
3. the third attempt finishes, and the run's goodput parts add up to its wall time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pipeline_helpers as h
import pytest
import slurmcluster

from pipeline.observe.goodput import PARTS, goodput

HANG_TIMEOUT_S = 10
STEPS = 200


def test_frozen_rank_is_named_and_the_job_requeued(slurm_cluster: slurmcluster.ClusterInfo,
                                                    slurm_workdir: Path) -> None:
    if len(slurm_cluster.nodes) < 2:
        pytest.skip("the partition has fewer than two nodes")
    if not slurm_cluster.managed:
        pytest.skip("freezes a rank by PID: needs the local test cluster's shared PID namespace")
    corpus = h.write_corpus(slurm_workdir / "corpus.txt")
    data_dir = h.prepare_data(slurm_workdir, corpus)
    cfg = h.config_dict(corpus, nodes=2, gpus_per_node=1, max_steps=STEPS, checkpoint_every=20)
    # 50-100 ms a step (test_pipeline_slurm's timed model): time to act within an attempt.
    cfg["model"].update(hidden_size=128, intermediate_size=256, num_layers=2)
    cfg["train"]["micro_batch_size"] = 8
    run_dir = h.render(slurm_workdir / "wd", cfg)
    env_args = [f"--job-env={k}={v}" for k, v in slurm_cluster.job_env().items()]
    argv = h.launch_argv(run_dir, data_dir, partition=slurm_cluster.partition, time_min=10,
                         job_name="zs-wd", extra=[*env_args, f"--hang-timeout-s={HANG_TIMEOUT_S}",
                                                  "--hang-startup-s=240", "--hang-save-s=60"])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=h.env())
    try:
        h.wait_for(lambda: len(h.metrics(run_dir)) >= 25, 240, "step 25")
        job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        h.wait_for(lambda: any(m["attempt"] == 2 and m["step"] >= 50
                               for m in h.metrics(run_dir)), 240, "step 50 of attempt 2")
        pids = h.worker_pids(run_dir, rank=1)
        assert pids, "rank 1's process not found"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()
        _out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-6000:]
    ev = h.events(run_dir)
    hangs = [e for e in ev if e["event"] == "launch.hang"]
    named = [r for e in hangs for r in e["ranks"] if r["rank"] == 1 and r["suspect"]]
    assert named, hangs
    assert named[0]["state"].startswith("stopped") and named[0]["pid"] in pids
    assert named[0]["host"] in slurm_cluster.nodes
    # Detected after the timeout, well before the 10-minute limit.
    first = min(e["time"] for e in hangs)
    assert first - frozen_at < HANG_TIMEOUT_S + 15
    assert f"hang: rank 1 on {named[0]['host']}" in err
    requeues = [e for e in ev if e["event"] == "launch.requeue"]
    assert [(e["reason"], e["job_id"]) for e in requeues] == [("preemption", job_id),
                                                              ("failure", job_id)]
    starts = [e for e in ev if e["event"] == "start"]
    assert len(starts) == 3 and starts[2]["resumed_from"] >= 40, starts
    assert json.loads((run_dir / "train.done").read_text())["step"] == STEPS
    assert max(n["restart"] for n in h.node_records(run_dir)) == 2
    g = goodput(run_dir)
    assert [a["outcome"] for a in g["attempts"]] == ["requeue", "hang", "done"], g["attempts"]
    submit = next(e["time"] for e in ev if e["event"] == "launch.submit")
    end = [e["time"] for e in ev if e["event"] == "launch.end"][-1]
    assert abs(g["total"] - (end - submit)) < 1
    assert abs(sum(g[k] for k in PARTS) - g["total"]) < 1
    assert all(abs(a["unaccounted"]) < 1 for a in g["attempts"]), g["attempts"]
    assert g["queue"] > 0 and g["lost"] >= HANG_TIMEOUT_S and 0 < g["goodput"] < 1
    assert g["attempts"][0]["lost"] == 0 and g["attempts"][2]["load"] > 0
    print(json.dumps({k: g[k] for k in ("total", *PARTS, "goodput")}))
