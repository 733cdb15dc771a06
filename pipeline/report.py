"""One page for a batch of runs: ``results/report.html``.

``python -m pipeline.report --results results --run fsdp --run deepspeed --out
results/report.html`` reads each run's files (``metrics.jsonl``, ``events.jsonl``,
``config.json``, ``eval/metrics.json``; never a model) and writes one self-contained HTML page:

* every run's training loss against tokens seen, overlaid (one PNG, embedded), with each run's
  validation loss as a point at its last step;
* a table: validation loss, perplexity, bits per byte, lm-eval scores (one column per task and
  metric any run has), the data mixture (each source's consumed share of the training tokens
  against its target, from the evaluation), median tokens/s, goodput (``pipeline.observe.goodput``), GPU-hours (processes ×
  the wall time of the run's attempts) and the steps and tokens trained;
* each run linked to its own report (``runs/<run>/eval/report.md``) and its plots
  (``runs/<run>/eval/loss.png``), by paths relative to the page.

Pure and torch-free (the login node can run it); values from the files are escaped (a run
name or lm-eval task is data, never markup), and the files are checked field by field
(``pipeline.artifacts.read_eval_metrics``, ``read_run_config_view``): a malformed one is an error
naming it. ``--out`` replaces only a page this command wrote (:data:`MARKER` in its head).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pipeline import artifacts as af
from pipeline.errors import PipelineError
from pipeline.io import printable, write_text_atomic
from pipeline.observe.goodput import goodput

#: In the page's head: "this command wrote me" (``--out`` replaces only such a file).
MARKER = '<meta name="generator" content="zerosnake report">'
#: How pages written before the marker existed begin (they are this command's too).
_LEGACY_HEAD = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
                "<title>zerosnake batch report</title>")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """metrics.jsonl with one record per step (the last: a resumed run repeats some)."""
    by_step = {r["step"]: r for r in records if type(r.get("step")) is int}
    return [by_step[s] for s in sorted(by_step)]


def run_summary(run_dir: Path) -> dict[str, Any]:
    """What the page shows of one run, from its files (missing files leave fields None)."""
    metrics = _last_per_step(af.read_metrics(run_dir))
    # Both checked field by field: a malformed one is an error naming the file, not a
    # traceback (absent ones leave their cells empty).
    ev = af.read_eval_metrics(run_dir) or {}
    cfg = af.read_run_config_view(run_dir) or {}
    cluster, train = cfg.get("cluster") or {}, cfg.get("train") or {}
    world = (cluster.get("nodes") or 1) * (cluster.get("gpus_per_node") or 1)
    gp = goodput(run_dir)
    # Device time: every process for the wall time of every attempt (queue waits excluded).
    wall = sum((a["end"] or a["begin"]) - a["begin"] for a in gp["attempts"])
    tps = [r["tokens_per_s"] for r in metrics if _num(r.get("tokens_per_s"))]
    lm = ((ev.get("lm_eval") or {}).get("results")) or {}
    return {
        "run": run_dir.name,
        "backend": train.get("backend"),
        "world": world,
        "steps": metrics[-1]["step"] if metrics else None,
        "tokens": next((r["tokens_seen"] for r in reversed(metrics)
                        if type(r.get("tokens_seen")) is int), None),
        "curve": [(r["tokens_seen"], r["loss"]) for r in metrics
                  if _num(r.get("tokens_seen")) and _num(r.get("loss"))],
        "train_loss": next((r["loss"] for r in reversed(metrics) if _num(r.get("loss"))), None),
        "val_loss": ev.get("loss"),
        "perplexity": ev.get("perplexity"),
        "bits_per_byte": ev.get("bits_per_byte"),
        "lm_eval": {(task, key): v for task, r in lm.items() if isinstance(r, dict)
                    for key, v in r.items() if _num(v) and not key.endswith("_stderr")
                    and "stderr" not in key},
        "mixture": _mixture(ev.get("mixture")),
        "tokens_per_s": statistics.median(tps) if tps else None,
        "goodput": gp["goodput"],
        "gpu_hours": world * wall / 3600 if gp["attempts"] else None,
        "report": (run_dir / af.EVAL_DIR / "report.md").is_file(),
        "plot": (run_dir / af.EVAL_DIR / "loss.png").is_file(),
    }


def _escape(text: str) -> str:
    """A value from the files as page text: markup escaped, control characters shown escaped
    (the page is also read with cat and less)."""
    return html.escape(printable(text))


def _mixture(shares: Any) -> list[tuple[str, Any, Any]]:
    """(source, consumed, target) of eval/metrics.json's ``mixture`` (pipeline.evaluate)."""
    if not isinstance(shares, dict):
        return []
    return [(str(n), s.get("consumed"), s.get("target")) for n, s in shares.items()
            if isinstance(s, dict)]


def _pct(v: Any) -> str:
    return f"{100 * v:.1f} %" if _num(v) else "–"


def _mixture_cell(mix: list[tuple[str, Any, Any]]) -> str:
    return "<br>".join(f"{_escape(n)} {_pct(c)} (target {_pct(t)})"
                       for n, c, t in mix) or "–"


def loss_plot_png(runs: list[dict[str, Any]]) -> bytes:
    """All runs' training loss against tokens, overlaid (validation loss as a point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for i, r in enumerate(runs):
        color = f"C{i % 10}"
        if r["curve"]:
            xs, ys = zip(*r["curve"], strict=True)
            # A run name is a folder's name: "$" would start matplotlib's math text.
            ax.plot(xs, ys, color=color, label=printable(r["run"]).replace("$", r"\$"),
                    linewidth=1.2)
            if _num(r["val_loss"]):
                ax.scatter([xs[-1]], [r["val_loss"]], color=color, marker="o", zorder=3)
    ax.set(xlabel="tokens seen", ylabel="training loss",
           title="training loss (points: validation loss of the final model)")
    ax.grid(alpha=0.3)
    if any(r["curve"] for r in runs):
        ax.legend(fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _fmt(v: Any, spec: str) -> str:
    if spec.endswith("d") and type(v) is not int:  # an integer format of a float would raise
        return "–"
    return format(v, spec) if _num(v) else "–"


def _link(page: Path, target: Path) -> str:
    """``target`` relative to the page's folder, URL-quoted (the page can be moved with its
    results folder)."""
    from urllib.parse import quote

    return quote(os.path.relpath(target, page.parent).replace(os.sep, "/"))


def render_html(runs: list[dict[str, Any]], run_dirs: list[Path], page: Path) -> str:
    """The page (see the module docstring)."""
    e = _escape
    lm_cols = sorted({k for r in runs for k in r["lm_eval"]})
    mix_col = any(r["mixture"] for r in runs)
    head = ["run", "engine", "processes", "steps", "tokens", "train loss", "val loss",
            "perplexity", "bits/byte", *[f"{t} {m}" for t, m in lm_cols],
            *(["data consumed (target)"] if mix_col else []), "tokens/s",
            "goodput", "GPU-hours", "plots"]
    rows = []
    for r, d in zip(runs, run_dirs, strict=True):
        name = e(r["run"])
        if r["report"]:
            name = f'<a href="{_link(page, d / af.EVAL_DIR / "report.md")}">{name}</a>'
        thumb = (f'<img class="thumb" alt="{e(r["run"])} training curves" '
                 f'src="{_link(page, d / af.EVAL_DIR / "loss.png")}">' if r["plot"] else "–")
        cells = [name, e(str(r["backend"] or "–")), _fmt(r["world"], "d"), _fmt(r["steps"], "d"),
                 _fmt(r["tokens"], ",d"), _fmt(r["train_loss"], ".4f"), _fmt(r["val_loss"], ".4f"),
                 _fmt(r["perplexity"], ".2f"), _fmt(r["bits_per_byte"], ".3f"),
                 *[_fmt(r["lm_eval"].get(k), ".4f") for k in lm_cols],
                 *([_mixture_cell(r["mixture"])] if mix_col else []),
                 _fmt(r["tokens_per_s"], ",.0f"),
                 "–" if r["goodput"] is None else f"{100 * r['goodput']:.1f} %",
                 _fmt(r["gpu_hours"], ".4f"), thumb]
        rows.append(f'<tr data-run="{e(r["run"])}">' + "".join(f"<td>{c}</td>" for c in cells)
                    + "</tr>")
    png = base64.b64encode(loss_plot_png(runs)).decode()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
{MARKER}
<title>zerosnake batch report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin-top: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child, th:first-child {{ text-align: left; }}
img.thumb {{ height: 60px; }}
</style></head>
<body>
<h1>zerosnake: {len(runs)} runs</h1>
<p>Generated {e(stamp)}. Losses are per token of this batch's tokenizer; bits per byte compare
across tokenizers. Goodput: productive step time / wall time of the training (pipeline.observe.goodput).
GPU-hours: processes × the wall time of every attempt.</p>
<img id="loss-curves" alt="training loss against tokens, all runs" src="data:image/png;base64,{png}">
<table id="runs">
<thead><tr>{"".join(f"<th>{e(h)}</th>" for h in head)}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table>
</body></html>
"""


def check_out(out: Path) -> None:
    """Refuse an ``--out`` this command did not write: a page is replaced only when it carries
    :data:`MARKER` (or is a page written before the marker existed: :data:`_LEGACY_HEAD`), so a
    mistyped ``--out`` never overwrites someone's file (a thesis, a run's config.json)."""
    if out.is_symlink():
        raise PipelineError(f"--out {out} is a symbolic link: nothing was written; name a file "
                            "of its own")
    if not out.exists():
        return
    if not out.is_file():
        raise PipelineError(f"--out {out} exists and is not a file: nothing was written; "
                            "name the page's file (default: RESULTS/report.html)")
    try:
        with out.open("rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError as err:
        raise PipelineError(f"--out {out} cannot be read ({err.strerror or err}): nothing was "
                            "written") from None
    if MARKER not in head and not head.startswith(_LEGACY_HEAD):
        raise PipelineError(f"--out {out} exists and is not a page this command wrote (no "
                            "zerosnake report marker in it): nothing was written; choose "
                            "another --out, or move the file aside yourself")


def write_report(results: Path, runs: list[str], out: Path) -> Path:
    """Read each run of ``runs`` under ``results/runs`` and write the page to ``out`` (only
    where :func:`check_out` allows, checked before any run is read and again before writing)."""
    check_out(out)
    dirs = [results / "runs" / r for r in runs]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise PipelineError(f"no run folder {', '.join(missing)}: name runs under "
                            f"{results / 'runs'} (--run NAME)")
    summaries = [run_summary(d) for d in dirs]
    page = render_html(summaries, dirs, out)
    check_out(out)
    write_text_atomic(out, page)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.report",
        description="One HTML page comparing a batch of runs: loss curves, evaluation, "
                    "throughput, goodput, GPU-hours.")
    p.add_argument("--results", type=Path, default=Path("results"), help="the results folder")
    p.add_argument("--run", action="append", dest="runs", default=None,
                   help="a run name (repeatable; default: every folder in RESULTS/runs)")
    p.add_argument("--out", type=Path, default=None, help="default: RESULTS/report.html")
    args = p.parse_args(argv)
    runs = args.runs
    if runs is None:
        root = args.results / "runs"
        runs = sorted(d.name for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
    try:
        if not runs:
            raise PipelineError(f"no runs under {args.results / 'runs'}: train some first")
        out = write_report(args.results, runs, args.out or args.results / "report.html")
    except PipelineError as err:
        print(f"error: {printable(str(err), lines=True)}", file=sys.stderr)
        return af.EXIT_USAGE
    except OSError as err:
        print(f"error: {printable(str(err.filename or args.out))}: {err.strerror or err}",
              file=sys.stderr)
        return 1
    print(printable(str(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
