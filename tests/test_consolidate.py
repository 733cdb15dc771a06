"""Consolidation (issue 5): real checkpoints of both engines → HF directory → the trained logits.

Four tiny runs are trained for real with ``torchrun --nproc-per-node 2`` (gloo, CPU): FSDP2
fp32, DeepSpeed ZeRO-1 fp32, ZeRO-3 fp32 with tied embeddings, ZeRO-2 bf16. They start together
(module fixture) so their start-up costs overlap. Every run writes ``probe_logits.safetensors``
(the engine's own logits of the final model); the consolidated directory, loaded with
``AutoModelForCausalLM.from_pretrained`` and eager attention, must reproduce them: bit for bit
in fp32, within one bf16 rounding step in bf16 (observed: bit for bit as well).

The streaming bound is measured on a synthetic DCP checkpoint of a ~270 MB model written
in-process: the consolidate subprocess's peak RSS above that of a tiny model's stays under
2 × the largest tensor + the DCP read group + slack, far below the model's size.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from pipeline.consolidate import (
    GROUP_BYTES,
    INDEX_FILE,
    SINGLE_FILE,
    consolidate,
    parse_size,
    plan_shards,
    write_safetensors,
)
from pipeline.errors import PipelineError
from tests.conftest import PY, subprocess_env

pytestmark = pytest.mark.slow

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "with", "some",
         "big", "red", "ball", "into", "blue", "sky"]

BASE = {
    "data": {
        "sources": [{"path": "corpus.txt", "format": "txt"}],
        "tokenizer": {"vocab_size": 300},
        "seq_len": 32,
        "shards": 1,
    },
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
              "max_position_embeddings": 64, "attn_implementation": "eager"},
    "cluster": {"nodes": 1, "gpus_per_node": 2},
    "train": {"micro_batch_size": 4, "max_steps": 3, "warmup_steps": 1, "checkpoint_every": 3,
              "lr": 1e-2},
    "runs": {
        "fsdp": {},
        "zero1": {"train": {"backend": "deepspeed", "zero_stage": 1}},
        "zero3": {"train": {"backend": "deepspeed", "zero_stage": 3},
                  "model": {"tie_word_embeddings": True}},
        "zero2bf16": {"train": {"backend": "deepspeed", "zero_stage": 2, "precision": "bf16"}},
    },
}


def run_ok(args: list[str], cwd: Path) -> str:
    res = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert res.returncode == 0, f"{args}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tokenized corpus (real tokenizer and tokenize stages) and the rendered runs."""
    work = tmp_path_factory.mktemp("consolidate")
    rng = random.Random(0)
    (work / "corpus.txt").write_text(
        "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(300))
    )
    (work / "config.yaml").write_text(yaml.safe_dump(BASE))
    common = ["--doc-split", "blank-line"]
    run_ok([PY, "-m", "pipeline.tokenize", "tokenizer", "train", "--input", "corpus.txt", "--vocab-size", "300",
            "--out", "data/tokenizer", *common], work)
    run_ok([PY, "-m", "pipeline.tokenize", "shard", "--input", "corpus.txt", "--tokenizer",
            "data/tokenizer", "--seq-len", "32", "--shards", "1", "--shard", "0", "--out", "data",
            "--val-fraction", "0.1", "--no-progress", *common], work)
    run_ok([PY, "-m", "pipeline.tokenize", "gather", "--out", "data", "--shards", "1",
            "--tokenizer", "data/tokenizer"], work)
    for name in BASE["runs"]:
        run_ok([PY, "-m", "pipeline.render", "--config", "config.yaml", "--run", name, "--out",
                f"runs/{name}"], work)
    return work


@pytest.fixture(scope="module")
def trained(work) -> dict[str, Path]:
    """All four runs trained by the real worker under torchrun, started together."""
    procs = {
        name: subprocess.Popen(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "-m", "pipeline.train", "worker", "--run-dir", f"runs/{name}", "--data-dir", "data"],
            cwd=work, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )
        for name in BASE["runs"]
    }
    errors = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            errors[name] = err[-3000:]
    assert not errors, errors
    return {name: work / "runs" / name for name in procs}


def model_logits(hf_dir: Path, input_ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype="auto")
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float(), model


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step at each value of ``x`` (the gap to the next bf16 number)."""
    b = x.to(torch.bfloat16).abs()
    return (torch.nextafter(b, torch.full_like(b, math.inf)) - b).float()


@pytest.mark.parametrize("name", ["fsdp", "zero1"])
def test_fp32_engines_consolidate_to_the_exact_trained_logits(trained, work, name):
    out = consolidate(trained[name], work / "data", work / f"hf-{name}")
    probe = load_file(str(trained[name] / "probe_logits.safetensors"))
    logits, model = model_logits(out, probe["input_ids"])
    assert model.dtype == torch.float32
    assert torch.equal(logits, probe["logits"]), (logits - probe["logits"]).abs().max()
    files = set(os.listdir(out))
    assert {"config.json", "generation_config.json", SINGLE_FILE, "tokenizer.json"} <= files
    assert INDEX_FILE not in files  # one shard below the default 2GB cap
    assert json.loads((out / "zerosnake.json").read_text())["step"] == BASE["train"]["max_steps"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.vocab_size == 300 or len(tok) == 300


def test_zero3_tied_embeddings_sharded_through_the_cli(trained, work):
    out = work / "hf-zero3"
    cap = 4000  # bytes: far below the model (~80 kB), so nearly one tensor per shard
    run_ok([PY, "-m", "pipeline.consolidate", "--run-dir", str(trained["zero3"]), "--data-dir",
            str(work / "data"), "--out", str(out), "--max-shard-size", str(cap)], work)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 5 and not (out / SINGLE_FILE).exists()
    assert set(index["weight_map"].values()) == set(shards)
    # Tied: stored once under the input embedding's name; from_pretrained ties the head back.
    assert "lm_head.weight" not in index["weight_map"]
    assert "model.embed_tokens.weight" in index["weight_map"]
    total = 0
    for shard in shards:
        with safe_open(str(out / shard), "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118 (safe_open is not a dict)
            nbytes = sum(math.prod(s) * 4 for s in sizes)
            assert nbytes <= cap or len(sizes) == 1, (shard, nbytes)
            total += nbytes
    assert total == index["metadata"]["total_size"]
    probe = load_file(str(trained["zero3"] / "probe_logits.safetensors"))
    logits, model = model_logits(out, probe["input_ids"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits, probe["logits"]), (logits - probe["logits"]).abs().max()


def test_zero2_bf16_consolidates_within_bf16_rounding(trained, work):
    probe = load_file(str(trained["zero2bf16"] / "probe_logits.safetensors"))
    bf16 = consolidate(trained["zero2bf16"], work / "data", work / "hf-bf16", dtype="bfloat16")
    logits, model = model_logits(bf16, probe["input_ids"])
    assert model.dtype == torch.bfloat16
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    diff = (logits - probe["logits"]).abs()
    assert (diff <= bf16_ulp(probe["logits"])).all(), diff.max()
    # The fp32 output is the fp32 master copy; rounded to bf16 it is exactly the bf16 output.
    fp32 = consolidate(trained["zero2bf16"], work / "data", work / "hf-bf16-fp32", dtype="float32")
    master = load_file(str(fp32 / SINGLE_FILE))
    rounded = load_file(str(bf16 / SINGLE_FILE))
    assert master.keys() == rounded.keys()
    assert all(master[k].dtype == torch.float32 for k in master)
    assert all(torch.equal(master[k].to(torch.bfloat16), rounded[k]) for k in master)
    # ... and it is not simply the bf16 weights widened: the master copy has more precision.
    assert any(not torch.equal(master[k], rounded[k].float()) for k in master)


def test_a_corrupted_checkpoint_is_refused_and_the_old_output_kept(trained, work):
    run = work / "runs" / "broken"
    shutil.copytree(trained["fsdp"], run)
    out = work / "hf-broken"
    out.mkdir()
    (out / "keep.txt").write_text("previous output")
    (out / "zerosnake.json").write_text("{}")  # a previous output of this command carries it
    ckpt = run / "checkpoints" / json.loads((run / "train.done").read_text())["checkpoint"]
    shard = next((ckpt / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match="does not verify"):
        consolidate(run, work / "data", out)
    assert (out / "keep.txt").read_text() == "previous output"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".hf-broken.")]


def test_safetensors_writer_shards_and_reads_back(tmp_path):
    assert parse_size("2GB") == 2 * 10**9 and parse_size("500MiB") == 500 * 2**20
    assert parse_size("1000") == 1000
    with pytest.raises(PipelineError):
        parse_size("2 parsecs")
    assert plan_shards({"a": 6, "b": 6, "c": 20, "d": 1}, 10) == [["a"], ["b"], ["c"], ["d"]]
    assert plan_shards({"a": 4, "b": 4, "c": 4}, 10) == [["a", "b"], ["c"]]
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "s": torch.tensor(3.5),
        "i": torch.arange(10, dtype=torch.int64),
        "m": torch.tensor([True, False, True]),
        "e": torch.empty(0, 4),
    }
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    dtypes = {k: v.dtype for k, v in tensors.items()}
    files = write_safetensors(tmp_path, iter(tensors.items()), shapes, dtypes, max_shard_size=64)
    assert len(files) > 1
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    back: dict[str, torch.Tensor] = {}
    for f in files:
        back.update(load_file(str(tmp_path / f)))
    assert set(index["weight_map"]) == set(tensors) == set(back)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


# ---------------------------------------------------------------------------------------------
# The streaming bound
# ---------------------------------------------------------------------------------------------


def synthetic_run(root: Path, data_dir: Path, *, hidden: int, inter: int, layers: int) -> tuple[Path, int, int]:
    """A run dir whose final checkpoint is a DCP save of a random Llama (no training).

    Written the way the FSDP engine writes it (``{"model": msd}`` through ``dcp.save``, then the
    real ``checkpoint.finalize`` manifest). Returns the run dir, the model's bytes and the
    largest tensor's bytes.
    """
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.checkpoint import format as ck
    from pipeline.config.files import load_run_config
    from pipeline.io import read_json, sha256_file, write_json_atomic

    cfg = dict(BASE, runs={"big": {}})
    cfg["model"] = dict(BASE["model"], hidden_size=hidden, intermediate_size=inter,
                        num_layers=layers, num_heads=8)
    run = root / "runs" / "big"
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.txt").write_text("x")
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    run_ok([PY, "-m", "pipeline.render", "--config", "config.yaml", "--run", "big", "--out",
            "runs/big"], root)
    tok = read_json(data_dir / "manifest.json")["tokenizer"]
    config = LlamaConfig(vocab_size=tok["vocab_size"], hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=8,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    state = model.state_dict()
    sizes = [v.numel() * v.element_size() for v in state.values()]
    dcp.save({"model": state}, checkpoint_id=str(ck.tmp_dir(run / "checkpoints", 1) / "dcp"), no_dist=True)
    del model, state
    ck.finalize(run / "checkpoints", 1, {"backend": "fsdp", "world_size": 1,
                                         "config_hash": ck.config_hash(load_run_config(run / "config.json")),
                                         "data_manifest_sha256": sha256_file(data_dir / "manifest.json")}, 1)
    write_json_atomic(run / "train.done", {"step": 1, "checkpoint": "step-000001"})
    return run, sum(sizes), max(sizes)


# The child reports its own high-water mark (VmHWM) at exit: getrusage's ru_maxrss survives
# execve, so for a child forked from this (large) pytest process it would report our size.
PEAK_WRAPPER = """
import atexit, runpy, sys
def report():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            print("VmHWM", int(line.split()[1]) * 1024, file=sys.stderr)
atexit.register(report)
sys.argv[0] = "pipeline.consolidate"
runpy.run_module("pipeline.consolidate", run_name="__main__")
"""


def peak_rss_of_consolidate(run: Path, data_dir: Path, out: Path) -> int:
    """Peak RSS (bytes) of ``python -m pipeline.consolidate`` as its own process."""
    res = subprocess.run(
        [PY, "-c", PEAK_WRAPPER, "--run-dir", str(run), "--data-dir", str(data_dir),
         "--out", str(out)], env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return int(res.stderr.rsplit("VmHWM", 1)[1].split()[0])


def test_peak_memory_is_bounded_by_the_largest_tensor_not_the_model(work, tmp_path):
    data = work / "data"
    tiny, _, _ = synthetic_run(tmp_path / "tiny", data, hidden=64, inter=128, layers=1)
    big, model_bytes, largest = synthetic_run(tmp_path / "big", data, hidden=512, inter=2048, layers=16)
    assert model_bytes > 250e6 and largest <= 4.2e6
    base = peak_rss_of_consolidate(tiny, data, tmp_path / "hf-tiny")
    peak = peak_rss_of_consolidate(big, data, tmp_path / "hf-big")
    grown = peak - base
    bound = 2 * largest + GROUP_BYTES + 48 * 2**20
    print(f"model {model_bytes / 1e6:.0f} MB, largest tensor {largest / 1e6:.1f} MB, "
          f"consolidate peak RSS {peak / 1e6:.0f} MB (tiny model: {base / 1e6:.0f} MB), "
          f"grown {grown / 1e6:.0f} MB, bound {bound / 1e6:.0f} MB")
    assert grown <= bound, (grown, bound)
    assert grown < model_bytes / 3
    # And the output is the checkpoint's weights.
    from safetensors.torch import load_file as load

    out = load(str(tmp_path / "hf-big" / SINGLE_FILE))
    assert sum(v.numel() * 4 for v in out.values()) == model_bytes
