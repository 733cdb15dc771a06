"""DeepSpeed pipeline parallelism (``train.pp > 1`` on ``backend: deepspeed``): the HF Llama the
trainer built, cut into DeepSpeed ``PipelineModule`` layers.

The layers, in order: the token embedding, one wrapper per decoder layer, then the final norm
with the LM head. ``PipelineModule`` builds each ``LayerSpec`` on the stage that owns it only,
from the trainer's modules (the same seeded weights as every other layout, so the losses are
the pure-DP run's). Activations between stages are one tensor (the hidden states): DeepSpeed's
pipeline sends tensors only, so every decoder wrapper computes RoPE and the causal mask itself
instead of receiving them the way ``LlamaModel`` passes them down.

The wrappers' attribute names are the checkpoint's names: DeepSpeed saves ``layer_XX``
files and ZeRO's ``param_shapes`` under ``"<index>.<attribute>.<name>"``, and consolidation
maps them back to HF names with :func:`pipeline.checkpoint.deepspeed.pipe_to_hf_name`, which reads the
same constants.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.checkpoint.deepspeed import PIPE_DECODER, PIPE_EMBED, PIPE_LM_HEAD, PIPE_NORM
from pipeline.model.build import decoder_layers


class EmbedPipe(nn.Module):
    """Layer 0: token ids → hidden states (first stage only reads the inputs)."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        setattr(self, PIPE_EMBED, embed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return getattr(self, PIPE_EMBED)(input_ids)


class DecoderPipe(nn.Module):
    """One HF decoder layer on hidden states alone: RoPE and the causal mask are recomputed
    here (cheap, and identical to what ``LlamaModel`` would pass)."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, eager: bool) -> None:
        super().__init__()
        setattr(self, PIPE_DECODER, layer)
        # Shared by every wrapper; its buffers are non-persistent, so no checkpoint names.
        self.rotary_emb = rotary_emb
        # Eager attention applies only the mask it is given; sdpa and flash attention run
        # causally themselves when the mask is None (what LlamaModel passes without padding).
        self.eager = eager

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        seq = hidden.shape[1]
        pos = torch.arange(seq, device=hidden.device).unsqueeze(0)
        mask = None
        if self.eager:
            # HF's additive mask: the dtype's minimum above the diagonal.
            mask = torch.full((seq, seq), torch.finfo(hidden.dtype).min, dtype=hidden.dtype,
                              device=hidden.device).triu(1)[None, None]
        rope = self.rotary_emb(hidden, pos)
        return getattr(self, PIPE_DECODER)(hidden, attention_mask=mask, position_ids=pos,
                                           position_embeddings=rope)


class HeadPipe(nn.Module):
    """The last layer: final norm and LM head → logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        setattr(self, PIPE_NORM, norm)
        setattr(self, PIPE_LM_HEAD, lm_head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return getattr(self, PIPE_LM_HEAD)(getattr(self, PIPE_NORM)(hidden))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's ``labels=`` loss: next-token cross entropy, the mean over every predicted token (in
    fp32, as ``ForCausalLMLoss`` computes it)."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1))


def pipeline_module(model: Any, stages: int, *, activation_checkpointing: bool) -> Any:
    """``model`` (an HF Llama-style causal LM) as a ``PipelineModule`` over ``stages`` stages
    (collective: every rank calls it after the process group is up).

    ``partition_method="type:DecoderPipe"`` balances the decoder layers over the stages (the
    embedding joins the first, the head the last), as ``train.pp`` promises; config validation
    makes sure every stage gets one. With activation checkpointing every decoder wrapper is
    recomputed (not the embedding, whose integer input has no gradient to carry)."""
    import torch.distributed as dist

    from pipeline.train.extensions import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.pipe import LayerSpec, PipelineModule

    # PipelineModule makes its groups through deepspeed.comm, which deepspeed.initialize would
    # set up only later: wrap the trainer's process group now.
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    inner = model.model
    eager = model.config._attn_implementation == "eager"
    layers = [LayerSpec(EmbedPipe, inner.embed_tokens)]
    layers += [LayerSpec(DecoderPipe, layer, inner.rotary_emb, eager)
               for layer in decoder_layers(model)]
    layers.append(LayerSpec(HeadPipe, inner.norm, model.lm_head))
    module = PipelineModule(
        layers=layers, num_stages=stages, loss_fn=causal_lm_loss,
        partition_method=f"type:{DecoderPipe.__name__}",
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        checkpointable_layers=[DecoderPipe.__name__],
    )
    # Every parameter lives on one stage only. Without ZeRO, DeepSpeed clips with
    # runtime.utils.clip_grad_norm_, which counts a parameter only on model-parallel rank 0
    # unless it is marked model-parallel, and a pipeline's model-parallel rank is its stage:
    # unmarked, the norm would be the first stage's alone (seen: 8e-5 off the DP losses with
    # ZeRO-0). The mark is otherwise read for tensor parallelism, which never runs with this.
    for p in module.parameters():
        p.model_parallel = True
    return module


def pipeline_logits(engine: Any, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The whole model's logits for ``input_ids`` (the same on every rank; collective): one
    inference pass through the stages, then the last stage of data-parallel replica 0
    broadcasts its logits to all ranks (rank 0 writes them)."""
    import torch.distributed as dist

    ids = input_ids.to(engine.device)
    # The pipeline sends activation shapes once and caches them: this batch's shape differs
    # from the training micro batches', before and after.
    engine.reset_activation_shape()
    # Without a loss the last stage adds the logits to the step's loss total, which the last
    # train_batch left behind (eval_batch does not clear it).
    engine.total_loss = None
    try:
        _, out = engine.eval_batch(iter([(ids, ids)]), return_logits=True, compute_loss=False,
                                   reduce_output=None, bcast_loss=False, num_micro_batches=1)
    finally:
        engine.reset_activation_shape()
    src = engine.module.topology().get_rank(pipe=engine.num_stages - 1, data=0)
    if dist.get_rank() == src:
        logits = out.float().contiguous()
    else:
        logits = torch.empty((*ids.shape, vocab_size), dtype=torch.float32, device=engine.device)
    dist.broadcast(logits, src=src)
    return logits
