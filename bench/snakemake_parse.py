"""Snakefile parse-time benchmark (issue 10): ratios measured in one run, on the same cores.

    python -m bench.snakemake_parse [--shards 1000] [--runs 10] [--rounds 5] [--keep DIR]

(a) ``snakemake -n`` of this project's Snakefile on a generated config: ``data.shards`` shards
    and ``--runs`` runs (half FSDP, half DeepSpeed ZeRO-2), in a fresh working directory;
(b) the same on a trivial Snakefile with the same job graph: the same rule names, inputs and
    outputs, the same number of jobs, no imports and no config parsing.
(c)/(d) the same two Snakefiles parsed as one cluster job of the executor plugin parses them on
    its node: ``--mode remote --target-jobs tokenize_shard:shard=00007 -n``.
A and B alternate (A B A B ...) for ``--rounds`` rounds; the medians and the ratios are printed.
Each dry run starts a fresh Snakemake, so the ratios are the Snakefile's own cost (imports,
config parsing, pre-flight, DAG inputs) over Snakemake's. Goal: (a)/(b) <= 1.5.
The pre-flight's pass is cached under the working directory's ``.snakemake/`` (the warm-up run
records it): (a) is a restart with an unchanged config; the warm-up's time is the first start.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
GOAL = 1.5

TRIVIAL = '''\
# The same job graph as the project's Snakefile, with nothing else: no imports, no config.
SHARDS = [f"{{i:05d}}" for i in range({shards})]
RUNS = {runs!r}
DATA = "results/data"

wildcard_constraints:
    run="|".join(RUNS),
    shard=r"\\d{{5}}",

localrules: all, tokenizer, gather, render, train

rule all:
    input: expand("results/runs/{{run}}/eval/metrics.json", run=RUNS)

rule tokenizer:
    output: f"{{DATA}}/tokenizer/tokenizer.json"
    shell: "touch {{output}}"

rule tokenize_shard:
    input: tokenizer=f"{{DATA}}/tokenizer/tokenizer.json"
    output: stats=f"{{DATA}}/shards/shard-{{{{shard}}}}.stats.json"
    shell: "touch {{output}}"

rule gather:
    input:
        expand(f"{{DATA}}/shards/shard-{{{{shard}}}}.stats.json", shard=SHARDS),
        tokenizer=f"{{DATA}}/tokenizer/tokenizer.json",
    output: f"{{DATA}}/manifest.json"
    shell: "touch {{output}}"

rule render:
    input: manifest=f"{{DATA}}/manifest.json"
    output:
        config="results/runs/{{run}}/config.json",
        topology="results/runs/{{run}}/topology.json",
        plan="results/runs/{{run}}/plan.md",
    shell: "touch {{output}}"

rule train:
    input:
        config="results/runs/{{run}}/config.json",
        manifest=f"{{DATA}}/manifest.json",
    output: done="results/runs/{{run}}/train.done"
    shell: "touch {{output}}"

rule consolidate:
    input:
        done="results/runs/{{run}}/train.done",
        manifest=f"{{DATA}}/manifest.json",
    output: config="results/runs/{{run}}/hf/config.json"
    shell: "touch {{output}}"

rule evaluate:
    input:
        model="results/runs/{{run}}/hf/config.json",
        manifest=f"{{DATA}}/manifest.json",
    output:
        metrics="results/runs/{{run}}/eval/metrics.json",
        plot="results/runs/{{run}}/eval/loss.png",
        report="results/runs/{{run}}/eval/report.md",
    shell: "touch {{output}}"
'''


def project_config(shards: int, runs: int) -> dict:
    """The embedded default with ``shards`` shards and ``runs`` runs (FSDP / DeepSpeed)."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["data"]["shards"] = shards
    cfg["runs"] = {}
    for i in range(runs):
        if i % 2:
            cfg["runs"][f"r{i:02d}"] = {"train": {"backend": "deepspeed", "zero_stage": 2,
                                                  "lr": 1e-3 * (i + 1)}}
        else:
            cfg["runs"][f"r{i:02d}"] = {"train": {"lr": 1e-3 * (i + 1)}}
    return cfg


def dry_run(workdir: Path, snakefile: Path, *args: str) -> tuple[float, str]:
    """Seconds of one ``snakemake -n`` (a fresh process: the parse is paid every time)."""
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "snakemake", "-s", str(snakefile), "-n", "--cores", "1",
            "--quiet", "rules", *args]
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"snakemake -n failed in {workdir}:\n{res.stderr[-3000:]}")
    return dt, res.stdout + res.stderr


def job_counts(out: str) -> dict[str, int]:
    counts = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=1000)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5, help="A B pairs (medians over these)")
    p.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = p.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="zs-bench-parse-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        a_dir, b_dir = work / "project", work / "trivial"
        a_dir.mkdir(exist_ok=True)
        b_dir.mkdir(exist_ok=True)
        cfg = project_config(args.shards, args.runs)
        (a_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        trivial = b_dir / "Snakefile"
        trivial.write_text(TRIVIAL.format(shards=args.shards, runs=list(cfg["runs"])))
        a_args = ("--configfile", str(a_dir / "config.yaml"))

        job = ("--mode", "remote", "--target-jobs", "tokenize_shard:shard=00007")
        # Warm-up (timed apart): file-system caches, the pre-flight's first pass, and the same
        # job graph on both sides.
        first, out_a = dry_run(a_dir, REPO / "Snakefile", *a_args)
        _, out_b = dry_run(b_dir, trivial)
        ca, cb = job_counts(out_a), job_counts(out_b)
        if ca != cb:
            raise SystemExit(f"job graphs differ:\n project {ca}\n trivial {cb}")
        print(f"job graph: {ca.get('total')} jobs "
              f"({args.shards} shards x {args.runs} runs), {args.rounds} rounds A B")
        print(f"first start (pre-flight not cached yet): project {first:.2f} s")

        ta, tb, tc, td = [], [], [], []
        for i in range(args.rounds):
            ta.append(dry_run(a_dir, REPO / "Snakefile", *a_args)[0])
            tb.append(dry_run(b_dir, trivial)[0])
            tc.append(dry_run(a_dir, REPO / "Snakefile", *a_args, *job)[0])
            td.append(dry_run(b_dir, trivial, *job)[0])
            print(f"  round {i + 1}: snakemake -n: project {ta[-1]:.2f} s  trivial {tb[-1]:.2f} s"
                  f" | cluster job: project {tc[-1]:.2f} s  trivial {td[-1]:.2f} s")
        ma, mb = statistics.median(ta), statistics.median(tb)
        mc, md = statistics.median(tc), statistics.median(td)
        ratio = ma / mb
        print(f"(a) project Snakefile  snakemake -n: median {ma:.2f} s")
        print(f"(b) trivial Snakefile  snakemake -n: median {mb:.2f} s")
        print(f"(a)/(b) = {ratio:.2f}x  (goal <= {GOAL}x: {'met' if ratio <= GOAL else 'NOT met'})")
        print(f"(c) project Snakefile  one cluster job's parse: median {mc:.2f} s")
        print(f"(d) trivial Snakefile  one cluster job's parse: median {md:.2f} s")
        print(f"(c)/(d) = {mc / md:.2f}x")
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
