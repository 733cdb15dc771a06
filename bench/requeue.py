"""Time from the time-limit warning to the first training step after the resume, on the test
Slurm cluster (tests/cluster), split into: save, Slurm requeue wait, start-up + load.

    .venv/bin/python bench/requeue.py [--steps 900] [--keep DIR]

Starts the local test cluster (root; `bash tests/cluster/install.sh` once) unless SLURM_CONF
names a running cluster, trains a small 2-node run (1 CPU process per node, gloo) under a 1-min
time limit with a 1 s warning, and reads the timestamps the launcher (``launch.*``) and the
ranks (``start``, ``save``, ``stop``) wrote to events.jsonl:

    signal   launch.signal   the head node's task got USR2 (submitit's handler)
    saved    launch.saved    the ranks agreed on a step and saved (stopped.json written)
    requeue  launch.requeue  `scontrol requeue` issued (by submitit)
    attempt  launch.attempt  the next attempt's node task started (job ran again)
    start    start           rank 0 resumed: rendezvous, model built, checkpoint loaded
    step 1   start + the first step's step_time_s (metrics.jsonl has no wall-clock time)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Run as a script, bench/ is sys.path[0], and bench/tokenize.py would shadow the standard
# library's tokenize (which inspect/linecache need): drop it.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO))  # the helpers import tests.conftest
sys.path.insert(0, str(REPO / "tests" / "cluster"))
sys.path.insert(0, str(REPO / "tests" / "slurm"))

import pipeline_helpers as h  # noqa: E402
import slurmcluster  # noqa: E402

SCHED_KEYS = ("SchedulerParameters", "AuthInfo", "MinJobAge", "KillWait", "MessageTimeout",
              "SchedulerType", "JobRequeue", "OverTimeLimit", "SlurmctldTimeout", "PriorityType")


def scheduler_settings() -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                         timeout=30).stdout
    found = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() in SCHED_KEYS:
            found[key.strip()] = value.strip()
    return found


def split(run_dir: Path) -> list[dict[str, float]]:
    """One row per requeue: durations in seconds between the recorded moments."""
    ev = h.events(run_dir)
    metrics = h.metrics(run_dir)
    first_step = {}
    for m in metrics:
        first_step.setdefault(m["attempt"], m)
    rows = []
    signals = [e for e in ev if e["event"] == "launch.signal"]
    for sig in signals:
        after = [e for e in ev if e["time"] >= sig["time"]]

        def first(name: str, since: float, _after: list = after) -> dict | None:
            return next((e for e in _after if e["event"] == name and e["time"] >= since), None)

        saved = first("launch.saved", sig["time"])
        requeue = first("launch.requeue", sig["time"])
        if saved is None or requeue is None:
            continue  # the last signal may have ended in a give-up
        attempt = first("launch.attempt", requeue["time"])
        start = first("start", attempt["time"]) if attempt else None
        if attempt is None or start is None:
            continue
        step = first_step.get(start["attempt"])
        step_s = step["step_time_s"] if step else 0.0
        save_ev = first("save", sig["time"])
        rows.append({
            "save": saved["time"] - sig["time"],
            "rank_save_s": save_ev["seconds"] if save_ev else float("nan"),
            "requeue_wait": attempt["time"] - requeue["time"],
            "startup_load": start["time"] - attempt["time"],
            "first_step": step_s,
            "total": start["time"] + step_s - sig["time"],
            "time_left_at_signal": sig.get("time_left_s") or float("nan"),
        })
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=900, help="training steps (enough for 1+ requeue)")
    p.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = p.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="zs-bench-requeue-"))
    work.mkdir(parents=True, exist_ok=True)
    cluster = None
    if not os.environ.get("SLURM_CONF"):
        cluster = slurmcluster.TestCluster(work / "cluster")
        info = cluster.start()
        os.environ.update(info.client_env())
    else:
        info = slurmcluster.site_cluster_from_env() or slurmcluster.ClusterInfo(
            partition="debug", account=None, nodes=("sn1", "sn2"), managed=True,
            socket_ifname="eth0")
    try:
        corpus = h.write_corpus(work / "corpus.txt")
        data = h.prepare_data(work, corpus)
        cfg = h.config_dict(corpus, nodes=2, gpus_per_node=1, max_steps=args.steps,
                            checkpoint_every=10_000)
        cfg["model"].update(hidden_size=128, intermediate_size=256, num_layers=2)
        cfg["train"]["micro_batch_size"] = 8
        run_dir = h.render(work / "run", cfg)
        env_args = [f"--job-env={k}={v}" for k, v in info.job_env().items()]
        t0 = time.time()
        h.run(h.launch_argv(run_dir, data, partition=info.partition, time_min=1,
                            signal_delay_s=1, job_name="zs-bench-requeue",
                            extra=[*env_args, "--max-requeues", "10"]), timeout=1200)
        wall = time.time() - t0
        rows = split(run_dir)
        settings = scheduler_settings()
    finally:
        if cluster is not None:
            cluster.stop()
    print(f"run: {args.steps} steps, 2 nodes x 1 process, wall {wall:.1f} s, "
          f"{len(rows)} requeue(s); run dir {run_dir}")
    cols = ["save", "rank_save_s", "requeue_wait", "startup_load", "first_step", "total",
            "time_left_at_signal"]
    print("  ".join(f"{c:>19}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>19.2f}" for c in cols))
    if rows:
        mean = {c: sum(r[c] for r in rows) / len(rows) for c in cols}
        print("  ".join(f"{mean[c]:>19.2f}" for c in cols) + "   (mean)")
    print("\nscheduler settings:")
    for k, v in settings.items():
        print(f"  {k} = {v}")
    print(json.dumps({"rows": rows, "settings": settings}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
