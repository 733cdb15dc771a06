"""The ddp engine: torch ``DistributedDataParallel`` with native AMP (the seed guide's first row).

Every rank holds the whole model, its gradients and the AdamW states (ZeRO-0); gradients are
all-reduced in buckets during backward, once per optimizer step (``no_sync`` on the other micro
batches). One process works too (world size 1: DDP over a group of one).

Precision (``train.precision``): parameters, gradients and optimizer states stay fp32 (the
master weights); ``bf16``/``fp16`` run the forward under ``torch.autocast``. ``fp16`` scales the
loss with ``torch.amp.GradScaler``: a step whose gradients overflow is skipped (no optimizer or
scheduler step, as DeepSpeed does) and the scale halves; the count of skipped steps and the
scale go to ``metrics.jsonl`` (:meth:`DDPEngine.step_metrics`).

Activation checkpointing (``train.activation_checkpointing``): every decoder layer
(:func:`pipeline.model.build.decoder_layers`) is wrapped in torch's non-reentrant checkpoint wrapper.

Checkpoints are DCP, as the fsdp engine writes them: ``get_state_dict`` gives HF names (DDP's
``module.`` and the checkpoint wrapper's prefix removed), saved as ``{"model", "optim"}`` so
that consolidation reads ``model.*`` unchanged, plus ``"amp"``: the GradScaler's state and the
skipped-step count. Replicated tensors are written once (DCP's planner deduplicates them), and
a checkpoint loads on any world size.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch

from pipeline.config.schema import RunConfig
from pipeline.model.build import decoder_layers
from pipeline.train.compile import compile_decoder_layers
from pipeline.train.engines import StepResult, adamw_state_for_load, adamw_with_schedule

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def checkpoint_decoder_layers(model: Any) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant, so it composes
    with DDP's hooks). ``use_cache`` is off: a cached forward would be replayed twice."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model.config.use_cache = False
    layers = set(decoder_layers(model))
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(
            m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: m in layers,
    )


class DDPEngine:
    """``DistributedDataParallel`` + AdamW + ``LambdaLR`` (the fsdp engine's optimizer and
    schedule), autocast and a GradScaler for fp16; DCP checkpoints."""

    def __init__(self, model: Any, run: RunConfig, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel

        t = run.train
        if t.activation_checkpointing:
            checkpoint_decoder_layers(model)
        model.to(device)
        compile_decoder_layers(model, run, device)  # train.compile: after AC, before DDP
        self.device = device
        self.module = model
        # gradient_as_bucket_view: the gradients live in the all-reduce buckets (no second copy).
        self.model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True)
        self.amp_dtype = _AMP_DTYPES.get(t.precision)
        self.scaler = torch.amp.GradScaler(
            device.type, init_scale=t.loss_scale_init,
            growth_interval=t.loss_scale_growth_interval, enabled=t.precision == "fp16")
        self.skipped_steps = 0
        self.last_skipped = False
        self.clip = t.grad_clip
        self.opt, self.sched = adamw_with_schedule(model.parameters(), t)

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None)

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        n = len(micro_batches)
        total = 0.0
        for i, ids in enumerate(micro_batches):
            # All-reduce gradients only on the last micro batch of the accumulation.
            sync = contextlib.nullcontext() if i == n - 1 else self.model.no_sync()
            with sync:
                with self._autocast():
                    loss = self.model(input_ids=ids, labels=ids).loss
                self.scaler.scale(loss / n).backward()
            total += loss.detach().float().item()
        # Unscaled before clipping, so that the norm and the clip are the true ones.
        self.scaler.unscale_(self.opt)
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.clip if self.clip > 0 else math.inf
        )
        lr = self.opt.param_groups[0]["lr"]
        self.last_skipped = False
        if self.scaler.is_enabled():
            scale = self.scaler.get_scale()
            self.scaler.step(self.opt)  # skips opt.step() when a gradient is inf/nan
            self.scaler.update()
            # The scale only falls (backoff) on a step with an overflow, on every rank alike:
            # DDP's all-reduce spread the inf/nan to every replica's gradients.
            self.last_skipped = self.scaler.get_scale() < scale
        else:
            self.opt.step()
        if self.last_skipped:
            self.skipped_steps += 1
        else:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return StepResult(loss=total / n, grad_norm=float(norm), lr=lr)

    def step_metrics(self) -> dict[str, Any]:
        """Extra fields of the step's ``metrics.jsonl`` record (fp16 only: the loss scaler)."""
        if not self.scaler.is_enabled():
            return {}
        return {"loss_scale": self.scaler.get_scale(), "scaler_skipped": self.last_skipped,
                "skipped_steps": self.skipped_steps}

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        amp = {"skipped_steps": self.skipped_steps, **self.scaler.state_dict()}
        return {"model": msd, "optim": osd, "amp": amp}

    def save(self, ckpt: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        from pipeline.checkpoint import fastio
        from pipeline.checkpoint.async_save import dcp_writer

        # As the fsdp engine: files through fastio's O_DIRECT writer (checksummed, fsynced).
        digests = fastio.Digests()
        with fastio.no_torch_crc32():
            dcp.save(self._state(), storage_writer=dcp_writer(ckpt, digests))
        return {"scheduler": self.sched.state_dict(), "digests": digests.relative_to(ckpt)}

    def save_async(self, ckpt: Path, pg: Any) -> tuple[dict[str, Any], Any]:
        """Stage now, write in DCP's background thread (``pipeline.checkpoint.async_save``)."""
        from pipeline.checkpoint.async_save import dcp_save_async, make_stager

        if getattr(self, "_stager", None) is None:
            self._stager = make_stager()
        write = dcp_save_async(self._state(), ckpt, pg, self._stager)
        return {"scheduler": self.sched.state_dict()}, write

    def load(self, ckpt: Path, extra: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from pipeline.checkpoint.tensors import dcp_load, read_dcp_metadata

        # As FSDPEngine.load: the allow-listed reader, from the verified bytes after a resume.
        verified = extra.get("verified")
        fs = verified.dcp_filesystem() if verified is not None else None
        read_dcp_metadata(ckpt / "dcp", fs)
        adamw_state_for_load(self.opt)
        state = self._state()
        dcp_load(state, ckpt / "dcp", fs=fs)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        amp = dict(state["amp"])
        self.skipped_steps = int(amp.pop("skipped_steps"))
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(amp)
        self.sched.load_state_dict(extra["scheduler"])

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's logits as training computes them (under autocast for bf16/fp16)."""
        self.module.eval()
        try:
            with self._autocast():
                return self.module(input_ids=input_ids).logits.float()
        finally:
            self.module.train()
