"""The batch page (issue 13): ``python -m pipeline.report`` over small, valid run folders, opened
in a real headless browser (Debian's chromium): it renders, every image loads, every run is
there with its figures and its link to its own report. No training: the run folders are
written here with the files the stages leave (config, metrics, events, eval)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, subprocess_env

RUNS = {"fsdp": 2.05, "deepspeed": 2.21, "wide.lr-3e-3": 1.88}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def fake_run(root: Path, name: str, bpb: float, lm_eval: bool) -> Path:
    """A finished run's folder as the stages leave it: config.json, metrics.jsonl (a resumed
    attempt repeating steps 5-6), events.jsonl (two local attempts), eval/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = root / "runs" / name
    (d / "eval").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(
        {"cluster": {"nodes": 1, "gpus_per_node": 2}, "train": {"backend": "fsdp"}}))
    t0, recs = 1_800_000_000.0, []
    for attempt, steps in ((1, range(1, 7)), (2, range(5, 11))):
        for s in steps:
            recs.append({"step": s, "time": t0 + 10 * attempt + s, "loss": 7.0 - 0.4 * s * bpb / 2,
                         "tokens_seen": 1024 * s, "tokens_per_s": 5000.0 + s, "attempt": attempt})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    events = [{"event": "launch.submit", "time": t0}, {"event": "launch.attempt", "time": t0 + 1},
              {"event": "start", "time": t0 + 2, "resumed_from": 0},
              {"event": "save", "time": t0 + 16, "step": 5, "seconds": 0.5},
              {"event": "launch.end", "time": t0 + 17.5, "rc": 1, "outcome": "failed"},
              {"event": "launch.attempt", "time": t0 + 18},
              {"event": "start", "time": t0 + 19, "resumed_from": 5},
              {"event": "finish", "time": t0 + 31, "step": 10},
              {"event": "launch.end", "time": t0 + 32, "rc": 0, "outcome": "done"}]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    ev = {"loss": bpb * 2.1, "perplexity": 2.718 ** (bpb * 2.1), "bits_per_byte": bpb,
          "tokens": 4096, "step": 10,
          "lm_eval": ({"results": {"zerosnake_heldout_continuation": {
              "acc,none": 0.41, "acc_stderr,none": 0.06}}} if lm_eval else
              {"skipped": "the lm-eval package is not installed"})}
    if lm_eval:  # and one run evaluated before the mixture was reported
        ev["mixture"] = {"code": {"target": 0.75, "consumed": 0.7471},
                         "<prose>": {"target": 0.25, "consumed": 0.2529}}
    (d / "eval" / "metrics.json").write_text(json.dumps(ev))
    (d / "eval" / "report.md").write_text(f"# Run `{name}`\n")
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([1, 2, 3], [3, 2, 1])
    fig.savefig(d / "eval" / "loss.png")
    plt.close(fig)
    return d


@pytest.fixture
def page(tmp_path) -> Path:
    results = tmp_path / "results"
    for i, (name, bpb) in enumerate(RUNS.items()):
        fake_run(results, name, bpb, lm_eval=i != 1)
    argv = [PY, "-m", "pipeline.report", "--results", str(results)]
    for name in RUNS:
        argv += ["--run", name]
    res = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env())
    assert res.returncode == 0, res.stderr
    return results / "report.html"


#: Appended to a copy of the page: once everything has loaded, the body records how many
#: images there are and which did not load (``--dump-dom`` prints the DOM after the load event).
PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = Array.from(document.images);
  document.body.dataset.images = imgs.length;
  document.body.dataset.broken = imgs.filter(i => !(i.complete && i.naturalWidth > 0))
                                     .map(i => i.alt).join("|");
  document.body.dataset.curvesWidth = document.getElementById("loss-curves").naturalWidth;
});
</script>"""


def chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
         f"--user-data-dir={cwd / 'chromium-profile'}", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (tests/cluster/install.sh "
                                             "installs Debian's chromium as root)")
def test_batch_page_renders_in_a_browser_with_every_run_and_image(page, tmp_path):
    probe = page.with_name("report-probe.html")  # beside it: the same relative links
    probe.write_text(page.read_text() + PROBE)
    res = chromium("--virtual-time-budget=10000", "--dump-dom", probe.as_uri(), cwd=tmp_path)
    dom = res.stdout
    assert "<table" in dom, res.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", dom).group(1)
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body))
    # The overlaid curves and each run's own plot, all loaded.
    assert attrs["images"] == str(1 + len(RUNS)), attrs
    assert attrs["broken"] == "", f"images that did not load: {attrs['broken']}"
    assert attrs["curves-width"] == "1000"
    for name, bpb in RUNS.items():
        row = re.search(rf'<tr data-run="{re.escape(name)}">(.*?)</tr>', dom, re.S)
        assert row, f"run {name} is not in the table"
        assert f'href="runs/{name}/eval/report.md"' in row.group(1)
        assert f"{bpb:.3f}" in row.group(1)
    assert "zerosnake_heldout_continuation acc_none" not in dom  # keys shown as lm-eval gave them
    assert "zerosnake_heldout_continuation acc,none" in dom and "0.4100" in dom
    assert "stderr" not in dom.split("<thead>")[1].split("</thead>")[0]
    # Goodput and GPU-hours from the events: two attempts of 16.5 s and 14 s on 2 processes.
    fsdp = re.search(r'<tr data-run="fsdp">(.*?)</tr>', dom, re.S).group(1)
    assert f"{2 * 30.5 / 3600:.4f}" in fsdp
    assert re.search(r"<td>\d+\.\d %</td>", fsdp), fsdp
    # It draws: a screenshot that is not one blank colour.
    shot = tmp_path / "shot.png"
    res = chromium("--window-size=1400,1000", f"--screenshot={shot}", page.as_uri(), cwd=tmp_path)
    assert shot.is_file(), res.stderr[-2000:]
    from PIL import Image

    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50


def test_batch_table_shows_each_runs_consumed_and_target_data_shares(page):
    text = page.read_text()
    assert "<th>data consumed (target)</th>" in text
    row = re.search(r'<tr data-run="fsdp">(.*?)</tr>', text, re.S).group(1)
    assert "code 74.7 % (target 75.0 %)<br>&lt;prose&gt; 25.3 % (target 25.0 %)" in row
    old = re.search(r'<tr data-run="deepspeed">(.*?)</tr>', text, re.S).group(1)
    assert old.count("<td>–</td>") >= 2  # no mixture in its metrics.json (nor lm-eval)


def test_report_cli_names_a_missing_run(tmp_path):
    (tmp_path / "runs").mkdir()
    res = subprocess.run([PY, "-m", "pipeline.report", "--results", str(tmp_path),
                          "--run", "nope"], capture_output=True, text=True, env=subprocess_env())
    assert res.returncode == 2 and "nope" in res.stderr and "Traceback" not in res.stderr
