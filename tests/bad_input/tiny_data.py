"""Tiny real artifacts for the bad-input cases, built in a temporary folder in seconds: a
corpus of a few hundred lines, a byte-level BPE tokenizer trained on it, a tokenized data
directory (train and validation shards, manifest.json), a run directory and, for evaluate, a
tiny consolidated HF model. No shared corpora are needed."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

SEQ_LEN = 16
VOCAB = 300
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "data",
         "flows", "from", "shard", "to", "model", "and", "loss", "falls", "step", "by"]


def write_corpus(root: Path, files: int = 6, lines: int = 50) -> Path:
    """``root/corpus/doc-N.txt``: ``files`` files of ``lines`` lines of words."""
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines))
        (corpus / f"doc-{i}.txt").write_text(text + "\n")
    return corpus


def build_tokenizer(out: Path, corpus: Path) -> Path:
    """A byte-level BPE of ``VOCAB`` ids trained on ``corpus`` (in this process, ~1 s)."""
    from pipeline.text.tokenizer import train_tokenizer

    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    return train_tokenizer(texts, VOCAB, out)


def build_data(root: Path) -> Path:
    """``root/data``: tokenizer/, shards/ and manifest.json of a small corpus under ``root``."""
    from pipeline.tokenize import SourceSpec, gather, tokenize_shard

    corpus = write_corpus(root)
    data = root / "data"
    tok = build_tokenizer(data / "tokenizer", corpus)
    spec = SourceSpec.from_args([str(corpus)])
    tokenize_shard(spec, tok, seq_len=SEQ_LEN, shards=1, shard=0, out=data, val_fraction=0.3,
                   progress=False)
    gather(data, 1, tok)
    return data


def build_run(root: Path, name: str = "r") -> Path:
    """``root/runs/<name>``: what a run directory holds after some training (config.json,
    metrics.jsonl, events.jsonl, a checkpoint folder), enough for status and evaluate."""
    run = root / "runs" / name
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / "manifest.json").write_text('{"step": 2}\n')
    (run / "config.json").write_text(json.dumps({"name": name, "train": {"max_steps": 4}}) + "\n")
    (run / "job.json").write_text(json.dumps({"job_id": "123", "launcher": "local"}) + "\n")
    metrics = [{"step": s, "loss": 6.0 - s, "lr": 1e-3, "tokens_seen": 16 * s,
                "tokens_per_s": 100.0 + s} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "events.jsonl").write_text(json.dumps({"event": "start", "time": 1.0}) + "\n")
    return run


def build_hf(out: Path, tokenizer: Path) -> Path:
    """A tiny consolidated model folder (what consolidate writes): a random 1-layer Llama of
    ``VOCAB`` ids, the tokenizer files and zerosnake.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).is_file():
            shutil.copyfile(tokenizer / name, out / name)
    (out / "zerosnake.json").write_text(json.dumps({
        "run": "r", "step": 2, "checkpoint": "step-000002",
        "checkpoint_manifest_sha256": "0" * 64, "dtype": "float32"}) + "\n")
    return out
