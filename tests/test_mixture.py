"""Named sources, mixed per run (issue 13): per-source tokenization, the weighted loader.

Two real sources read differently (Python files as txt; a gzipped JSONL of paragraphs) are
tokenized into their own shards by the real tokenize stage; the loader draws from them by
weight, exactly, resumably and whatever the data-parallel layout.
"""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from pipeline.data.loader import BatchLoader, PackedDataset
from pipeline.data.mixture import (
    mixture_plan_line,
    mixture_shares,
    source_sizes,
)
from pipeline.errors import PipelineError
from pipeline.text.sources import SourceSpec
from pipeline.text.tokenizer import train_tokenizer
from pipeline.tokenize import gather, shard_path, tokenize_shard

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SEQ = 32
SHARDS = 2


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mix")
    code = [str(p) for p in sorted(STDLIB.glob("json/*.py"))]
    paras = [
        b.strip()
        for p in sorted(STDLIB.glob("email/[a-f]*.py"))
        for b in p.read_text("utf-8").split("\n\n")
        if b.strip()
    ]
    budget = sum(Path(p).stat().st_size for p in code) // 5  # prose: the small source
    paras = [t for k, t in enumerate(paras) if sum(map(len, paras[:k])) < budget]
    prose = root / "prose.jsonl.gz"
    with gzip.open(prose, "wt", encoding="utf-8") as f:
        for t in paras:
            f.write(json.dumps({"body": t}) + "\n")
    specs = {
        "code": SourceSpec.from_args(code, fmt="txt"),
        "prose": SourceSpec.from_args([str(prose)], text_field="body"),
    }
    texts = [Path(p).read_text("utf-8") for p in code] + paras
    tok = train_tokenizer(texts, 400, root / "data" / "tokenizer")
    out = root / "data"
    for name, spec in specs.items():
        for i in range(SHARDS):
            tokenize_shard(spec, tok, seq_len=SEQ, shards=SHARDS, shard=i, out=out,
                           val_fraction=0.1, progress=False, source=name)
    gather(out, SHARDS, tok, ["code", "prose"])
    return out


def _source_of(ds: PackedDataset, idx: list[int]) -> list[str]:
    ends = np.array([hi for _, _, hi in ds.sources])
    return [ds.sources[j][0] for j in np.searchsorted(ends, idx, side="right")]


def test_each_source_has_its_own_shards_and_counts(data_dir: Path) -> None:
    m = json.loads((data_dir / "manifest.json").read_text())
    assert list(m["by_source"]) == ["code", "prose"]
    for split in ("train", "validation"):
        entries = m["splits"][split]["shards"]
        assert [e["source"] for e in entries] == ["code"] * SHARDS + ["prose"] * SHARDS
        for name in ("code", "prose"):
            mine = [e for e in entries if e["source"] == name]
            assert sum(e["sequences"] for e in mine) == m["by_source"][name][split]["sequences"]
    assert m["by_source"]["prose"]["options"]["text_field"] == "body"
    assert shard_path(data_dir, "train", 1, "prose").is_file()
    ds = PackedDataset(data_dir)
    (c, c0, c1), (p, p0, p1) = ds.sources
    assert (c, p) == ("code", "prose") and c0 == 0 and c1 == p0 and p1 == len(ds)
    assert m["by_source"]["code"]["train"]["sequences"] == c1 > 3 * (p1 - p0) > 0


def test_consumption_within_2_percent_of_the_weights_over_1000_steps(data_dir: Path) -> None:
    ds = PackedDataset(data_dir)
    weights = {"code": 1.0, "prose": 3.0}  # prose is the smaller source: it repeats
    ld = BatchLoader(ds, micro_batch_size=4, dp_rank=0, dp_size=1, seed=3, mixture=weights)
    idx = [i for _ in range(1000) for i in ld.next_batch()["indices"]]
    names = _source_of(ds, idx)
    for name, w in weights.items():
        share = names.count(name) / len(names)
        assert abs(share - w / 4) <= 0.02 * w / 4, (name, share)
    # The counters say what the rows say; every epoch of a source is a permutation of it.
    assert ld.drawn() == {"code": names.count("code"), "prose": names.count("prose")}
    assert ld.tokens_by_source() == {n: c * SEQ for n, c in ld.drawn().items()}
    _, lo, hi = ds.sources[1]
    prose = [i for i in idx if lo <= i < hi]
    n = hi - lo
    assert len(prose) > 2 * n
    assert sorted(prose[:n]) == list(range(lo, hi)) and prose[:n] != prose[n : 2 * n]
    shares = mixture_shares(source_sizes(ds.manifest), weights, ld.tokens_by_source())
    assert shares["prose"]["target"] == 0.75
    assert abs(shares["prose"]["consumed"] - 0.75) < 0.001


def test_kill_and_resume_and_a_dp_change_give_the_same_order(data_dir: Path) -> None:
    mix = {"code": 2.0, "prose": 1.0}

    def loaders(dp: int, state: dict | None = None) -> list[BatchLoader]:
        out = []
        for r in range(dp):
            ld = BatchLoader(PackedDataset(data_dir), micro_batch_size=4 // dp, dp_rank=r,
                             dp_size=dp, seed=11, mixture=mix)
            if state is not None:
                ld.load_state_dict(state)
            out.append(ld)
        return out

    def run(lds: list[BatchLoader], steps: int) -> list[int]:
        return [i for _ in range(steps) for ld in lds for i in ld.next_batch()["indices"]]

    ref = run(loaders(1), 1000)
    first = loaders(2)  # dp 2, micro 2: the same global batch of 4
    got = run(first, 377)
    state = json.loads(json.dumps(first[0].state_dict()))  # as stored in trainer.json
    assert state == first[1].state_dict()
    got += run(loaders(1, state), 623)  # "killed", resumed in a fresh process at dp 1
    assert got == ref
    back = loaders(2, json.loads(json.dumps(loaders(1, state)[0].state_dict())))
    assert run(back, 5) == ref[377 * 4 : 382 * 4]
    # The state names the mixture: resuming under another one is refused, naming the key.
    other = BatchLoader(PackedDataset(data_dir), micro_batch_size=4, dp_rank=0, dp_size=1,
                        seed=11, mixture={"code": 1.0, "prose": 1.0})
    with pytest.raises(PipelineError, match=r"train\.mixture"):
        other.load_state_dict(state)


def test_stop_ends_before_any_source_repeats(data_dir: Path) -> None:
    ds = PackedDataset(data_dir)
    mix = {"code": 1.0, "prose": 1.0}
    ld = BatchLoader(ds, micro_batch_size=2, dp_rank=0, dp_size=2, seed=5, mixture=mix,
                     on_exhausted="stop")
    last = ld.last_step(10_000, grad_accum=3)
    per_step = 2 * 2 * 3
    stream = ld.stream(0, (last + 1) * per_step).tolist()
    kept, next_step = stream[: last * per_step], stream[last * per_step :]
    assert len(set(kept)) == len(kept)  # nothing repeated up to the last step ...
    assert len(set(kept + next_step)) < len(kept + next_step)  # ... one more step would
    assert BatchLoader(ds, micro_batch_size=2, dp_rank=0, dp_size=2, seed=5, mixture=mix
                       ).last_step(10_000, 3) == 10_000  # repeat: no bound
    plain = BatchLoader(ds, micro_batch_size=4, dp_rank=0, dp_size=1, seed=5, on_exhausted="stop")
    assert plain.last_step(10_000, 1) == len(ds) // 4


def test_default_is_in_proportion_to_tokens(data_dir: Path) -> None:
    ds = PackedDataset(data_dir)
    ld = BatchLoader(ds, micro_batch_size=4, dp_rank=0, dp_size=1, seed=1)
    steps = len(ds) // 4 + 3  # one epoch and a bit: every sequence once, then more
    idx = [i for _ in range(steps) for i in ld.next_batch()["indices"]]
    names = _source_of(ds, idx)
    assert ld.drawn() == {"code": names.count("code"), "prose": names.count("prose")}
    shares = mixture_shares(source_sizes(ds.manifest), None, ld.tokens_by_source())
    sizes = {n: hi - lo for n, lo, hi in ds.sources}
    assert shares["code"]["target"] == pytest.approx(sizes["code"] / len(ds))
    consumed = shares["code"]["consumed"]
    assert consumed == pytest.approx(names.count("code") / len(names))


def test_a_mixture_naming_an_unknown_or_empty_source_is_refused(data_dir: Path) -> None:
    ds = PackedDataset(data_dir)
    with pytest.raises(PipelineError, match=r"train.mixture names \['web'\].*code"):
        BatchLoader(ds, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0, mixture={"web": 1.0})


def test_plan_line_says_what_happens_when_a_source_runs_out(data_dir: Path) -> None:
    from pipeline.config.schema import TrainConfig

    ds = PackedDataset(data_dir)
    mix = {"code": 1.0, "prose": 1.0}
    stop = TrainConfig(mixture=mix, on_source_exhausted="stop", max_steps=100_000, seed=5)
    line = mixture_plan_line(ds.manifest, stop, 12)
    last = BatchLoader(ds, micro_batch_size=2, dp_rank=0, dp_size=2, seed=5, mixture=mix,
                       on_exhausted="stop").last_step(100_000, 3)
    assert line.endswith(f"it stops at step {last} of 100000") and "code 50%" in line
    repeat = mixture_plan_line(ds.manifest, TrainConfig(mixture=mix, max_steps=1000), 12)
    assert "starts over, reshuffled" in repeat and "prose" in repeat


@pytest.mark.slow
def test_two_runs_with_different_mixtures_share_one_tokenization(tmp_path: Path) -> None:
    """Real Snakemake: tokenize (a job per shard of each source) and render run for real (no
    training); then changing one run's mixture re-renders that run only, and nothing upstream."""
    import yaml

    from tests.test_e2e import planned_jobs, snakemake

    prose = tmp_path / "prose.jsonl"
    prose.write_text("".join(json.dumps({"body": f"paragraph {i} " * 40}) + "\n" for i in range(60)))
    cfg = {
        "data": {"sources": [{"name": "code", "path": "<stdlib>/json/*.py", "format": "txt"},
                             {"name": "prose", "path": str(prose), "text_field": "body"}],
                 "tokenizer": {"vocab_size": 300}, "seq_len": 32, "shards": 2},
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                  "max_position_embeddings": 32},
        "cluster": {"nodes": 1, "gpus_per_node": 1},
        "train": {"micro_batch_size": 2, "max_steps": 2, "warmup_steps": 1},
        "runs": {"a": {"train": {"mixture": {"code": 1, "prose": 1}}}, "b": {}},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    # (a flag before the targets: --configfile takes every word after it)
    res = snakemake(tmp_path, "--rerun-incomplete", "results/runs/a/plan.md",
                    "results/runs/b/plan.md")
    assert res.returncode == 0, res.stderr[-3000:]
    logs = sorted(p.name for p in (tmp_path / "results" / "logs" / "tokenize").iterdir())
    assert logs == [f"{s}.shard-0000{i}.log" for s in ("code", "prose") for i in range(2)]
    manifest = json.loads((tmp_path / "results" / "data" / "manifest.json").read_text())
    assert list(manifest["by_source"]) == ["code", "prose"]
    before = planned_jobs(tmp_path)  # training and after, never run here
    assert not {"tokenizer", "tokenize_shard", "gather", "render"} & set(before)
    cfg["runs"]["b"] = {"train": {"mixture": {"code": 3, "prose": 1}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    # The new mixture re-renders run b only (so b retrains); nothing upstream is planned.
    assert planned_jobs(tmp_path) == {**before, "render": 1}
    res = snakemake(tmp_path, "--rerun-incomplete", "results/runs/b/config.json")
    assert res.returncode == 0, res.stderr[-3000:]
    rendered = json.loads((tmp_path / "results" / "runs" / "b" / "config.json").read_text())
    assert rendered["train"]["mixture"] == {"code": 3, "prose": 1}
    assert planned_jobs(tmp_path) == before
