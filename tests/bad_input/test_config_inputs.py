"""Bad input, class *config*: a hostile or mistaken config file is refused at the start, by
``python -m pipeline.config check`` and by Snakemake alike, naming the key (and, for a YAML
mistake, the line), with no traceback and nothing written.

Most cases run ``config check`` (fast); the last ones run real Snakemake on the same file and
assert that both refuse it with the same words, and that both see the same runs.

Cases: 53 files through ``config check`` (floats 13; sizes and counts 16, 10 of them layout
numbers that would hang the planner; ``train.lr`` past its promised limit 2; missing paths 5;
run names 6; YAML itself 10; the pre-flight 1); a value past each limit the README promises
(7, and one check that each is the schema's); a JSON duplicate key; 6 of the files through
Snakemake too; 2 merges with the workflow's default config.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.bad_input.conftest import REPO, assert_refused, run, snapshot

DEFAULT = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
DEFAULT_TEXT = (REPO / "config" / "config.yaml").read_text()
#: The default's own ``train.lr`` line, whatever its value (the cases below rewrite it).
LR_LINE = next(line for line in DEFAULT_TEXT.splitlines() if line.startswith("  lr: "))


def mutated(change: Callable[[dict], object]) -> str:
    """The default config (complete: these cases run where no config/config.yaml is merged in)
    with one change, as YAML text."""
    cfg = copy.deepcopy(DEFAULT)
    change(cfg)
    return yaml.safe_dump(cfg, sort_keys=False)


def set_(dotted: str, value: object) -> str:
    def change(cfg: dict) -> None:
        *path, last = dotted.split(".")
        node = cfg
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return mutated(change)


def runs(table: dict) -> str:
    return mutated(lambda c: c.update(runs=table))


def bad_head_dim(c: dict) -> None:
    c["model"].update(hidden_size=36, num_heads=4)  # 9 dims per head: RoPE needs pairs


# A billion laughs: nine levels of ten aliases each stand for 10⁹ strings.
ALIAS_BOMB = 'a: &a ["x","x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"{n}: &{n} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
    for p, n in zip("abcdefgh", "bcdefghi", strict=True)) + DEFAULT_TEXT

# (id, file text, needles): the text is written to bad.yaml (bad.json for JSON) and checked.
CASES: list[tuple[str, str | bytes, tuple[str, ...]]] = [
    # Floats: infinities and NaN, and values out of their range.
    ("lr-inf", DEFAULT_TEXT.replace(LR_LINE, "  lr: .inf"), ("train.lr", "finite")),
    ("lr-nan", DEFAULT_TEXT.replace(LR_LINE, "  lr: .nan"), ("train.lr", "finite")),
    ("lr-negative", set_("train.lr", -1e-3), ("train.lr",)),
    ("beta-one", set_("train.betas", [0.9, 1.0]), ("train.betas.1", "less than 1")),
    ("beta-negative", set_("train.betas", [-0.1, 0.95]), ("train.betas.0",)),
    ("eps-zero", set_("train.eps", 0.0), ("train.eps", "greater than 0")),
    ("eps-negative", set_("train.eps", -1e-8), ("train.eps",)),
    ("weight-decay-inf", set_("train.weight_decay", float("inf")), ("train.weight_decay",)),
    ("rope-theta-nan", set_("model.rope_theta", float("nan")), ("model.rope_theta",)),
    ("gpu-mem-absurd", set_("cluster.gpu_mem_gb", 1e12), ("cluster.gpu_mem_gb",)),
    ("lr-boolean", DEFAULT_TEXT.replace(LR_LINE, "  lr: yes"), ("train.lr", "not a boolean")),
    ("run-override-lr-inf", runs({"fsdp": {"train": {"lr": float("inf")}}}),
     ("runs.fsdp.train.lr", "finite")),
    ("deepspeed-key-nan",
     mutated(lambda c: c["runs"]["deepspeed"]["train"].update(deepspeed={"gradient_clipping":
                                                                         float("nan")})),
     ("runs.deepspeed.train.deepspeed", "finite")),
    # Integers that would hang the planner or exhaust memory.
    ("nodes-1e9", DEFAULT_TEXT.replace("nodes: 1", "nodes: 1.0e+9"), ("cluster.nodes",)),
    ("gpus-absurd", set_("cluster.gpus_per_node", 10**6), ("cluster.gpus_per_node",)),
    ("seq-len-absurd", set_("data.seq_len", 10**9), ("data.seq_len",)),
    ("max-steps-absurd", set_("train.max_steps", 10**15), ("train.max_steps",)),
    ("seed-negative", set_("train.seed", -1), ("train.seed",)),
    ("head-dim-odd", mutated(bad_head_dim), ("model.hidden_size / model.num_heads",)),
    # Every layout number is bounded in the typed parse, before the planner sizes anything
    # (it would build a table per TP rank and pipeline stage).
    ("tp-1e9", set_("train.tp", 10**9), ("train.tp", "less than or equal to 1024")),
    ("pp-1e9", set_("train.pp", 10**9), ("train.pp", "less than or equal to 4096")),
    ("tp-1e9-in-a-run", runs({"fsdp": {"train": {"tp": 10**9}}}), ("runs.fsdp.train.tp",)),
    ("pp-1e9-in-a-run", runs({"fsdp": {"train": {"pp": 10**9}}}), ("runs.fsdp.train.pp",)),
    ("micro-batch-absurd", set_("train.micro_batch_size", 10**9), ("train.micro_batch_size",)),
    ("grad-accum-absurd", set_("train.grad_accum", 10**9), ("train.grad_accum",)),
    ("global-batch-absurd", set_("train.global_batch_size", 10**12),
     ("train.global_batch_size",)),
    ("num-layers-absurd", set_("model.num_layers", 10**9), ("model.num_layers",)),
    ("loss-scale-absurd", set_("train.loss_scale_init", 1e300), ("train.loss_scale_init",)),
    ("too-many-sources", set_("data.sources", [{"path": "<stdlib>/a*.py"}] * 1025),
     ("data.sources", "at most 1024")),
    # The README's promised limit: train.lr <= 1 (1e3 for 1e-3 is a typo, not a run).
    ("lr-5", set_("train.lr", 5.0), ("train.lr", "less than or equal to 1")),
    ("lr-1e3-in-a-run", runs({"fsdp": {"train": {"lr": 1e3}}}), ("runs.fsdp.train.lr",)),
    # Paths the run needs that are not there.
    ("init-from-missing", runs({"fsdp": {"model": {"init_from": "no/such/model"}}}),
     ("runs.fsdp.model.init_from", "does not exist")),
    ("init-from-shared-missing", set_("model.init_from", "no/such/model"),
     ("model.init_from", "does not exist")),
    ("tokenizer-path-missing", set_("data.tokenizer.path", "no/such/tokenizer"),
     ("data.tokenizer.path", "does not exist")),
    ("source-empty-path", set_("data.sources", [{"path": ""}]), ("data.sources.0.path",)),
    ("source-matches-nothing", set_("data.sources", [{"path": "corpus/*.txt"}]),
     ("data.sources.0.path", "matches no file")),
    # Run names: they become a directory, a Slurm job name and a Snakemake wildcard.
    ("run-name-newline", runs({"fsdp\n": {}}), ("runs", "run name 'fsdp\\n'")),
    ("run-name-slash", runs({"../escape": {}}), ("runs", "run name '../escape'")),
    ("run-name-shell", runs({"a;rm -rf ~": {}}), ("runs", "run name 'a;rm -rf ~'")),
    ("run-name-space", runs({"my run": {}}), ("runs", "run name 'my run'")),
    ("run-names-case-collide", runs({"Big": {}, "big": {}}), ("runs", "differ only in case")),
    ("runs-empty", runs({}), ("runs",)),
    # YAML itself: duplicate keys drop a block silently in every YAML loader; bombs; not text.
    ("duplicate-top-level-block", DEFAULT_TEXT + "\ndata:\n  seq_len: 64\n",
     ("duplicate key data", "line", "first at line")),
    ("duplicate-nested-key", DEFAULT_TEXT.replace(LR_LINE, LR_LINE + "\n  lr: 1.0"),
     ("duplicate key train.lr", "line")),
    ("duplicate-run", DEFAULT_TEXT + "  fsdp:\n    train: {lr: 1.0}\n",
     ("duplicate key runs.fsdp", "line")),
    ("alias-bomb", ALIAS_BOMB, ("expands to more than",)),
    ("nested-too-deep", DEFAULT_TEXT.replace("train:\n", "train:\n  deepspeed: " + "[" * 100
                                             + "]" * 100 + "\n", 1), ("nested more than",)),
    ("json-recursion", '{"a": ' * 100_000 + "1" + "}" * 100_000, ("nested too deeply",)),
    ("too-many-runs", runs({f"r{i}": {} for i in range(10_001)}), ("runs", "at most 10000")),
    ("top-level-list", "- data\n- model\n", ("top level must be a mapping",)),
    ("not-utf8", DEFAULT_TEXT.encode() + b"# \xff\xfe\n", ("not UTF-8",)),
    ("not-yaml", DEFAULT_TEXT + "train: [unclosed\n", ("not valid YAML",)),
    # Past the typed parse: the pre-flight (planner + installed DeepSpeed) of every run.
    ("deepspeed-unknown-key",
     mutated(lambda c: c["runs"]["deepspeed"]["train"].update(deepspeed={"bogus_option": 1})),
     ("runs.deepspeed", "train.deepspeed.bogus_option")),
]


@pytest.mark.parametrize(("text", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_config_check_refuses(tmp_path: Path, text: str | bytes, needles: tuple[str, ...]):
    cfg = tmp_path / "bad.yaml"
    if isinstance(text, bytes):
        cfg.write_bytes(text)
    else:
        cfg.write_text(text)
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.config", "check", cfg.name], cwd=tmp_path, timeout=60)
    assert_refused(res, *needles, before=before, roots=[tmp_path])


#: The limits the README promises ("values beyond sane maxima (`cluster.nodes` ≤ 100000, ...").
README_LIMITS = re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)` ≤\s+([0-9]+)",
                           (REPO / "README.md").read_text())


def _schema_maximum(dotted: str) -> float:
    schema = json.loads((REPO / "config" / "schema.json").read_text())
    node = schema
    for key in dotted.split("."):
        node = node["properties"][key]
        if "$ref" in node:
            node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node["maximum"]


def test_the_readmes_limits_are_the_schemas():
    assert len(README_LIMITS) >= 7, README_LIMITS
    for key, limit in README_LIMITS:
        assert _schema_maximum(key) == float(limit), key


@pytest.mark.parametrize(("key", "limit"), README_LIMITS, ids=[k for k, _ in README_LIMITS])
def test_a_value_past_a_readme_limit_stops_the_start(tmp_path: Path, key: str, limit: str):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(set_(key, 2 * int(limit) if key != "train.lr" else 5.0))
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.config", "check", cfg.name], cwd=tmp_path, timeout=60)
    assert_refused(res, key, f"less than or equal to {limit}", before=before, roots=[tmp_path])


def test_json_duplicate_key_is_refused(tmp_path: Path):
    # Snakemake reads a --configfile as JSON first; a JSON object keeps the last of two keys.
    text = json.dumps(DEFAULT, indent=1)
    cfg = tmp_path / "bad.json"
    cfg.write_text(text.replace("{", '{"seed": 1, "seed": 2, ', 1))
    before = snapshot(tmp_path)
    res = run(["-m", "pipeline.config", "check", cfg.name], cwd=tmp_path, timeout=60)
    assert_refused(res, "duplicate key seed", before=before, roots=[tmp_path])


# -- the same files through real Snakemake ---------------------------------------------------------
def snakemake(cwd: Path, *args: str):
    return run(["-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "1", *args],
               cwd=cwd, timeout=180)


SNAKEMAKE_CASES = ["lr-inf", "run-name-newline", "duplicate-nested-key", "init-from-missing",
                   "nodes-1e9", "alias-bomb"]


@pytest.mark.parametrize("case", SNAKEMAKE_CASES)
def test_snakemake_and_config_check_agree(tmp_path: Path, case: str):
    _, text, needles = next(c for c in CASES if c[0] == case)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    before = snapshot(cfg)
    # A real run, not a dry run: had the start let it through, jobs would have run.
    res = snakemake(tmp_path, "--configfile", str(cfg))
    assert_refused(res, *needles, before=before, roots=[cfg])
    assert not (tmp_path / "results").exists(), "a job ran before the config was refused"
    check = run(["-m", "pipeline.config", "check", str(cfg)], cwd=tmp_path, timeout=60)
    assert_refused(check, *needles, before=before, roots=[cfg])


def test_duplicate_key_in_the_default_config_is_refused_by_both(tmp_path: Path):
    # The workflow's own config/config.yaml (read by the Snakefile's configfile:) is checked too.
    (tmp_path / "config").mkdir()
    default = tmp_path / "config" / "config.yaml"
    default.write_text(DEFAULT_TEXT + "\ncluster:\n  nodes: 2\n")
    user = tmp_path / "user.yaml"
    user.write_text("train:\n  max_steps: 20\n")
    before = snapshot(default, user)
    res = snakemake(tmp_path, "--configfile", str(user), "-n")
    assert_refused(res, "duplicate key cluster", "config/config.yaml", before=before,
                   roots=[default, user])
    check = run(["-m", "pipeline.config", "check", user.name], cwd=tmp_path, timeout=60)
    assert_refused(check, "duplicate key cluster", "config/config.yaml", before=before,
                   roots=[default, user])


def test_a_user_configs_runs_replace_the_default_runs_in_both(tmp_path: Path):
    # Run where the workflow's default config is merged in (config/config.yaml in the working
    # directory): the user's file names only what it changes, and its runs: are the runs.
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(DEFAULT_TEXT)
    user = tmp_path / "user.yaml"
    user.write_text("train:\n  max_steps: 40\nruns:\n  solo:\n    train: {lr: 1.0e-3}\n")
    res = snakemake(tmp_path, "--configfile", str(user), "-n")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "results/runs/solo/" in out
    assert "results/runs/fsdp/" not in out and "results/runs/deepspeed/" not in out
    check = run(["-m", "pipeline.config", "check", user.name], cwd=tmp_path, timeout=60)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "runs: solo;" in check.stderr
    runs_seen = [json.loads(doc) for doc in check.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert [(r["name"], r["train"]["max_steps"], r["train"]["lr"]) for r in runs_seen] == [
        ("solo", 40, 1e-3)]
    # Sections other than runs: still merge with the default (the user's file has no data:).
    assert runs_seen[0]["data"]["seq_len"] == DEFAULT["data"]["seq_len"]
