"""The training engines behind one small interface: FSDP2 and DeepSpeed here, plain
``DistributedDataParallel`` with native AMP in ``ddp.py``.

The trainer (``trainer.py``) only calls ``train_step``, ``save``, ``load`` and ``logits`` (and,
when an engine has it, ``step_metrics`` for extra fields of the step's metrics record); which
engine runs is one config key (``train.backend``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pipeline.config.schema import RunConfig
from pipeline.model.build import decoder_layers
from pipeline.train.compile import compile_decoder_layers
from pipeline.train.extensions import import_deepspeed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step reports (local to the rank; the loop averages the loss)."""

    loss: float
    """Mean loss over this rank's micro batches."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate the step used."""


class Engine(Protocol):
    """What the training loop needs from an engine."""

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult: ...
    def save(self, ckpt: Path) -> dict[str, Any]: ...
    def load(self, ckpt: Path, extra: dict[str, Any]) -> None: ...
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor: ...


def adamw_with_schedule(params: Any, t: Any) -> tuple[Any, Any]:
    """The torch engines' optimizer and schedule (``train.*``): AdamW with linear warmup then
    linear decay to 0 at ``max_steps`` (DeepSpeed renders the same from ds_config)."""
    opt = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, eps=t.eps,
                            weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay_lambda(t.warmup_steps,
                                                                        t.max_steps))
    return opt, sched


def adamw_state_for_load(opt: Any) -> bool:
    """Give a fresh ``torch.optim.AdamW`` the per-parameter state its first step would make
    (``step``, ``exp_avg``, ``exp_avg_sq`` [, ``max_exp_avg_sq``]; Adam's ``_init_group``),
    uninitialized, for a checkpoint load to fill. True if made. DeepSpeed's ``FusedAdam`` (the
    base optimizer of ZeRO 1-2) too: ``step`` from its group, as its first step takes it.

    Why: DCP's ``get_state_dict`` otherwise makes the state by a whole optimizer step on zero
    gradients (torch's ``_init_optim_state``: a zero gradient per parameter, the Adam
    arithmetic, moments zeroed then overwritten), 0.4-1.2 s of a 1.4-2.5 s cold load of a
    134 M model on the development VM (``bench.checkpoint``). Uninitialized is safe because the
    load fills every element or fails: the load planner refuses a checkpoint that lacks a key.
    False, and nothing made, for an optimizer that already has state, is neither of those, or
    runs fused/capturable (those keep ``step`` on the device): torch's way then."""
    fused = (type(opt).__name__ == "FusedAdam"
             and type(opt).__module__ == "deepspeed.ops.adam.fused_adam")
    if not (fused or type(opt) is torch.optim.AdamW) or opt.state:
        return False
    if not fused and any(g.get("fused") or g.get("capturable") for g in opt.param_groups):
        return False
    from pipeline.checkpoint.stream import prefault

    # torch.optim.optimizer._get_scalar_dtype(): float64 only under a float64 default dtype.
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    keys = ("exp_avg", "exp_avg_sq")
    new = []
    for group in opt.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = {"step": (group.get("step", 0) if fused  # FusedAdam.step's own start
                              else torch.tensor(0.0, dtype=step_dtype))}
            for key in keys + (("max_exp_avg_sq",) if group.get("amsgrad") else ()):
                state[key] = torch.empty_like(p, memory_format=torch.preserve_format)
                local = state[key].to_local() if hasattr(state[key], "to_local") else state[key]
                if local.device.type == "cpu":
                    new.append(local.untyped_storage())
            opt.state[p] = state
    prefault(new)  # the new memory's page faults taken while the load reads the disk
    return True


def warmup_decay_lambda(warmup: int, total: int):
    """DeepSpeed's ``WarmupDecayLR`` (linear warmup) as a ``LambdaLR`` factor.

    DeepSpeed's scheduler starts at ``last_batch_iteration = -1`` (lr = warmup_min_lr = 0) and
    steps after every optimizer step; ``LambdaLR`` evaluates epoch 0 at construction. So
    epoch e here is DeepSpeed's iteration e - 1: both engines use the same rate at every step.
    """

    def factor(epoch: int) -> float:
        it = epoch - 1
        if it < 0:
            return 0.0
        if it < warmup:
            return it / warmup
        return max(0.0, (total - it) / max(1.0, total - warmup))

    return factor


def _enable_activation_checkpointing(model: Any) -> None:
    # HF's own checkpointing of each decoder layer; non-reentrant so it composes with FSDP2 and
    # ZeRO-3 hooks. use_cache is off (a cached forward would be replayed twice on recompute).
    model.config.use_cache = False
    # transformers renamed gradient_checkpointing_enable (and its kwargs) after 5.17; the GPU
    # image the GPU benchmarks ran on has 5.17, CI a later one: take whichever this version has.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})


class FSDPEngine:
    """FSDP2: ``fully_shard`` per decoder layer, then the root; DCP checkpoints. With a ``tp``
    mesh dimension the decoder layers are tensor-parallel first (``pipeline.train.tp``).

    ``mesh``: the world mesh of ``pipeline.train.parallel.build_mesh`` (FSDP2 shards over its
    data-parallel sub-mesh, :func:`~pipeline.train.parallel.fsdp_mesh`); built here from the
    run's layout when not given."""

    def __init__(self, model: Any, run: RunConfig, device: torch.device,
                 mesh: DeviceMesh | None = None) -> None:
        # Imported at start-up, not by the first save or resume that needs it (every run
        # does): 0.48 s on the development VM, which a requeued job's timed load otherwise
        # counted as reading (bench.checkpoint). Moved, not saved: the job's start pays it.
        import torch.distributed.checkpoint.state_dict
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from pipeline.train.parallel import build_mesh, fsdp_mesh, parallel_dims

        t = run.train
        if t.activation_checkpointing:
            _enable_activation_checkpointing(model)
        model.to(device)
        if mesh is None:
            mesh = build_mesh(parallel_dims(run), device.type, t.fsdp_sharding)
        # FULL_SHARD / SHARD_GRAD_OP: 1-D (dp_shard). NO_SHARD: (dp_replicate=dp, dp_shard=1),
        # DDP semantics. HYBRID_SHARD: shard inside a node (fast links), replicate across nodes.
        dp_mesh = fsdp_mesh(mesh)
        # Tensor parallelism first (DTensor over mesh["tp"]), then FSDP2 over the DP sub-mesh.
        self.tp = "tp" in (mesh.mesh_dim_names or ())
        if self.tp:
            from pipeline.train.tp import tensor_parallel

            tensor_parallel(model, mesh["tp"])
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if t.precision == "bf16"
            else MixedPrecisionPolicy()
        )
        # SHARD_GRAD_OP (ZeRO-2-like) keeps parameters gathered between forward and backward.
        reshard = t.fsdp_sharding in ("FULL_SHARD", "HYBRID_SHARD")
        compile_decoder_layers(model, run, device)  # train.compile: after TP/AC, before FSDP
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        self.model = model
        self.clip = t.grad_clip
        self.opt, self.sched = adamw_with_schedule(model.parameters(), t)

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        n = len(micro_batches)
        total = 0.0
        for i, ids in enumerate(micro_batches):
            # Reduce-scatter gradients only on the last micro batch of the accumulation.
            self.model.set_requires_gradient_sync(i == n - 1)
            loss = self.model(input_ids=ids, labels=ids).loss
            (loss / n).backward()
            total += loss.detach().float().item()
        if self.tp:
            # Parameters on two meshes (dp × tp and dp): the norm per mesh, then combined.
            from pipeline.train.tp import clip_grad_norm

            norm = clip_grad_norm(self.model.parameters(), self.clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.clip if self.clip > 0 else math.inf
            )
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return StepResult(loss=total / n, grad_norm=float(norm), lr=lr)

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def save(self, ckpt: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        from pipeline.checkpoint import fastio
        from pipeline.checkpoint.async_save import dcp_writer

        digests = fastio.Digests()
        with fastio.no_torch_crc32():
            dcp.save(self._state(), storage_writer=dcp_writer(ckpt, digests))
        return {"scheduler": self.sched.state_dict(), "digests": digests.relative_to(ckpt)}

    def save_async(self, ckpt: Path, pg: Any) -> tuple[dict[str, Any], Any]:
        """Stage now, write in DCP's background thread (``pipeline.checkpoint.async_save``)."""
        from pipeline.checkpoint.async_save import dcp_save_async, make_stager

        if getattr(self, "_stager", None) is None:
            self._stager = make_stager()  # kept: its host buffers are reused save after save
        write = dcp_save_async(self._state(), ckpt, pg, self._stager)
        return {"scheduler": self.sched.state_dict()}, write

    def load_targets(self) -> Any:
        """A resume's hook at its start (:class:`~pipeline.checkpoint.reuse.LoadTargets`, or
        None): nothing is named to read into (DCP reads into the engine's own tensors), but a
        requeued job's Adam moments are made here (:func:`adamw_state_for_load`) instead of
        by the load, so that their pages are faulted in while the ranks verify and DCP plans
        (~0.1 s with the disk idle) rather than against the load's reads: on a VM that faults
        new memory in from its host the two slow each other (development VM: dd of 1.6 GB and
        two processes faulting 536 MB each took 1.26-1.34 s at once, 0.96-1.28 s and 0.45 s
        alone). Measured there (134 M model, 2 ranks, each load in a new process, alternating
        with the previous code in one run, 6 pairs): 1.00-1.08 s (median 1.05) against
        1.03-1.30 s (median 1.18). Its undo drops them: an abandoned resume leaves the
        optimizer as it was, without state (uninitialized memory is no Adam state)."""
        from pipeline.checkpoint.reuse import LoadTargets

        if not adamw_state_for_load(self.opt):
            return None
        return LoadTargets({}, self.opt.state.clear, made=True)

    def load(self, ckpt: Path, extra: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from pipeline.checkpoint.tensors import dcp_load, read_dcp_metadata

        # Every rank reads the metadata through the allow-list first: a refusal is the same
        # clean error on all ranks, before any collective of the load. dcp_load reads it (and
        # the non-tensor entries) through the same allow-lists. After a resume's verification
        # the reader serves the bytes this rank verified from memory, the rest from disk.
        verified = extra.get("verified")
        fs = None
        if verified is not None:
            fs = verified.dcp_filesystem()
            verified.handed = True  # the moments load_targets made are the load's now
        read_dcp_metadata(ckpt / "dcp", fs)
        adamw_state_for_load(self.opt)  # a fresh engine's, unless load_targets made them
        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optim": osd}
        dcp_load(state, ckpt / "dcp", fs=fs)
        set_state_dict(
            self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        self.sched.load_state_dict(extra["scheduler"])

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        try:
            return self.model(input_ids=input_ids).logits.float()
        finally:
            self.model.train()


def _module_targets(engine: Any, targets: Any) -> None:
    """Add the module's weights to ``targets``: DeepSpeed's model states read straight into
    its flat buffers (the parameters are views of them, and ``torch.save`` wrote each flat
    buffer whole), all but this rank's own partition (``skip``), which ``fill`` copies from
    the fp32 master partition the load reads, as DeepSpeed's step does
    (``update_lp_params`` without its all-gather: the same bits). Where two ranks share the
    model-states file, each then reads the half the other one does not, O_DIRECT, instead
    of both mapping the whole file through the page cache (:mod:`pipeline.checkpoint.read`).
    Only where DeepSpeed restores its masters from the partition
    (``load_from_fp32_weights``) and the flat buffers are in host memory. Measured on the
    development VM (134 M model, 2 ranks, page cache dropped, each load in a new process,
    alternating with the mapped model states in one run, 6 pairs): 1.31-1.58 s (median 1.48)
    against 1.46-1.70 s (median 1.62)."""
    import torch.distributed as dist

    opt = engine.optimizer
    flats = getattr(opt, "bit16_groups_flat", None)
    parts = getattr(opt, "parallel_partitioned_bit16_groups", None)
    masters = opt.single_partition_of_fp32_groups
    if (not flats or parts is None or not engine.zero_load_from_fp32_weights()
            or any(f.device.type != "cpu" for f in flats)):
        return
    ranks = [dist.get_rank(group=g) for g in opt.real_dp_process_group]
    flat_storages = {f.untyped_storage().data_ptr() for f in flats}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if p.untyped_storage().data_ptr() in flat_storages:
            targets.tensors[("module", name)] = p.detach()
    for i, flat in enumerate(flats):
        own = parts[i][ranks[i]]
        lo = own.storage_offset() * own.element_size()
        targets.skip[flat.untyped_storage().data_ptr()] = (lo, lo + own.nbytes)

    def fill() -> None:
        for i, t in enumerate(masters):
            parts[i][ranks[i]].copy_(t)

    # regather: DeepSpeed's own copy-and-gather. Its copy (masters into this rank's partition)
    # changes nothing there: the undo, run before it, put the masters back from that partition,
    # which no read touched (or they never changed).
    targets.fill, targets.regather = fill, opt.update_lp_params


class DeepSpeedEngine:
    """The DeepSpeed engine with the rendered ``ds_config.json`` (ZeRO stage, offload, bf16).

    ``train.tp > 1``: AutoTP (the config's ``tensor_parallel.autotp_size``) shards the decoder
    layers' linears inside ``deepspeed.initialize``; the ranks of one TP group read the same
    batch. ``train.pp > 1``: the model becomes a ``PipelineModule`` (``pipeline.train.ds_pipe``)
    and a step is one ``train_batch`` over the step's micro batches.

    Rank layout: DeepSpeed builds its own groups, and they agree with
    ``pipeline.train.parallel.dp_coords`` (TP fastest, then DP, then PP): AutoTP's device mesh
    is ``(data_parallel, tensor_parallel)`` (rank = dp × tp + tp_rank) and the pipeline's
    ``PipeDataParallelTopology`` has axes ``(pipe, data)`` (rank = stage × dp + dp_rank)."""

    def __init__(self, model: Any, run: RunConfig, ds_config: dict[str, Any]) -> None:
        deepspeed = import_deepspeed()  # its JIT op loads safe from a killed process's lock

        t = run.train
        self.pp, self.tp = t.pp, t.tp
        self.vocab_size = model.config.vocab_size
        compile_decoder_layers(model, run)  # train.compile: before DeepSpeed's hooks
        if t.pp > 1:
            from pipeline.train.ds_pipe import pipeline_module

            module = pipeline_module(model, t.pp,
                                     activation_checkpointing=t.activation_checkpointing)
            self.engine, _, _, _ = deepspeed.initialize(
                model=module, model_parameters=[p for p in module.parameters()
                                                if p.requires_grad], config=ds_config)
            return
        if t.activation_checkpointing:
            _enable_activation_checkpointing(model)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        lr = self.engine.get_lr()[0]
        if self.pp > 1:
            loss = self._pipeline_step(micro_batches)
        else:
            total = 0.0
            for ids in micro_batches:
                ids = ids.to(self.engine.device)
                step_loss = self.engine(input_ids=ids, labels=ids).loss
                # DeepSpeed scales by 1/grad_accum and steps the optimizer at the boundary.
                self.engine.backward(step_loss)
                self.engine.step()
                total += step_loss.detach().float().item()
            loss = total / len(micro_batches)
        norm = self.engine.get_global_grad_norm()
        return StepResult(
            loss=loss,
            grad_norm=float(norm) if norm is not None else float("nan"),
            lr=lr,
        )

    def _pipeline_step(self, micro_batches: list[torch.Tensor]) -> float:
        # The first stage reads the inputs, the last the labels (the loss function shifts
        # them); every stage is handed the same list, as each rank's loader read it.
        data = [(ids.to(self.engine.device), ids.to(self.engine.device)) for ids in micro_batches]
        self.engine.train_batch(data_iter=iter(data))
        # This pipeline's mean over its micro batches (the last stage's, broadcast to the
        # other stages); the trainer averages it over the data-parallel pipelines.
        return float(self.engine.dp_group_loss)

    def save(self, ckpt: Path) -> dict[str, Any]:
        from pipeline.checkpoint import fastio

        # DeepSpeed writes every file through its checkpoint engine's save(): route those
        # through fastio's O_DIRECT writer (checksummed, fsynced), as FastPersist does with aio.
        digests = fastio.Digests()
        ce = self.engine.checkpoint_engine
        serialization = getattr(ce, "zipfile_serialization", False)
        ce.save = lambda state_dict, path: fastio.torch_save(
            state_dict, path, digests, _use_new_zipfile_serialization=serialization)
        try:
            with fastio.no_torch_crc32():
                self.engine.save_checkpoint(str(ckpt), tag="ds", save_latest=False)
        finally:
            del ce.save  # back to the class's method
        return {"digests": digests.relative_to(ckpt)}

    def save_async(self, ckpt: Path, pg: Any) -> tuple[dict[str, Any], Any]:
        """``save_checkpoint`` with the checkpoint engine's ``save`` staging host copies; the
        files are written in the background (``pipeline.checkpoint.async_save.BackgroundWriter``)."""
        from pipeline.checkpoint.async_save import BackgroundWriter, make_stager

        if getattr(self, "_writer", None) is None:
            ce = self.engine.checkpoint_engine
            self._writer = BackgroundWriter(make_stager(),
                                            getattr(ce, "zipfile_serialization", False))
        ce = self.engine.checkpoint_engine
        ce.save = self._writer.stage
        try:
            self.engine.save_checkpoint(str(ckpt), tag="ds", save_latest=False)
        finally:
            del ce.save  # back to the class's method
        return {}, self._writer.start(ckpt)

    def load_targets(self) -> Any:
        """What a resume may read this rank's optimizer partition into instead of fresh memory
        (ZeRO 1-2, :class:`~pipeline.checkpoint.reuse.LoadTargets`; None otherwise): the fp32
        master partitions and Adam's moments, which the load replaces, by their place in the
        partition's file (``optimizer_state_dict`` of DeepSpeed's ``_save_zero_checkpoint``;
        the base optimizer's state as ``torch.optim``'s ``state_dict`` numbers it). Its undo
        puts back the start-up values: the masters from the module's weights, as DeepSpeed
        builds them, and zero moments.

        A requeued job's engine has no moments yet (the base optimizer makes them at its first
        step): in pure data parallel they are made here, uninitialized
        (:func:`adamw_state_for_load`), and their pages faulted in from the load's start on,
        overlapping its first reads (the model states' check), so the partition is read into
        them as into the masters and DeepSpeed keeps them as its state.
        Uninitialized is safe: the load replaces the whole state or is abandoned, and then the
        undo drops what was made here (``LoadTargets.made``). Measured on the development VM
        (134 M model, 2 ranks, each load in a new process, alternating in one run, 5 pairs):
        0.57-0.78x ``dd`` (median 0.61) against 0.40-0.76x (median 0.46) with the moments made
        by the partition's unpickling, its pages faulted in from there in one piece."""
        import torch.distributed as dist

        from pipeline.checkpoint.reuse import LoadTargets

        opt = self.engine.optimizer
        masters = getattr(opt, "single_partition_of_fp32_groups", None)
        inner = getattr(opt, "optimizer", None)
        if masters is None or inner is None or getattr(opt, "elastic_checkpoint", True):
            return None  # an elastic checkpoint keeps the moments per group, unpadded
        # Made only where the partition's layout is the one read into (pure data parallel, the
        # resume test counts the tensors read into): a pipeline's files are read into fresh
        # memory (none claimed), and moments made for them would only double the memory.
        made = self.pp == 1 and self.tp == 1 and adamw_state_for_load(inner)
        root = ("optimizer_state_dict",)
        tensors = {(*root, "single_partition_of_fp32_groups", i): t for i, t in enumerate(masters)}
        moments = []
        index = 0
        for group in inner.param_groups:
            for p in group["params"]:
                for key, v in inner.state.get(p, {}).items():
                    if key != "step" and isinstance(v, torch.Tensor):
                        tensors[(*root, "base_optimizer_state", "state", index, key)] = v
                        moments.append(v)
                index += 1

        def undo() -> None:
            for i, t in enumerate(masters):
                rank = dist.get_rank(group=opt.real_dp_process_group[i])
                t.copy_(opt.parallel_partitioned_bit16_groups[i][rank])
            if made:
                inner.state.clear()  # as it was: no state until the first step
                return
            for v in moments:
                v.zero_()

        targets = LoadTargets(tensors, undo, made=made)
        if self.pp == 1 and self.tp == 1:
            _module_targets(self.engine, targets)
        return targets

    def load(self, ckpt: Path, extra: dict[str, Any]) -> None:
        from pipeline.checkpoint.tensors import check_ds_files, load_ds_file_for_engine

        # DeepSpeed's checkpoint engine loads with weights_only=False: every rank checks every
        # file's globals against the allow-list first (the same answer on all ranks), and the
        # engine's load goes through weights_only=True with DeepSpeed's few classes.
        # After a resume's verification (``extra["verified"]``) the ranks have checked every
        # file's globals already, and the engine reads the bytes this rank verified from memory.
        universal = extra.get("universal")
        if universal is not None:
            self._load_universal(Path(universal))
            return
        verified = extra.get("verified")
        if verified is None:
            check_ds_files(ckpt / "ds")
        ce = self.engine.checkpoint_engine
        ce.load = load_ds_file_for_engine if verified is None else verified.ds_loader()
        try:
            path, _ = self.engine.load_checkpoint(
                str(ckpt), tag="ds", load_optimizer_states=True, load_lr_scheduler_states=True
            )
        finally:
            del ce.load  # back to the class's method
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {ckpt}")
        targets = getattr(verified, "targets", None)
        if targets is not None and targets.skipped and targets.fill is not None:
            with torch.no_grad():  # this rank's partition of the weights, left unread
                targets.fill()

    def _load_universal(self, folder: Path) -> None:
        """Another world size: DeepSpeed's universal checkpoint (``pipeline.checkpoint.universal``
        converted and verified it), loaded with ``load_universal`` switched on for this load only;
        DeepSpeed's readers go through the allow-listed ``torch.load``."""
        from pipeline.checkpoint.tensors import load_ds_file_for_engine
        from pipeline.checkpoint.universal import TAG, safe_torch_load

        cfg = self.engine._config
        ce = self.engine.checkpoint_engine
        ce.load = load_ds_file_for_engine
        cfg.load_universal_checkpoint = True
        try:
            with safe_torch_load():
                path, _ = self.engine.load_checkpoint(
                    str(folder), tag=TAG, load_optimizer_states=True,
                    load_lr_scheduler_states=True)
        finally:
            cfg.load_universal_checkpoint = False
            del ce.load
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the universal checkpoint {folder}")

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The full model's logits (collective). With a pipeline the last stage has them;
        rank 0 (first stage) receives those of data-parallel replica 0 by a broadcast."""
        if self.pp > 1:
            from pipeline.train.ds_pipe import pipeline_logits

            return pipeline_logits(self.engine, input_ids, self.vocab_size)
        self.engine.eval()
        try:
            return self.engine(input_ids=input_ids.to(self.engine.device)).logits.float()
        finally:
            self.engine.train()
