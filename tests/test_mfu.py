"""MFU's numerator and denominator (issue 14), as arithmetic against published formulas.

- ``flops_per_token`` of real HF Llama modules equals torchtitan's
  (``torchtitan/models/utils.py``, ``get_dense_model_nparams_and_flops``:
  ``6·(nparams − nparams_embedding) + 6·L·H·head_dims·T``, ``head_dims = 2·Q`` as its llama3
  passes it), untied, tied (the shared table counted as the head, the rule of its
  ``get_nparams_and_active_nparams``) and with grouped-query attention; and on Llama-2-7B's
  shape, built on the meta device (its published 6,738,415,616 parameters);
- Megatron-LM's count per iteration (Narayanan et al. 2021: ``72·B·T·L·h²·(1 + T/(6h) +
  V/(12·h·L))`` without recomputation) over B·T tokens equals ours for GPT shapes (GPT-3 175B's
  among them), and for a real Llama whose SwiGLU MLP has a 4h MLP's parameters the two differ
  by exactly the RMSNorm weights' 6·(2h·L + h);
- the peak table picks the right row by device name and dtype (variants before their family,
  ``A10`` is not ``A100``), has no figure for a dtype a device lacks, and CPU gets none, with
  the reason the metrics record carries.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch import nn

from pipeline.model.build import (
    PEAK_FLOPS,
    device_peak_flops,
    flops_per_token,
    matmul_params,
    model_flops_per_token,
    peak_flops_of,
)


def llama(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int,
          tied: bool = False, meta: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, tie_word_embeddings=tied,
                      max_position_embeddings=64)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)
    return LlamaForCausalLM(cfg)


def torchtitan_flops(model: nn.Module, seq_len: int) -> int:
    """torchtitan's dense-model count, transcribed: every parameter (``parameters()`` counts a
    tied one once) less the ``nn.Embedding`` modules' (HF nests the embedding one level deeper
    than torchtitan's ``model.children()``), plus ``6·L·H·head_dims·T``."""
    nparams = sum(p.numel() for p in model.parameters())
    nparams_embedding = sum(sum(p.numel() for p in m.parameters())
                            for m in model.modules() if isinstance(m, nn.Embedding))
    cfg = model.config
    head_dims = 2 * (cfg.hidden_size // cfg.num_attention_heads)
    return (6 * (nparams - nparams_embedding)
            + 6 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dims * seq_len)


def megatron_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int,
                                 vocab: int) -> Fraction:
    """Narayanan et al. 2021, without activation recomputation (exact rational arithmetic)."""
    b, s, L, h, V = (Fraction(x) for x in (batch, seq, layers, hidden, vocab))
    return 72 * b * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))


@pytest.mark.parametrize("shape", [
    {"hidden": 32, "inter": 64, "layers": 2, "heads": 4, "kv": 4, "vocab": 384},
    {"hidden": 64, "inter": 172, "layers": 3, "heads": 8, "kv": 2, "vocab": 1024},  # GQA
])
def test_equals_torchtitan_on_real_modules(shape):
    model = llama(**shape)
    for seq in (32, 2048):
        assert model_flops_per_token(model, seq) == torchtitan_flops(model, seq)


def test_tied_embeddings_count_the_shared_table_as_the_head():
    untied = llama(32, 64, 2, 4, 4, 384)
    tied = llama(32, 64, 2, 4, 4, 384, tied=True)
    table = 384 * 32
    # Tied has one table fewer than untied, and the one it keeps is the head's matmul.
    assert matmul_params(tied) == matmul_params(untied) == sum(
        p.numel() for p in tied.parameters())
    # torchtitan's dense count drops the shared table (the head's matmul) altogether; its
    # active-parameter rule keeps it, as we do.
    assert model_flops_per_token(tied, 32) - torchtitan_flops(tied, 32) == 6 * table


def test_llama2_7b_shape():
    model = llama(4096, 11008, 32, 32, 32, 32000, meta=True)
    total = sum(p.numel() for p in model.parameters())
    assert total == 6_738_415_616  # Touvron et al. 2023's "7B"
    n = total - 32000 * 4096
    assert matmul_params(model) == n
    expected = 6 * n + 12 * 32 * 4096 * 4096
    assert model_flops_per_token(model, 4096) == expected == torchtitan_flops(model, 4096)
    assert expected == 46_086_512_640


@pytest.mark.parametrize("L,h,heads,V,S,B", [
    (96, 12288, 96, 51200, 2048, 1536),  # GPT-3 175B, Megatron's Table 1 row
    (24, 1024, 16, 50257, 1024, 8),
    (2, 32, 4, 384, 32, 8),
])
def test_equals_megatron_for_gpt_shapes(L, h, heads, V, S, B):
    # A GPT layer's matmul weights: QKV and output (4h²) and a 4h MLP (8h²); the logit layer hV.
    n = 12 * L * h * h + V * h
    ours = Fraction(flops_per_token(n, L, heads, h // heads, S)) * B * S
    assert ours == megatron_flops_per_iteration(B, S, L, h, V)


def test_megatron_on_a_real_llama_differs_by_the_norms_only():
    # SwiGLU with intermediate 8h/3 has a 4h MLP's 8h² weights; MHA; untied head.
    h, L, V, S, B = 48, 3, 384, 64, 4
    model = llama(h, 8 * h // 3, L, 4, 4, V)
    per_token = Fraction(model_flops_per_token(model, S))
    megatron = megatron_flops_per_iteration(B, S, L, h, V) / (B * S)
    assert per_token - megatron == 6 * (2 * h * L + h)


@pytest.mark.parametrize("name,dtype,peak", [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5e12),
    ("NVIDIA A100-SXM4-40GB", "tf32", 156e12),
    ("NVIDIA A10", "bf16", 125e12),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
    ("NVIDIA H100 PCIe", "bf16", 756.5e12),
    ("NVIDIA H100 NVL", "fp16", 835.5e12),
    ("NVIDIA H200", "bf16", 989.5e12),
    ("NVIDIA H200 NVL", "bf16", 835.5e12),
    ("NVIDIA B200", "bf16", 2.25e15),
    ("NVIDIA L40S", "bf16", 362.05e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40", "bf16", None),  # not the L40S, not the L4: not in the table
    ("Tesla V100-SXM2-16GB", "bf16", None),  # Volta has no bf16
    ("Tesla V100-PCIE-32GB", "fp16", 112e12),
    ("AMD Instinct MI250X/MI250", "bf16", 383e12),
    ("AMD Instinct MI250X", "tf32", None),  # CDNA2 has no tf32
    ("AMD Instinct MI300X", "bf16", 1307.4e12),
    ("NVIDIA GeForce GTX 1080", "bf16", None),
])
def test_peak_table(name, dtype, peak):
    assert peak_flops_of(name, dtype) == peak


def test_peak_table_is_dense_and_ordered():
    for _, figures in PEAK_FLOPS:
        # Tensor-core half precision is above tf32, which is above plain fp32.
        ladder = [figures[k] for k in ("bf16", "tf32", "fp32") if k in figures]
        assert ladder == sorted(ladder, reverse=True), figures
        assert figures.get("fp16", figures.get("bf16")) == figures.get("bf16", figures["fp16"])
    # The sparse datasheet figures would be 2x: H100 SXM's bf16 "1,979 TFLOPS*" halved.
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "bf16") == 1979e12 / 2


def test_cpu_has_no_peak_and_says_why():
    peak, why = device_peak_flops(torch.device("cpu"), "fp32")
    assert peak is None
    assert "cpu" in why.lower() and "peak" in why
