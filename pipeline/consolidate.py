"""The consolidate stage: a run's last sharded checkpoint → an HF model directory.

``python -m pipeline.consolidate --run-dir results/runs/NAME --data-dir results/data --out
results/runs/NAME/hf`` reads the checkpoint named in ``train.done`` (verifying its manifest),
gathers the full fp32 weights, and writes ``config.json``, ``generation_config.json``,
safetensors (sharded above ``--max-shard-size``) and the tokenizer files, so that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it offline.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from pipeline.config import load_run_config
from pipeline.errors import PipelineError
from pipeline.io import read_json, sha256_file, write_json_atomic
from pipeline.train import checkpoint as ck
from pipeline.train.model import hf_config_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def load_dcp_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full model tensors from an FSDP2 DCP checkpoint, in one process with no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(ckpt / "dcp"))
    meta = reader.read_metadata()
    state: dict[str, torch.Tensor] = {}
    for key, info in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(info, TensorStorageMetadata):
            state[key] = torch.empty(info.size, dtype=info.properties.dtype)
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {k.removeprefix("model."): v for k, v in state.items()}


def load_deepspeed_model_state(ckpt: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """Full fp32 model tensors from a DeepSpeed checkpoint (ZeRO 0–3)."""
    if zero_stage == 0:
        # Stage 0 has no partitioned optimizer files for zero_to_fp32 to read; the module
        # states file holds the whole model. It is a pickle of DeepSpeed's own objects, so
        # weights_only=True cannot load it; it is our own checkpoint, verified by sha256 above.
        states = torch.load(
            ckpt / "ds" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
        )
        return {k: v.float() for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="ds")


def consolidate(
    run_dir: Path, data_dir: Path, out: Path, *, dtype: str = "float32", max_shard_size: str = "2GB"
) -> Path:
    """Write the HF directory for the run's final checkpoint; returns ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    done_file = run_dir / "train.done"
    if not done_file.is_file():
        raise PipelineError(f"{done_file} is missing: train the run before consolidating it")
    ckpt = run_dir / "checkpoints" / read_json(done_file)["checkpoint"]
    why = ck.verify(ckpt)
    if why is not None:
        raise PipelineError(f"checkpoint {ckpt} does not verify: {why}")
    meta = read_json(ckpt / ck.MANIFEST)
    run = load_run_config(run_dir / "config.json")
    manifest = read_json(data_dir / "manifest.json")
    tok = manifest["tokenizer"]
    if meta["backend"] == "deepspeed":
        state = load_deepspeed_model_state(ckpt, meta["zero_stage"])
    else:
        state = load_dcp_model_state(ckpt)

    if run.model.init_from:
        config = LlamaConfig.from_pretrained(run.model.init_from)
    else:
        config = LlamaConfig(
            **hf_config_dict(
                run.model, vocab_size=tok["vocab_size"], eos_id=tok["eos_id"], bos_id=tok.get("bos_id")
            )
        )
    config.use_cache = True  # training turned it off; inference wants it
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise PipelineError(
            f"checkpoint {ckpt} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    model.to(DTYPES[dtype])
    # Rotary buffers are not in the state dict and were created on the meta device.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        tok_dir = data_dir / tok["path"]
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copy2(tok_dir / name, tmp / name)
        write_json_atomic(
            tmp / "zerosnake.json",
            {"run": run.name, "step": meta["step"], "checkpoint": ckpt.name,
             "checkpoint_manifest_sha256": sha256_file(ckpt / ck.MANIFEST), "dtype": dtype},
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.consolidate",
        description="Sharded training checkpoint → HF model directory (safetensors).",
    )
    p.add_argument("--run-dir", type=Path, required=True, help="results/runs/<run>")
    p.add_argument("--data-dir", type=Path, required=True, help="results/data (tokenizer)")
    p.add_argument("--out", type=Path, required=True, help="output HF directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--max-shard-size", default="2GB", help="split safetensors above this size")
    args = p.parse_args(argv)
    try:
        out = consolidate(
            args.run_dir, args.data_dir, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size
        )
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
