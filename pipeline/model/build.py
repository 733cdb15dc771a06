"""Build the causal LM a run trains: from a config (no hub download) or a local HF directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.config.schema import ModelConfig
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


def flops_per_token(n_params: int, num_layers: int, num_heads: int, head_dim: int,
                    seq_len: int) -> float:
    """Model FLOPs of training per token (forward and backward): ``6·N + 12·L·H·Q·T``.

    PaLM (Chowdhery et al. 2022, appendix B, "model FLOPs utilization"): each parameter of a
    matmul costs 2 FLOPs forward and 4 backward (6·N); attention adds, per layer, the scores
    ``q·Kᵀ`` and the weighted sum over ``V``, 2·H·Q·T each forward, ×3 for training (12·L·H·Q·T;
    L layers, H query heads of dimension Q, T tokens of context). Causal masking is not
    subtracted and recomputation (activation checkpointing, flash attention's backward) is not
    added: MFU counts the model's FLOPs, not the hardware's.

    ``n_params`` is the parameters used in a matmul per token (:func:`matmul_params`): all
    but the input embedding table, which is a lookup. torchtitan computes the same
    (``torchtitan/models/utils.py``, ``get_dense_model_nparams_and_flops``:
    ``6·(nparams − nparams_embedding) + 6·L·H·head_dims·T`` with ``head_dims = 2·Q``, the q·k
    and v head dimensions). Megatron-LM's per-iteration count (Narayanan et al. 2021, appendix:
    ``96·B·T·L·h²·(1 + T/(6h) + V/(16·L·h))`` with full recomputation, i.e. four passes; three
    without it: ``72·B·T·L·h²·(1 + T/(6h) + V/(12·L·h))``) is the same sum for a GPT layer
    (4h MLP), short only of the norms' weights. tests/test_mfu.py checks all three.
    """
    return 6.0 * n_params + 12.0 * num_layers * num_heads * head_dim * seq_len


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters of ``model`` that enter a matmul for every token: all of them (each counted
    once) except input embedding tables, a lookup; a table shared with the LM head (tied
    embeddings) is counted, as the head's matmul (torchtitan's
    ``get_nparams_and_active_nparams`` rule)."""
    head = getattr(model, "lm_head", None)
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, torch.nn.Module) else set()
    lookup = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
              for p in m.parameters(recurse=False) if id(p) not in head_ids}
    return sum(p.numel() for p in model.parameters() if id(p) not in lookup)


def model_flops_per_token(model: Any, seq_len: int) -> float:
    """:func:`flops_per_token` of an HF decoder model (its config's layers, heads and head
    dimension) at ``seq_len`` tokens of context."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return flops_per_token(matmul_params(model), cfg.num_hidden_layers,
                           cfg.num_attention_heads, head_dim, seq_len)


#: Dense peak FLOP/s per device (no 2:4 sparsity: the datasheets' starred figures halved), by
#: the matmul dtype: bf16/fp16 (tensor/matrix cores), tf32 (fp32 matmuls when
#: ``torch.get_float32_matmul_precision()`` is not "highest"), fp32 (otherwise; AMD's figure is
#: the matrix-core FP32 one, which rocBLAS uses). First match of the pattern (lowercase device
#: name, ``torch.cuda.get_device_name``) wins: variants before their family. Sources, vendor
#: datasheets: NVIDIA A100 (nvidia.com/en-us/data-center/a100), H100 SXM/PCIe/NVL
#: (…/h100), H200 SXM/NVL (…/h200), HGX B200 (the Blackwell datasheet's HGX B200 column,
#: 1000 W), L40S, L4, A10, V100; AMD Instinct MI250X/MI250, MI300X, MI325X (amd.com
#: product pages' "peak" tables). A dtype a device lacks (V100 bf16, MI250X tf32) is absent.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    (r"\bh100\b.*\bnvl\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bh100\b.*\bpcie\b", {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51e12}),
    (r"\bh100\b", {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12}),
    (r"\bh200\b.*\bnvl\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bh200\b", {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12}),
    (r"\bb200\b", {"bf16": 2.25e15, "fp16": 2.25e15, "tf32": 1.1e15, "fp32": 75e12}),
    (r"\ba100\b", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (r"\ba10\b", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (r"\bl40s\b", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}),
    (r"\bl4\b", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    (r"\bv100\b.*\bpcie\b", {"fp16": 112e12, "fp32": 14e12}),
    (r"\bv100\b", {"fp16": 125e12, "fp32": 15.7e12}),
    (r"\bmi325x\b", {"bf16": 1307.4e12, "fp16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12}),
    (r"\bmi300x\b", {"bf16": 1307.4e12, "fp16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12}),
    (r"\bmi250x\b", {"bf16": 383e12, "fp16": 383e12, "fp32": 95.7e12}),
    (r"\bmi250\b", {"bf16": 362.1e12, "fp16": 362.1e12, "fp32": 90.5e12}),
]


def peak_flops_of(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of the device called ``device_name`` for ``dtype`` matmuls, or None
    when the table has no figure for it."""
    import re

    name = device_name.lower()
    for pattern, figures in PEAK_FLOPS:
        if re.search(pattern, name):
            return figures.get(dtype)
    return None


def matmul_dtype(precision: str) -> str:
    """The dtype a run's matmuls use (``train.precision``): fp32 runs on tensor cores as tf32
    only when torch is told to (``torch.set_float32_matmul_precision``)."""
    if precision in ("bf16", "fp16"):
        return precision
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def device_peak_flops(device: torch.device, precision: str = "bf16") -> tuple[float | None, str]:
    """(peak FLOP/s, what it is) of ``device`` for a run of ``precision``, or (None, why there
    is none): MFU is then reported as null with that reason."""
    dtype = matmul_dtype(precision)
    if device.type != "cuda":
        return None, (f"no MFU on {device.type}: a CPU has no peak FLOP/s in the table "
                      "(its peak depends on the model's cores, clock and vector units)")
    name = torch.cuda.get_device_name(device)
    peak = peak_flops_of(name, dtype)
    if peak is None:
        return None, (f"no MFU: no dense {dtype} peak FLOP/s for {name!r} in "
                      "pipeline.model.build.PEAK_FLOPS (add its datasheet figure)")
    return peak, f"{name}, dense {dtype}: {peak / 1e12:g} TFLOP/s"


def peak_flops(device: torch.device, precision: str = "bf16") -> float | None:
    """Peak FLOP/s of the device for ``precision``, or None when unknown (e.g. CPU)."""
    return device_peak_flops(device, precision)[0]
