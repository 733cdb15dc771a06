"""Build the causal LM a run trains: from a config (no hub download) or a local HF directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.config import ModelConfig
from pipeline.errors import PipelineError


def hf_config_dict(model: ModelConfig, *, vocab_size: int, eos_id: int, bos_id: int | None) -> dict:
    """The ``LlamaConfig`` keyword arguments for a from-scratch model."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads or model.num_heads,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings,
        "rope_theta": model.rope_theta,
        "eos_token_id": eos_id,
        "bos_token_id": bos_id if bos_id is not None else eos_id,
        "pad_token_id": eos_id,
        "use_cache": False,
    }


def _init_dir(model: ModelConfig) -> Path:
    path = Path(str(model.init_from))
    if not (path / "config.json").is_file():
        raise PipelineError(
            f"model.init_from: {path} is not an HF model directory (no config.json)"
        )
    return path


def hf_model_config(
    model: ModelConfig, *, vocab_size: int, eos_id: int, bos_id: int | None
) -> Any:
    """The HF config of the model a run trains: the ``init_from`` directory's own, or a
    ``LlamaConfig`` from the run's model settings. The trainer builds its model from it and
    consolidate writes it, so both always agree."""
    from transformers import AutoConfig, LlamaConfig

    if model.init_from:
        return AutoConfig.from_pretrained(_init_dir(model))
    return LlamaConfig(**hf_config_dict(model, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id))


def build_model(
    model: ModelConfig, *, vocab_size: int, eos_id: int, bos_id: int | None, seed: int
) -> Any:
    """A fp32 causal LM with identical weights on every rank (same seed, or the ``init_from``
    directory's weights)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if model.init_from:
        m = AutoModelForCausalLM.from_pretrained(
            _init_dir(model), dtype=torch.float32, attn_implementation=model.attn_implementation
        )
        if m.config.vocab_size < vocab_size:
            raise PipelineError(
                f"model.init_from: the model's vocabulary ({m.config.vocab_size}) is smaller "
                f"than the tokenizer's ({vocab_size}); use the model's own tokenizer "
                "(data.tokenizer.path)"
            )
        m.config.use_cache = False
        return m
    cfg = hf_model_config(model, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id)
    cfg._attn_implementation = model.attn_implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated transformer blocks: the FSDP wrap and checkpointing unit."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise PipelineError(
            f"model of type {type(model).__name__} has no .model.layers; only Llama-style "
            "decoder models are supported"
        )
    return list(layers)


def flops_per_token(n_params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12·L·H·T (PaLM, Chowdhery et al. 2022, appendix B)."""
    return 6.0 * n_params + 12.0 * num_layers * hidden * seq_len


#: Dense bf16 peak FLOP/s per GPU (vendor datasheets), for MFU. CPU runs report MFU as null.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,
}


def peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of the device, or None when unknown (e.g. CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS.items():
        if key in name:
            return value
    return None
