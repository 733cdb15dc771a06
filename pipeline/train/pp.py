"""Pipeline parallelism on the fsdp backend: ``torch.distributed.pipelining`` stages, each one
tensor-parallel (optional) and sharded by FSDP2 over the data-parallel ranks.

Stage split (torchtitan's approach, adapted to a Hugging Face model): every rank builds the
whole model from the same seed, keeps the contiguous block of decoder layers its stage owns
(:func:`pipeline.plan.topology.stage_layers`, the rule the planner counts with) and replaces the
others with a parameter-free pass-through, so parameter names (``model.layers.7.…``) stay those
of the full model: a DCP checkpoint of any (pp, tp, dp) layout loads into any other and
consolidates like a pure-DP one. The first stage keeps the embedding, the last the final norm
and the LM head; the others drop them.

The micro batches of one optimizer step (``train.grad_accum`` of ``micro_batch_size`` rows) flow
through a GPipe or 1F1B schedule (``train.pp_schedule``). Only the first stage feeds token ids
in, only the last computes the loss (the causal-LM loss HF computes with ``labels=``, as a mean
per micro batch; the schedule averages the gradients over micro batches, as gradient
accumulation does), so a PP run takes the same optimizer steps as the DP run with the same
global batch.

For a 70 B model one would build each stage on the meta device and initialise only the owned
layers; here the whole model is built first (tiny models, and the same initial weights as the
DP run by construction).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.config.schema import RunConfig
from pipeline.model.build import decoder_layers
from pipeline.plan.topology import stage_layers
from pipeline.train.compile import compile_decoder_layers
from pipeline.train.engines import (
    FSDPEngine,
    StepResult,
    _enable_activation_checkpointing,
    adamw_with_schedule,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class PassThrough(nn.Module):
    """A decoder layer another stage owns: returns the hidden states unchanged (no parameters,
    so the stage's state dict holds only what the stage trains)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class StageModule(nn.Module):
    """What one pipeline stage runs: token ids (first stage) or hidden states (the others) in,
    hidden states (or, on the last stage, logits) out. HF builds the causal mask and the rotary
    embeddings itself from ``inputs_embeds``. Checkpoints take the HF model's state dict (the
    full model's names), never this wrapper's."""

    def __init__(self, model: Any, first: bool) -> None:
        super().__init__()
        self.hf = model
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            out = self.hf(input_ids=x, use_cache=False).logits
        else:
            out = self.hf(inputs_embeds=x, use_cache=False).logits
        # HF returns a view (hidden_states[:, slice]); a view cannot be detached in place by the
        # schedule's backward, and FSDP2 warns about it.
        return out.clone()


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HF's ``labels=`` loss for packed sequences: next-token cross entropy, mean per token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def split_stage(model: Any, stage: int, n_stages: int) -> list[nn.Module]:
    """Strip ``model`` down to pipeline stage ``stage`` of ``n_stages`` in place; returns the
    decoder layers the stage owns."""
    layers = model.model.layers
    owned = stage_layers(len(layers), n_stages)[stage]
    for i in range(len(layers)):
        if i not in owned:
            layers[i] = PassThrough()
    if stage > 0:
        model.model.embed_tokens = None
    if stage < n_stages - 1:
        model.model.norm = nn.Identity()
        model.lm_head = nn.Identity()
    return [layers[i] for i in owned]


class PipelineEngine(FSDPEngine):
    """FSDP2 × pipeline stages (× DTensor TP): one stage per rank of the mesh's ``pp``
    dimension. Checkpoints, loads and scheduler are FSDPEngine's (DCP, full-model names)."""

    def __init__(self, model: Any, run: RunConfig, device: torch.device,
                 mesh: DeviceMesh) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from pipeline.train.parallel import fsdp_mesh

        t = run.train
        pp_mesh = mesh["pp"]
        self.stage_idx, self.n_stages = pp_mesh.get_local_rank(), pp_mesh.size()
        self.first, self.last = self.stage_idx == 0, self.stage_idx == self.n_stages - 1
        self.pp_group = pp_mesh.get_group()
        # Peers for the probe's forward: the same (dp, tp) coordinates one stage up or down.
        self.stride = dist.get_world_size() // self.n_stages
        owned = split_stage(model, self.stage_idx, self.n_stages)
        assert len(decoder_layers(model)) == run.model.num_layers
        if t.activation_checkpointing:
            _enable_activation_checkpointing(model)
        model.to(device)
        self.tp = "tp" in (mesh.mesh_dim_names or ())
        if self.tp:
            from pipeline.train.tp import tensor_parallel

            tensor_parallel(model, mesh["tp"], layers=owned)
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if t.precision == "bf16" else MixedPrecisionPolicy())
        reshard = t.fsdp_sharding in ("FULL_SHARD", "HYBRID_SHARD")
        dp_mesh = fsdp_mesh(mesh)
        compile_decoder_layers(model, run, device, layers=owned)  # after TP/AC, before FSDP
        for layer in owned:
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        self.model = model
        self.device = device
        self.clip = t.grad_clip
        self.opt, self.sched = adamw_with_schedule(model.parameters(), t)
        self.stage_module = StageModule(model, self.first)
        stage = PipelineStage(self.stage_module, self.stage_idx, self.n_stages, device,
                              group=self.pp_group)
        schedule = ScheduleGPipe if t.pp_schedule == "gpipe" else Schedule1F1B
        self.schedule = schedule(stage, n_microbatches=t.grad_accum, loss_fn=causal_lm_loss)

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        from pipeline.train.tp import clip_grad_norm

        batch = torch.cat(micro_batches)
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(batch)
        elif self.last:
            self.schedule.step(target=batch, losses=losses)
        else:
            self.schedule.step()
        # The loss exists on the last stage only (the trainer averages the last stage's).
        loss = (float(torch.stack([x.detach().float() for x in losses]).mean())
                if losses else math.nan)
        norm = clip_grad_norm(self.model.parameters(), self.clip, pp_group=self.pp_group)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return StepResult(loss=loss, grad_norm=norm, lr=lr)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The full model's logits, on global rank 0 (the first stage's first rank); other
        ranks return an empty tensor. Forward only, stage by stage, point to point."""
        rank = dist.get_rank()
        self.model.eval()
        try:
            if self.first:
                x = input_ids
            else:
                hidden = self.model.config.hidden_size
                x = torch.empty(*input_ids.shape, hidden, device=self.device)
                dist.recv(x, src=rank - self.stride)
            out = self.stage_module(x).float().contiguous()
            if not self.last:
                dist.send(out, dst=rank + self.stride)
        finally:
            self.model.train()
        # The last stage's rank with global rank 0's (dp, tp) coordinates hands the logits over.
        last_peer = self.stride * (self.n_stages - 1)
        if rank == last_peer:
            dist.send(out, dst=0)
        if rank == 0:
            vocab = self.model.config.vocab_size
            out = torch.empty(*input_ids.shape, vocab, device=self.device)
            dist.recv(out, src=last_peer)
            return out
        return torch.empty(0)
