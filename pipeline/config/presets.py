"""Model architectures as numbers: presets, HF ``config.json`` import, exact parameter counts.

Only what memory planning and parallel layout need is kept (no weights, no tokenizer). Counts are
exact for the Llama/Mistral family as ``transformers`` builds it (tests compare against
``AutoModelForCausalLM.from_config`` on the meta device).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.config.types import (
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_PARAMS,
    MAX_POSITIONS,
    MAX_VOCAB_SIZE,
)
from pipeline.errors import PipelineError

#: Each shape number's upper bound (the config's): a shape read from a file or made from a
#: parameter count sizes the planner's work and the model it would build.
_LIMITS = {"vocab_size": MAX_VOCAB_SIZE, "hidden_size": MAX_HIDDEN,
           "intermediate_size": MAX_INTERMEDIATE, "num_layers": MAX_LAYERS,
           "num_heads": MAX_HEADS, "num_kv_heads": MAX_HEADS,
           "max_position_embeddings": MAX_POSITIONS, "head_dim": MAX_HIDDEN}

#: ``model_type`` values whose module layout :meth:`ModelShape.num_params` reproduces exactly.
SUPPORTED_MODEL_TYPES = ("llama", "mistral")


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """A decoder-only Llama-style transformer, as numbers."""

    name: str = "custom"
    """Preset name or where the shape came from (used in reports only)."""

    model_type: str = "llama"
    """HF ``model_type``: ``llama`` or ``mistral`` (same module layout)."""

    vocab_size: int
    """Rows of the token embedding (and of ``lm_head``)."""

    hidden_size: int
    """Model width ``h``."""

    intermediate_size: int
    """Width of the SwiGLU MLP (``gate_proj``/``up_proj`` output)."""

    num_layers: int
    """Decoder layers ``L`` (HF ``num_hidden_layers``)."""

    num_heads: int
    """Attention (query) heads ``a``."""

    num_kv_heads: int
    """Key/value heads; fewer than ``num_heads`` means grouped-query attention (GQA)."""

    max_position_embeddings: int = 4096
    """Longest sequence the rotary embedding is configured for (no parameters: RoPE)."""

    head_dim: int | None = None
    """Per-head width; ``None`` means ``hidden_size // num_heads`` (the HF default)."""

    tie_word_embeddings: bool = False
    """Whether ``lm_head`` shares the embedding matrix (counted once, as ``transformers`` does)."""

    attention_bias: bool = False
    """Biases on q/k/v/o projections (HF ``attention_bias``)."""

    mlp_bias: bool = False
    """Biases on gate/up/down projections (HF ``mlp_bias``)."""

    rope_theta: float = 10000.0
    """RoPE base; carried through to the HF config, irrelevant to memory."""

    num_params_override: int | None = None
    """Set only for a shape synthesised from ``--params N``: the count the user asked for."""

    def __post_init__(self) -> None:
        for field_name, limit in _LIMITS.items():
            value = getattr(self, field_name)
            if value is None and field_name == "head_dim":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise PipelineError(f"model.{field_name}: must be a positive integer, got {value!r}")
            if value > limit:
                raise PipelineError(f"model.{field_name}: {value} is more than {limit}, the "
                                    f"largest the pipeline plans for")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise PipelineError(
                f"model.model_type: {self.model_type!r} is not supported by the planner; "
                f"use one of {', '.join(SUPPORTED_MODEL_TYPES)}, or give --params N instead")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise PipelineError(
                f"model.num_heads: hidden_size {self.hidden_size} is not divisible by "
                f"num_heads {self.num_heads}; set head_dim explicitly")
        if self.num_heads % self.num_kv_heads:
            raise PipelineError(
                f"model.num_kv_heads: {self.num_kv_heads} must divide num_heads {self.num_heads} (GQA)")

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def head_size(self) -> int:
        """Per-head width actually used."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def embedding_params(self) -> int:
        """``embed_tokens``: V·h."""
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        """``lm_head`` weight V·h, or 0 when tied to the embedding (one tensor, counted once)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def attention_params(self) -> int:
        """q, k, v, o projections of one layer; GQA shrinks k and v to ``num_kv_heads`` heads."""
        h, d = self.hidden_size, self.head_size
        q_out, kv_out = self.num_heads * d, self.num_kv_heads * d
        weights = h * q_out + 2 * h * kv_out + q_out * h
        biases = (q_out + 2 * kv_out + h) if self.attention_bias else 0
        return weights + biases

    def mlp_params(self) -> int:
        """SwiGLU gate, up and down projections of one layer."""
        h, i = self.hidden_size, self.intermediate_size
        return 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)

    def layer_params(self) -> int:
        """One decoder layer: attention + MLP + two RMSNorm weight vectors."""
        return self.attention_params() + self.mlp_params() + 2 * self.hidden_size

    def num_params(self) -> int:
        """Exact total, as ``sum(p.numel() for p in model.parameters())`` (tied counted once)."""
        if self.num_params_override is not None:
            return self.num_params_override
        return (self.embedding_params() + self.num_layers * self.layer_params()
                + self.hidden_size  # final RMSNorm
                + self.lm_head_params())

    def largest_layer_params(self) -> int:
        """Largest parameter count held directly by one module, as DeepSpeed's ``model_to_params``
        computes it for ``estimate_zero3_model_states_mem_needs`` (``recurse=False``: one
        ``nn.Linear``/``nn.Embedding``, not one decoder layer). ZeRO-3 gathers at this granularity.
        """
        h, d = self.hidden_size, self.head_size
        candidates = [
            self.vocab_size * h,  # embed_tokens and lm_head
            h * self.intermediate_size + (self.intermediate_size if self.mlp_bias else 0),
            h * self.num_heads * d + (self.num_heads * d if self.attention_bias else 0),
        ]
        if self.num_params_override is not None:
            # A synthetic shape only approximates the count; scale the layer with it.
            scale = self.num_params_override / max(1, self._architecture_params())
            return int(max(candidates) * scale)
        return max(candidates)

    def _architecture_params(self) -> int:
        return replace(self, num_params_override=None).num_params()

    # -- conversions ---------------------------------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` keys this shape stands for (``LlamaConfig(**d)`` accepts it)."""
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = self.mlp_bias
        if self.head_dim is not None:
            out["head_dim"] = self.head_dim
        return out

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | Path) -> ModelShape:
        """Read a HF ``config.json`` (a dict or a path to the file or its directory)."""
        name = "config"
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                config = json.loads(path.read_text())
            except FileNotFoundError:
                raise PipelineError(f"model: {path} does not exist; give a preset name or a HF "
                                    f"config.json path") from None
            except json.JSONDecodeError as exc:
                raise PipelineError(f"model: {path} is not valid JSON ({exc})") from None
            name = str(path)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in config]
        if missing:
            raise PipelineError(f"model: HF config {name} lacks {', '.join(missing)}")
        heads = config["num_attention_heads"]
        # HF defaults: num_key_value_heads None means MHA; tie_word_embeddings False for Llama/Mistral.
        kv = config.get("num_key_value_heads") or heads
        return cls(
            name=name,
            model_type=config.get("model_type", "llama"),
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            head_dim=config.get("head_dim"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
        )

    @classmethod
    def synthetic(cls, num_params: int) -> ModelShape:
        """A Llama-like shape for a bare parameter count (``--params 7.5e9``).

        Model states need only the count; activations and TP/PP checks need a shape, so one is
        made up with GPT-3's aspect ratio (width ≈ 128 × depth, Brown et al. 2020, Table 2.1) and
        a SwiGLU MLP of width 8h/3 (12h² parameters per layer, as GPT's 4h MLP). The count itself is kept exactly.
        """
        if not 0 < num_params <= MAX_PARAMS:
            raise PipelineError(f"--params: must be in (0, {MAX_PARAMS:.0e}], got {num_params}")
        vocab = 32000
        # 12·L·h² with h = 128·L  →  h³ = 128·N/12
        width = (128 * num_params / 12) ** (1 / 3)
        # Round to a multiple of 1024 (heads of 128, a multiple of 8 heads: TP-friendly); small
        # models to a multiple of 64 with heads of 64.
        if width >= 1024:
            hidden, heads = round(width / 1024) * 1024, round(width / 1024) * 8
        else:
            hidden = max(64, round(width / 64) * 64)
            heads = hidden // 64
        layers = max(1, round((num_params - 2 * vocab * hidden) / (12 * hidden * hidden)))
        return cls(name=f"synthetic-{num_params:.3g}", vocab_size=vocab, hidden_size=hidden,
                   intermediate_size=math.ceil(8 * hidden / 3),
                   num_layers=layers, num_heads=heads, num_kv_heads=heads,
                   num_params_override=int(num_params))


PRESETS: dict[str, ModelShape] = {
    # Touvron et al. 2023 (Llama 2), Table 1 and the released config.json files.
    "llama2-7b": ModelShape(name="llama2-7b", vocab_size=32000, hidden_size=4096,
                            intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
                            max_position_embeddings=4096),
    "llama2-13b": ModelShape(name="llama2-13b", vocab_size=32000, hidden_size=5120,
                             intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40,
                             max_position_embeddings=4096),
    "llama2-70b": ModelShape(name="llama2-70b", vocab_size=32000, hidden_size=8192,
                             intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                             max_position_embeddings=4096),
    # Llama 3 (Dubey et al. 2024, Table 3): 128K vocabulary, GQA with 8 KV heads, rope 500k.
    "llama3-8b": ModelShape(name="llama3-8b", vocab_size=128256, hidden_size=4096,
                            intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                            max_position_embeddings=8192, rope_theta=500000.0),
    "llama3-70b": ModelShape(name="llama3-70b", vocab_size=128256, hidden_size=8192,
                             intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                             max_position_embeddings=8192, rope_theta=500000.0),
    # Mistral 7B v0.1 (Jiang et al. 2023, Table 1).
    "mistral-7b": ModelShape(name="mistral-7b", model_type="mistral", vocab_size=32000,
                             hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, max_position_embeddings=32768),
    # The pipeline's CPU default: a few hundred thousand parameters.
    "tiny": ModelShape(name="tiny", vocab_size=1024, hidden_size=64, intermediate_size=172,
                       num_layers=2, num_heads=4, num_kv_heads=4, max_position_embeddings=256),
}


def resolve_model(spec: str | Path | dict[str, Any] | ModelShape) -> ModelShape:
    """A preset name, a HF config (dict, file or directory), or a shape as is."""
    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, dict):
        return ModelShape.from_hf_config(spec)
    text = str(spec)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if path.suffix == ".json" or path.exists():
        return ModelShape.from_hf_config(path)
    raise PipelineError(f"model: {text!r} is neither a preset ({', '.join(PRESETS)}) nor an "
                        f"existing HF config.json")
