"""The evaluate stage: held-out perplexity of the consolidated HF model, and a report.

``python -m pipeline.evaluate --model results/runs/NAME/hf --data-dir results/data --run-dir
results/runs/NAME --out results/runs/NAME/eval`` loads the model with ``from_pretrained`` (not
training state, so what is measured is what users get), computes the mean token loss on the
whole validation split, and writes ``metrics.json``, ``loss.png`` and ``report.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import artifacts as af
from pipeline.data.mixture import mixture_shares, source_sizes
from pipeline.errors import PipelineError
from pipeline.io import write_json_atomic, write_text_atomic
from pipeline.observe.goodput import format_goodput, goodput

# No trailing spaces: byte-level BPE attaches the space to the next word (" foo").
PROMPTS = ("def", "import", "class", "    for", "if __name__ ==", "The")
#: Sampling for the report's samples: greedy decoding of a small model loops on one token
#: (``_p_p_p_p``); a temperature below 1 with top-k shows what it learned. Seeded: a rerun
#: of the same model gives the same samples.
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 40, "max_new_tokens": 64}
SAMPLE_SEED = 0


def token_byte_lengths(tokenizer: Any) -> np.ndarray:
    """UTF-8 bytes of text each token id stands for (0 for special tokens).

    Byte-level BPE tokens are byte strings spelled in GPT-2's printable alphabet; mapping them
    back gives exact byte counts even for tokens that split a multi-byte character (decoding a
    single such token would yield U+FFFD instead).
    """
    from pipeline.text.tokenizer import byte_decoder

    to_byte = byte_decoder()
    special = set(tokenizer.all_special_ids)
    sizes = np.zeros(len(tokenizer), dtype=np.int64)
    for tid in range(len(tokenizer)):
        if tid in special:
            continue
        piece = tokenizer.convert_ids_to_tokens(tid)
        if piece is not None and all(ch in to_byte for ch in piece):
            sizes[tid] = len(piece)
        else:  # not byte-level (e.g. a SentencePiece tokenizer): decode it
            sizes[tid] = len(tokenizer.decode([tid]).encode("utf-8"))
    return sizes


def perplexity(
    model: Any, sequences: np.ndarray, byte_lengths: np.ndarray | None = None, batch_size: int = 16
) -> dict[str, float]:
    """Token-weighted mean loss, perplexity and bits per byte over packed sequences."""
    import torch  # here, not at import: a bad argument is reported without loading torch

    with torch.no_grad():
        return _perplexity(torch, model, sequences, byte_lengths, batch_size)


def _perplexity(torch: Any, model: Any, sequences: np.ndarray, byte_lengths: np.ndarray | None,
                batch_size: int) -> dict[str, float]:
    total_loss = 0.0
    total_tokens = 0
    total_bytes = 0
    from tqdm import tqdm

    # At a terminal only (disable=None: off when stderr is not a TTY, e.g. Snakemake's logs).
    for i in tqdm(range(0, len(sequences), batch_size), desc="validation", unit="batch",
                  disable=None):
        ids = torch.from_numpy(sequences[i : i + batch_size].astype(np.int64))
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total_loss += loss.item()
        total_tokens += ids[:, 1:].numel()
        if byte_lengths is not None:
            total_bytes += int(byte_lengths[ids[:, 1:].numpy()].sum())
    if total_tokens == 0:
        raise PipelineError("the validation split is empty: raise data.val_fraction")
    mean = total_loss / total_tokens
    out = {"loss": mean, "perplexity": math.exp(mean), "tokens": total_tokens}
    if total_bytes:
        # Bits per byte: the tokenizer-independent figure (nats → bits, per byte of text).
        out["bits_per_byte"] = total_loss / math.log(2) / total_bytes
        out["bytes"] = total_bytes
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl, keeping the last record of each step (a resumed run repeats some); a
    line cut by a crash is skipped (``pipeline.artifacts.read_jsonl``), and so is a record
    without an integer step. Plots and the report use a field only where it is a number."""
    by_step = {rec["step"]: rec for rec in af.read_jsonl(path) if type(rec.get("step")) is int}
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of the records where both fields are numbers."""
    pts = [(r[x], r[y]) for r in records if _number(r.get(x)) and _number(r.get(y))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _final_loss(records: list[dict[str, Any]]) -> float | None:
    losses = [r["loss"] for r in records if _number(r.get("loss"))]
    return losses[-1] if losses else None


def plot_training(records: list[dict[str, Any]], png: Path, val_loss: float | None) -> None:
    """Loss against tokens (with the validation loss as a point), learning rate, tokens/s."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    tokens, losses = _series(records, "tokens_seen", "loss")
    axes[0].plot(tokens, losses, label="train")
    if val_loss is not None and tokens:
        axes[0].scatter([tokens[-1]], [val_loss], color="C3", zorder=3, label="validation")
    axes[0].set(xlabel="tokens", ylabel="loss", title="loss")
    axes[0].legend()
    axes[1].plot(*_series(records, "step", "lr"))
    axes[1].set(xlabel="step", ylabel="learning rate", title="learning rate")
    axes[2].plot(*_series(records, "step", "tokens_per_s"))
    axes[2].set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


#: The built-in lm-eval task: pick a held-out text's true continuation among 4.
LM_EVAL_TASK = "zerosnake_heldout_continuation"
LM_EVAL_TEMPLATE = """\
# Written by pipeline.evaluate from the run's validation split (lm-eval task config).
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def continuation_items(
    tokenizer: Any, seqs: np.ndarray, n: int = 64, context: int = 48, cont: int = 16, seed: int = 0
) -> list[dict[str, Any]]:
    """Four-way choice items from held-out sequences: a context, its true continuation (label
    0 before shuffling) and three continuations taken from other sequences."""
    rng = np.random.default_rng(seed)
    usable = [s for s in seqs if len(s) >= context + cont]
    if len(usable) < 4:
        return []
    items = []
    for i in range(min(n, len(usable))):
        others = rng.choice([j for j in range(len(usable)) if j != i], 3, replace=False)
        conts = [usable[i][context:context + cont]] + [usable[j][context:context + cont] for j in others]
        choices = [tokenizer.decode(c.tolist()) for c in conts]
        order = rng.permutation(4)
        items.append({
            "context": tokenizer.decode(usable[i][:context].tolist()),
            "choices": [choices[k] for k in order],
            "label": int(np.argmax(order == 0)),
        })
    return items


def run_lm_eval(model: Any, tokenizer: Any, items: list[dict[str, Any]], work: Path,
                tasks_dir: Path | None = None, tasks: list[str] | None = None) -> dict[str, Any]:
    """EleutherAI's lm-evaluation-harness on local task files with the consolidated model
    (``model``/``tokenizer``, already loaded from the HF directory: a second copy of a large
    model would double the job's memory).

    Runs the built-in held-out continuation task (``items``, written under ``work``) and, when
    ``tasks_dir`` is given, the ``tasks`` defined by the YAML files there. An optional extra:
    without the ``lm-eval`` package this returns ``{"skipped": reason}`` instead.
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        return {"skipped": "the lm-eval package is not installed (pip install lm-eval); "
                           "harness not run"}
    work.mkdir(parents=True, exist_ok=True)
    names = list(tasks or [])
    include = [str(tasks_dir)] if tasks_dir is not None else []
    if items:
        data = work / f"{LM_EVAL_TASK}.jsonl"
        data.write_text("".join(json.dumps(x) + "\n" for x in items))
        (work / f"{LM_EVAL_TASK}.yaml").write_text(
            LM_EVAL_TEMPLATE.format(task=LM_EVAL_TASK, data=json.dumps(str(data))))
        include.append(str(work))
        names.insert(0, LM_EVAL_TASK)
    if not names:
        return {"skipped": "no lm-eval task: the validation split is too small for the built-in one"}
    res = lm_eval.simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8),
        tasks=names,
        task_manager=TaskManager(include_path=include),
        log_samples=False,
    )
    results = {
        task: {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for task, r in res["results"].items()
    }
    return {"version": getattr(lm_eval, "__version__", None), "results": results}


#: What evaluate writes into ``--out`` (a folder holding only these, or its marker, is one
#: it wrote before and may replace).
EVAL_FILES = (af.EVAL_METRICS, "loss.png", "report.md", "lm_eval")


def _check_inputs(model_dir: Path, run_dir: Path, out: Path, lm_eval_tasks: Path | None,
                  lm_eval_names: list[str] | None) -> dict[str, Any]:
    """Everything that can be checked before the model is loaded: the consolidation record
    (returned), the run directory, the output folder and the lm-eval options."""
    if not (model_dir / af.RUN_CONFIG).is_file():
        raise PipelineError(f"--model {model_dir} is not an HF model directory (no "
                            f"{af.RUN_CONFIG}): run consolidate first")
    origin = af.read_artifact(model_dir / af.HF_PROVENANCE, "consolidation record",
                              hint="run consolidate again")
    if type(origin.get("step")) is not int or not isinstance(
            origin.get("checkpoint_manifest_sha256"), str):
        raise PipelineError(f"{model_dir / af.HF_PROVENANCE}: the consolidation record has no "
                            "valid step or checkpoint_manifest_sha256; run consolidate again")
    if not run_dir.is_dir():
        raise PipelineError(f"--run-dir {run_dir} is not a folder: name results/runs/NAME")
    # The run's files read after the evaluation (its trackers, its mixture), checked field by
    # field now: a malformed one must not cost the evaluation or surface as a traceback.
    view = af.read_run_config_view(run_dir)
    af.read_trackers(run_dir)
    name = _check_same_run(model_dir, run_dir, origin, view)
    if lm_eval_tasks is not None and not lm_eval_tasks.is_dir():
        raise PipelineError(f"--lm-eval-tasks {lm_eval_tasks} is not a folder of task YAMLs")
    if lm_eval_names and lm_eval_tasks is None:
        raise PipelineError("--lm-eval-task needs --lm-eval-tasks DIR (the folder defining it)")
    # Replaced as a whole, atomically, and only when evaluate wrote it (checked again when
    # the new folder is swapped in): `--out .` or `--out results/runs/NAME` is refused here,
    # before any work.
    try:
        af.check_replaceable(out, af.EVAL_MARKER, EVAL_FILES, owner={"run": name})
    except PipelineError as err:
        raise PipelineError(f"--out {err}") from None
    return {**origin, "run": name}


def _check_same_run(model_dir: Path, run_dir: Path, origin: dict[str, Any],
                    config: dict[str, Any] | None) -> str:
    """The run's name; the model was consolidated from this run's checkpoints with this run's
    config (the consolidation record names the run and, from consolidations that record it,
    the checkpoint's config hash)."""
    name = config.get("name") if isinstance(config, dict) else None
    name = name if isinstance(name, str) else run_dir.name
    theirs = origin.get("run")
    if isinstance(theirs, str) and theirs != name:
        raise PipelineError(
            f"--model {model_dir} was consolidated from run {theirs!r}, not from --run-dir "
            f"{run_dir} (run {name!r}): evaluate each model with its own run directory"
        )
    chash = origin.get("config_hash")
    if chash is not None:
        from pipeline.checkpoint.format import config_hash
        from pipeline.config.files import load_run_config

        ours = config_hash(load_run_config(run_dir / af.RUN_CONFIG))
        if chash != ours:
            raise PipelineError(
                f"--model {model_dir} was trained with another config than "
                f"{run_dir / af.RUN_CONFIG} (config hash {str(chash)[:12]}, here {ours[:12]}): "
                "its checkpoint came from another run; consolidate this run's own checkpoint"
            )
    return name


def _check_same_tokenizer(model_dir: Path, data_dir: Path, tok: dict[str, Any]) -> None:
    """The model folder's tokenizer is the one the data was tokenized with (consolidate copies
    it byte for byte), else the perplexity would be of other text than the model's."""
    from pipeline.text.tokenizer import fingerprint

    if not (model_dir / "tokenizer.json").is_file() or not isinstance(tok.get("fingerprint"), str):
        return
    if fingerprint(model_dir) != tok["fingerprint"]:
        raise PipelineError(
            f"--model {model_dir} has another tokenizer than the data in --data-dir {data_dir} "
            "was made with (fingerprints differ): evaluate a model on the data it was trained on"
        )


def _load(model_dir: Path) -> tuple[Any, Any]:
    """The consolidated model and its tokenizer (a folder that does not load is an error
    naming it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:  # transformers/safetensors raise many types for a bad folder
        raise PipelineError(f"--model {model_dir} does not load as an HF model and tokenizer "
                            f"({type(err).__name__}: {err}); rerun consolidate") from err
    model.eval()
    return model, tokenizer


def _str_keyed(d: Any, ok: Any) -> bool:
    return isinstance(d, dict) and bool(d) and all(isinstance(k, str) and ok(v)
                                                   for k, v in d.items())


def run_mixture(run_dir: Path, manifest: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each source's target and consumed share of the training tokens: the target from the
    run's ``train.mixture`` (``config.json``; none: in proportion to the manifest's counts),
    consumed from ``train.done``'s ``tokens_by_source`` (None where training did not record
    it). A malformed field counts as absent: the report shows what is known."""
    config = af.read_run_config_view(run_dir) or {}
    mixture = (config.get("train") or {}).get("mixture")
    done = af.read_json_or_none(run_dir / af.TRAIN_DONE)
    consumed = done.get("tokens_by_source") if isinstance(done, dict) else None
    sizes = source_sizes(manifest)
    if not _str_keyed(mixture, lambda v: _number(v) and v > 0):
        mixture = None
    if not _str_keyed(consumed, lambda v: type(v) is int and v >= 0):
        consumed = None
    return mixture_shares(sizes, mixture, consumed)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def format_mixture(shares: dict[str, dict[str, float | None]]) -> list[str]:
    """The report's table of the data mixture (target vs consumed share per source)."""
    return ["| source | target share | consumed share |", "|---|---|---|",
            *[f"| {n} | {_pct(s['target'])} | {_pct(s['consumed'])} |"
              for n, s in shares.items()]]


def generate_samples(model: Any, tokenizer: Any, prompts: tuple[str, ...] = PROMPTS,
                     seed: int = SAMPLE_SEED) -> list[dict[str, Any]]:
    """One sample per prompt (:data:`SAMPLING`), each from the same seed: reproducible."""
    import torch
    from tqdm import tqdm

    samples = []
    for prompt in tqdm(prompts, desc="samples", unit="prompt", disable=None):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        torch.manual_seed(seed)
        out_ids = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 pad_token_id=tokenizer.eos_token_id, **SAMPLING)
        samples.append({"prompt": prompt, "text": tokenizer.decode(out_ids[0],
                                                                   skip_special_tokens=True)})
    return samples


def evaluate(model_dir: Path, data_dir: Path, run_dir: Path, out: Path,
             lm_eval_tasks: Path | None = None, lm_eval_names: list[str] | None = None) -> dict[str, Any]:
    """Evaluate the HF model on the validation split; write metrics, plot and report (into
    ``out``, replaced as a whole: see :func:`_check_inputs`)."""
    from pipeline.data.loader import PackedDataset

    origin = _check_inputs(model_dir, run_dir, out, lm_eval_tasks, lm_eval_names)
    records = read_metrics(run_dir / af.METRICS)
    val = PackedDataset(data_dir, split="validation")
    if len(val) == 0:
        raise PipelineError(f"the validation split of {data_dir} has no sequences: raise "
                            "data.val_fraction (tokenize --val-fraction) and tokenize again")
    _check_same_tokenizer(model_dir, data_dir, val.manifest["tokenizer"])
    seqs = np.stack([val[i] for i in range(len(val))])
    model, tokenizer = _load(model_dir)
    vocab = model.config.vocab_size
    if len(seqs) and int(seqs.max()) >= vocab:
        raise PipelineError(
            f"the validation split of {data_dir} holds token id {int(seqs.max())}, beyond the "
            f"model's vocabulary of {vocab}: --data-dir is not the data --model was trained on"
        )
    result = perplexity(model, seqs, token_byte_lengths(tokenizer))
    samples = generate_samples(model, tokenizer)
    with af.replacing_dir(out, af.EVAL_MARKER, EVAL_FILES, owner={"run": origin["run"]}) as tmp:
        harness = run_lm_eval(model, tokenizer, continuation_items(tokenizer, seqs),
                              tmp / "lm_eval", lm_eval_tasks, lm_eval_names)
        if "skipped" in harness:
            print(f"lm-eval: {harness['skipped']}", file=sys.stderr)
        metrics = {
            **result,
            "lm_eval": harness,
            "vocab_size": model.config.vocab_size,
            "validation_sequences": len(val),
            "step": origin["step"],
            "checkpoint_manifest_sha256": origin["checkpoint_manifest_sha256"],
            "final_train_loss": _final_loss(records),
            "mixture": run_mixture(run_dir, val.manifest),
            "samples": samples,
        }
        write_json_atomic(tmp / af.EVAL_METRICS, metrics)
        plot_training(records, tmp / "loss.png", result["loss"])
        write_text_atomic(tmp / "report.md",
                          _report(run_dir.name, metrics, records, goodput(run_dir)))
        (tmp / af.EVAL_MARKER).write_text(
            json.dumps({"written_by": "evaluate", "run": origin["run"]}) + "\n")
    log_to_trackers(run_dir, metrics)
    return metrics


def log_to_trackers(run_dir: Path, metrics: dict[str, Any]) -> None:
    """The evaluation's figures into the tracker runs training opened (``trackers.json``):
    ``eval/loss``, ``eval/perplexity``, ``eval/bits_per_byte``, ``eval/lm_eval/<task>/<metric>``
    at the evaluated step. Called once the results are written: a tracker that is missing,
    fails or does not answer in time is a warning (``pipeline.observe.trackers``), never a
    failed stage."""
    from pipeline.observe.trackers import Trackers

    config = af.read_run_config_view(run_dir) or {}
    names = list((config.get("train") or {}).get("trackers") or [])
    figures = {k: metrics.get(k) for k in ("loss", "perplexity", "bits_per_byte",
                                           "final_train_loss")}
    figures["lm_eval"] = (metrics.get("lm_eval") or {}).get("results") or {}
    trackers = Trackers.for_evaluation(run_dir, names)
    try:
        trackers.log_eval(figures, metrics["step"])
    finally:
        trackers.close()


def _report(run: str, m: dict[str, Any], records: list[dict[str, Any]],
            gp: dict[str, Any] | None = None) -> str:
    tps = _series(records, "step", "tokens_per_s")[1]
    lines = [
        f"# Run `{run}`",
        "",
        f"- Validation perplexity **{m['perplexity']:.2f}** (loss {m['loss']:.4f} over "
        f"{m['tokens']} tokens; vocabulary {m['vocab_size']})"
        + (f", {m['bits_per_byte']:.3f} bits per byte" if "bits_per_byte" in m else ""),
        f"- Final training loss {m['final_train_loss']:.4f} at step {m['step']}"
        if m["final_train_loss"] is not None
        else f"- Step {m['step']}",
        f"- Median throughput {float(np.median(tps)):.0f} tokens/s" if tps else "",
        "",
        "![training curves](loss.png)",
        "",
    ]
    harness = m.get("lm_eval") or {}
    if "results" in harness:
        lines += ["## lm-eval (EleutherAI harness, local tasks)", "", "| task | metric | value |",
                  "|---|---|---|"]
        for task, r in harness["results"].items():
            lines += [f"| {task} | {k} | {v:.4f} |" for k, v in r.items()]
        lines.append("")
    elif "skipped" in harness:
        lines += [f"lm-eval: {harness['skipped']}", ""]
    if m.get("mixture"):
        lines += ["## Data mixture (share of training tokens)", "", *format_mixture(m["mixture"]),
                  ""]
    if gp is not None:
        # Where the training's wall time went (pipeline.observe.goodput): attempts, saves, lost work.
        lines += ["## Goodput", "", format_goodput(gp), ""]
    lines += [f"## Samples (temperature {SAMPLING['temperature']}, top-k {SAMPLING['top_k']}, "
              f"seed {SAMPLE_SEED})", ""]
    for sample in m["samples"]:
        lines += ["```", sample["text"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.evaluate",
        description="Held-out perplexity of a consolidated HF model, plots and a report.",
    )
    p.add_argument("--model", type=Path, required=True, help="HF model dir (consolidate output)")
    p.add_argument("--data-dir", type=Path, required=True, help="results/data")
    p.add_argument("--run-dir", type=Path, required=True, help="results/runs/<run> (metrics.jsonl)")
    p.add_argument("--out", type=Path, required=True, help="output dir for metrics/plots/report")
    p.add_argument("--lm-eval-tasks", type=Path, default=None,
                   help="a folder of lm-eval task YAMLs (local data) to run besides the built-in "
                        "held-out task; needs the lm-eval package")
    p.add_argument("--lm-eval-task", action="append", default=None, dest="lm_eval_names",
                   help="a task name defined in --lm-eval-tasks (repeatable)")
    args = p.parse_args(argv)
    try:
        m = evaluate(args.model, args.data_dir, args.run_dir, args.out,
                     args.lm_eval_tasks, args.lm_eval_names)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return af.EXIT_USAGE
    except OSError as err:  # e.g. --out on a read-only or full file system
        print(f"error: {err.filename or args.out}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(json.dumps({k: m[k] for k in ("loss", "perplexity", "tokens")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
