"""bench/gpu.py's dry run (issue 15): every row rendered with a real planned figure, every
command parsed, the DAG planned by ``snakemake -n``; no GPU, nothing trained."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import PY, REPO, subprocess_env

MODELS = ("tiny", "llama1b")
ENGINES = ("fsdp", "ds-zero2", "ds-zero3", "ddp")


def test_dry_run_renders_every_row_and_trains_nothing(tmp_path):
    out, work = tmp_path / "gpu.md", tmp_path / "work"
    res = subprocess.run([PY, "-m", "bench.gpu", "--dry-run", "--out", str(out), "--work",
                          str(work)], cwd=REPO, env=subprocess_env(), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = out.read_text()
    assert "DRY RUN: nothing was measured" in table
    rows = {}
    for m in re.finditer(r"^\| (\w+) \| [\d.]+ M \| ([\w-]+) \| (on|off) \| \d+ × \d+ "
                         r"\| ([\d.]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|", table, re.M):
        model, engine, ac, planned, *measured = m.groups()
        rows[(model, engine, ac)] = float(planned)
        assert [c.strip() for c in measured] == ["dry run"] * 4, m.group(0)
    expected = {(m, e, ac) for m in MODELS for e in ENGINES for ac in ("on", "off")}
    expected.add(("llama1b", "fsdp-compile", "off"))  # the extra row, run after the DAG
    assert set(rows) == expected, sorted(expected ^ set(rows))
    assert all(planned > 0 for planned in rows.values()), rows
    # Activation checkpointing lowers the plan; the 1B model's is tens of GB.
    for e in ENGINES:
        assert rows[("llama1b", e, "on")] < rows[("llama1b", e, "off")]
        assert rows[("llama1b", e, "off")] > 10 > rows[("tiny", e, "off")]
    assert "`snakemake -n` plans the DAG: ok" in table
    # Rendered for real, trained not at all.
    runs = sorted(p.name for p in (work / "runs").iterdir())
    assert len(runs) == 17 and all((work / "runs" / r / "plan.json").is_file() for r in runs)
    for name in ("metrics.jsonl", "bench.json", "train.done", "manifest.json"):
        assert not list(work.rglob(name)), f"the dry run wrote {name}"
    assert not (work / "dag" / "results").exists()


def test_the_planner_is_within_10_percent_of_the_h200_rows(tmp_path):
    """The planner fix checked against the figures measured on an H200 (issue 15): every row of
    that run re-planned with this checkout's planner (render only, no GPU) is within 10 % of
    ``max_memory_allocated`` (1.1 B rows 0.97-1.00; before the fix activation checkpointing
    0.74-0.87 and ddp 1.29; the tiny rows ~2-6x), except the tiny ddp + checkpointing row at
    0.897: its loss side is smaller than the 16sbV the 1.1 B rows show (see OUTPUT_SBV_MIXED).
    The compile row is left out: the planner does not model compiled layers (it plans eager's
    larger activations, on the safe side)."""
    import json

    src = REPO / "docs" / "benchmarks" / "gpu-h200-run.json"
    out = tmp_path / "gpu.md"
    res = subprocess.run([PY, "-m", "bench.gpu", "--replan", str(src), "--out", str(out)],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    before = {r["name"]: r for r in json.loads(src.read_text())["rows"]}
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    measured = [r for r in rows if r["measured_bytes"] and r["engine"] != "fsdp-compile"]
    assert len(measured) == 11, [r["name"] for r in measured]
    ratios = {r["name"]: r["measured_bytes"] / r["planned_bytes"] for r in measured}
    exception = {"tiny-ddp-ac"}
    assert all(0.9 <= x <= 1.1 for n, x in ratios.items() if n not in exception), ratios
    assert all(0.88 <= ratios[n] < 1 for n in exception), ratios  # over-planned, by < 12 %
    assert all(0.96 <= x <= 1.01 for n, x in ratios.items() if n.startswith("llama1b")), ratios
    # The measured figures are the run's, untouched by the re-plan.
    assert all(r["measured_bytes"] == before[r["name"]]["measured_bytes"] for r in measured)
    off_before = [n for n in ratios
                  if abs(before[n]["measured_bytes"] / before[n]["planned_bytes"] - 1) > 0.1]
    assert len(off_before) == 8, off_before  # what the fix mended
