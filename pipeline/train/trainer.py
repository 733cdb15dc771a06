"""The trainer run by every rank under ``torchrun`` (torchtitan's shape): build → train → close.

:class:`Trainer` builds the device, the process group, the parallel layout and its device mesh
(``pipeline.train.parallel``), the model and its engine, the data loader, the checkpoint
manager (``pipeline.checkpoint.format``) and rank 0's recorder; ``train()`` runs ``train_step()`` until
``train.max_steps`` or an agreed stop; ``close()`` tears down whatever was built. What it leaves
in the run dir is spelled in ``pipeline.artifacts``.

Exit codes (``pipeline.artifacts``): ``EXIT_OK`` finished (``train.done`` written);
``EXIT_REQUEUE`` stopped on request after a complete checkpoint (the launcher requeues);
anything else failed.

Fault injection for tests: ``ZEROSNAKE_FAULT_NAN_AT_STEP=N`` makes step N's loss read as NaN
(a diverging run on demand: ``train.lr`` is at most 1, and no legal rate diverges at a known
step).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.artifacts import (
    DATA_MANIFEST,
    DS_CONFIG,
    EXIT_OK,
    EXIT_REQUEUE,
    LOCK,
    PROBE_LOGITS,
    RUN_CONFIG,
    STOP,
    STOPPED,
    read_artifact,
    write_train_done,
)
from pipeline.checkpoint import format as ck
from pipeline.checkpoint.manager import CheckpointManager
from pipeline.cluster.env import ATTEMPT_ENV, RankEnv
from pipeline.config.files import load_run_config
from pipeline.config.schema import RunConfig
from pipeline.errors import PipelineError
from pipeline.io import sha256_file, write_json_atomic
from pipeline.model.build import build_model, device_peak_flops, model_flops_per_token
from pipeline.train.parallel import build_mesh, dp_coords, parallel_dims, reports_loss
from pipeline.train.recorder import Recorder

log = logging.getLogger("pipeline.train")

NAN_AT_STEP_ENV = "ZEROSNAKE_FAULT_NAN_AT_STEP"


class StopRequest:
    """A stop flag set by SIGUSR2 (Slurm's time-limit warning, when delivered to the ranks) or
    by a ``STOP`` file in the run dir (how the node task bridges the warning: torchrun forwards
    only TERM/INT/HUP/QUIT to its workers).

    Every step the ranks OR their flags with one all-reduce, so they all stop at the same step.
    SIGTERM keeps its default (die): torchrun uses it to tear down the other ranks when one
    fails, and a rank that ignored it would hang in a collective with the dead peer.
    """

    def __init__(self, run_dir: Path) -> None:
        self.flag = False
        self.file = run_dir / STOP
        signal.signal(signal.SIGUSR2, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.flag = True

    def agreed(self, device: torch.device) -> bool:
        local = self.flag or self.file.exists()
        t = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def select_device(run: RunConfig, env: RankEnv) -> torch.device:
    """This rank's device: its local GPU (``cluster.device`` cuda, or auto with one), else cpu."""
    want = run.cluster.device
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and visible < env.local_world_size:
        raise PipelineError(
            f"cluster.device is cuda with {env.local_world_size} process(es) on this node "
            f"(cluster.gpus_per_node) but {visible} GPU(s) are visible to them: lower "
            "cluster.gpus_per_node, or make the GPUs visible (CUDA_VISIBLE_DEVICES)")
    if want == "cuda" or (want == "auto" and visible >= env.local_world_size):
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    if want == "auto" and visible:  # e.g. the default's 2 processes on a 1-GPU workstation
        log.warning("cluster.device auto: %d GPU(s) for %d processes on this node: training "
                    "on the CPU (set cluster.gpus_per_node: %d to use them)", visible,
                    env.local_world_size, visible)
    return torch.device("cpu")


def hold_run_lock(run_dir: Path) -> Any:
    """Rank 0 holds an exclusive lock on the run dir while it trains: a second trainer on the
    same run (a restarted Snakemake while an orphaned job still runs) fails instead of
    interleaving checkpoints. The kernel drops the lock when the process dies."""
    import fcntl

    f = (run_dir / LOCK).open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise PipelineError(
            f"another training process holds {run_dir / LOCK}: this run is already "
            "training; wait for it (the launcher does), or stop it first"
        ) from None
    return f


def peak_mem_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocated on the GPU, else the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    # ru_maxrss is KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def local_param_count(engine: Any) -> int:
    """Parameters this rank holds: local shards of DTensors (FSDP2, TP), DeepSpeed's partition
    of a ZeRO-3 parameter (``ds_numel`` is the whole; ``ds_tensor`` the rank's part)."""
    model = getattr(engine, "model", None)
    if model is None:
        model = engine.engine.module
    total = 0
    for p in model.parameters():
        if hasattr(p, "to_local"):
            total += p.to_local().numel()
        elif hasattr(p, "ds_tensor"):
            total += p.ds_tensor.numel()
        else:
            total += p.numel()
    return total


class Trainer:
    """One rank's training of one rendered run.

    ``Trainer(run_dir, data_dir)`` reads the config and picks the device (no collective);
    :meth:`build` starts the process group and builds the rest; :meth:`train` returns the exit
    code; :meth:`close` tears down what was built (call it in a ``finally``; :func:`run` does).
    """

    def __init__(self, run_dir: Path, data_dir: Path) -> None:
        self.run_dir = run_dir
        self.data_dir = data_dir
        self.run = load_run_config(run_dir / RUN_CONFIG)
        self.env = RankEnv.from_env()
        self.device = select_device(self.run, self.env)
        self.dist_backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.dims = parallel_dims(self.run)
        self.mesh: Any = None  # the world DeviceMesh (fsdp; DeepSpeed builds its own groups)
        self.rec: Recorder | None = None
        self.lock: Any = None
        self.samples: Any = None
        self.state = ck.TrainerState()

    # --- build -------------------------------------------------------------------------------

    def build(self) -> None:
        """Process group, layout check, recorder and lock, then model, engine, data and the
        checkpoint manager; resumes from the newest valid checkpoint."""
        from pipeline.data.loader import BatchLoader, PackedDataset

        dist.init_process_group(backend=self.dist_backend)
        self._check_layout()
        t, env = self.run.train, self.env
        self.rec = Recorder(self.run_dir, env.rank, self.run)
        self.lock = hold_run_lock(self.run_dir) if env.rank == 0 else None
        dataset = PackedDataset(self.data_dir, split="train")
        tok = dataset.manifest["tokenizer"]
        model = build_model(self.run.model, vocab_size=tok["vocab_size"], eos_id=tok["eos_id"],
                            bos_id=tok.get("bos_id"), seed=t.seed)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = model_flops_per_token(model, self.run.data.seq_len)
        self.engine = self._build_engine(model)
        self.reports_loss = reports_loss(self.dims, env.rank)
        # What each rank holds of the model (its local shards): the planner's per-rank count,
        # checked against the engines in the tests.
        shards = [0] * env.world_size
        dist.all_gather_object(shards, local_param_count(self.engine))
        self.layout = {"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp,
                       "param_shards": shards, "device": str(self.device),
                       # which GPUs the launcher let this rank see (None: not restricted)
                       "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        dp_rank, dp_size = dp_coords(self.dims, env.rank)
        self.loader = BatchLoader(dataset, micro_batch_size=t.micro_batch_size, dp_rank=dp_rank,
                                  dp_size=dp_size, seed=t.seed, mixture=t.mixture,
                                  on_exhausted=t.on_source_exhausted)
        self.ckpt = CheckpointManager.for_run(
            self.run_dir, self.run, data_hash=sha256_file(self.data_dir / DATA_MANIFEST),
            rank=env.rank, world_size=env.world_size)
        self._resume()
        log.info("rank %d: starting at step %d of %d", env.rank, self.state.step, t.max_steps)
        self.stop = StopRequest(self.run_dir)
        # Audit trail of the data order (which global sequence indices each rank consumed).
        if t.record_samples:
            self.samples = (self.run_dir / f"samples-rank{env.rank:05d}.jsonl").open(
                "a", buffering=1)
        self.peak_flops, why = device_peak_flops(self.device, t.precision)
        if self.peak_flops is None:  # metrics carry mfu: null; this says why, once per attempt
            self.rec.event("mfu", mfu=None, reason=why)
        self.tokens_per_step = self.run.global_batch_size * self.run.data.seq_len

    def _check_layout(self) -> None:
        world = dist.get_world_size()
        if world != self.run.world_size:
            raise PipelineError(
                f"launched with {world} processes, but the plan has "
                f"{self.run.world_size} (cluster.nodes × cluster.gpus_per_node); re-render the run"
            )
        # Which layouts an engine runs is checked by the config (TrainConfig), before launch.

    def _build_engine(self, model: Any) -> Any:
        t = self.run.train
        if t.backend == "deepspeed":
            from pipeline.train.engines import DeepSpeedEngine

            # DeepSpeed builds its own groups (it takes sizes, not a DeviceMesh): pure DP here.
            ds_config = read_artifact(self.run_dir / DS_CONFIG, "DeepSpeed config",
                                      hint="render the run again")
            return DeepSpeedEngine(model, self.run, ds_config)
        if t.backend == "ddp":
            from pipeline.train.ddp import DDPEngine

            # DistributedDataParallel over the default group: pure DP, no mesh needed.
            return DDPEngine(model, self.run, self.device)
        self.mesh = build_mesh(self.dims, self.device.type, t.fsdp_sharding)
        if self.dims.pp > 1:
            from pipeline.train.pp import PipelineEngine

            return PipelineEngine(model, self.run, self.device, mesh=self.mesh)
        from pipeline.train.engines import FSDPEngine

        return FSDPEngine(model, self.run, self.device, mesh=self.mesh)

    def _resume(self) -> None:
        assert self.rec is not None
        path = self.ckpt.resume(reuse=getattr(self.engine, "load_targets", None))
        if path is None:
            self.rec.event("start", resumed_from=0, checkpoint=None, **self.layout)
            return
        t_load = time.perf_counter()
        self.state = self.ckpt.load(path, self.engine, self.loader)
        assert self.ckpt.loaded is not None
        self.rec.event("load", step=self.state.step, seconds=time.perf_counter() - t_load,
                       read_into_engine=self.ckpt.read_into_engine)
        self.rec.event("start", resumed_from=self.state.step, checkpoint=self.ckpt.loaded.name,
                       **self.layout)

    # --- train -------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum`` micro batches; returns (and records) its
        metrics. Raises on a non-finite loss (nothing saved: the last good checkpoint stays)."""
        assert self.rec is not None
        state, world = self.state, self.env.world_size
        t0 = time.perf_counter()
        batches = [self.loader.next_batch() for _ in range(self.run.train.grad_accum)]
        micro = [b["input_ids"].to(self.device) for b in batches]
        if self.samples is not None:
            self.samples.write(json.dumps(
                {"step": state.step + 1, "indices": [int(i) for b in batches for i in b["indices"]]}
            ) + "\n")
        res = self.engine.train_step(micro)
        # The mean over the data-parallel ranks: the ranks of one TP group computed the same
        # loss on the same batch, and only the last pipeline stage has it, so only those
        # groups' first ranks contribute (gloo has no AVG).
        loss = torch.tensor([res.loss if self.reports_loss else 0.0], device=self.device)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        mean_loss = loss.item() / self.dims.dp
        state.step += 1
        if os.environ.get(NAN_AT_STEP_ENV) == str(state.step):
            mean_loss = math.nan
        state.tokens_seen += self.tokens_per_step
        dt = time.perf_counter() - t0
        if not math.isfinite(mean_loss):
            self.rec.event("nan", step=state.step)
            raise PipelineError(
                f"loss is {mean_loss} at step {state.step}; stopping without saving. The last "
                f"good checkpoint is kept in {self.ckpt.root}. Lower train.lr or check the data."
            )
        tps = self.tokens_per_step / dt
        rec = {
            "step": state.step,
            "time": time.time(),
            "loss": mean_loss,
            "lr": res.lr,
            "grad_norm": res.grad_norm,
            "tokens_seen": state.tokens_seen,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "mfu": (None if self.peak_flops is None
                    else tps * self.flops_per_token / (self.peak_flops * world)),
            "peak_mem_gb": peak_mem_gb(self.device),
        }
        # Engine-specific fields (ddp fp16: loss_scale, scaler_skipped, skipped_steps).
        extra = getattr(self.engine, "step_metrics", None)
        if extra is not None:
            rec.update(extra())
        self.rec.step(rec)
        return rec

    def save(self) -> None:
        """Collective: a checkpoint of the current step (loader state included)."""
        assert self.rec is not None
        self.state.loader = self.loader.state_dict()
        t_save = time.perf_counter()
        self.rec.heartbeat.beat(self.state.step, "save")  # the watchdog's save allowance
        # In the background (train.checkpoint_async), this waits for the previous save, if it
        # is still in flight, and stages; ``seconds`` is what training waited either way.
        committed = self.ckpt.inflight
        self.ckpt.save(self.engine, self.state)
        if committed is not None and self.ckpt.inflight is not committed:
            self._committed(committed.step, committed.future.result())
        self.rec.heartbeat.beat(self.state.step, "train")  # saved: back to the step timeout
        self.rec.event("save", step=self.state.step, seconds=time.perf_counter() - t_save,
                       background=self.ckpt.inflight is not None)

    def wait_for_save(self) -> None:
        """Collective: the save in flight committed (before a stop, train.done or the end)."""
        assert self.rec is not None
        if self.ckpt.inflight is not None:
            t0 = time.perf_counter()
            self.rec.heartbeat.beat(self.state.step, "save")
            done = self.ckpt.wait()
            assert done is not None
            self._committed(*done)
            self.rec.event("save_wait", step=done[0], seconds=time.perf_counter() - t0)

    def _committed(self, step: int, seconds: float) -> None:
        assert self.rec is not None
        self.rec.event("save_commit", step=step, seconds=seconds)

    def train(self) -> int:
        """Steps until ``train.max_steps`` (then the probe and ``train.done``: ``EXIT_OK``) or
        an agreed stop request (a checkpoint, ``stopped.json``: ``EXIT_REQUEUE``)."""
        assert self.rec is not None
        t, state = self.run.train, self.state
        max_steps = self.loader.last_step(t.max_steps, t.grad_accum)  # on_source_exhausted: stop
        first = True
        while state.step < max_steps:
            self.train_step()
            if first and t.compile:
                self._record_compiled()
            first = False
            done = self.ckpt.poll()  # a background save that finished meanwhile
            if done is not None:
                self._committed(*done)
            stopping = self.stop.agreed(self.device)
            if stopping or state.step % t.checkpoint_every == 0 or state.step == max_steps:
                self.save()
            if stopping and state.step < max_steps:
                self.wait_for_save()  # the requeued job resumes from this very checkpoint
                self.rec.event("stop", step=state.step)
                if self.env.rank == 0:
                    write_json_atomic(self.run_dir / STOPPED, {
                        "step": state.step, "attempt": os.environ.get(ATTEMPT_ENV)})
                return EXIT_REQUEUE
        self.finish()
        return EXIT_OK

    def _record_compiled(self) -> None:
        """Collective: each rank's count of compiled graphs after its first step (train.compile
        on every layout, pipeline stages included, must have run compiled code: > 0)."""
        from pipeline.train.compile import compiled_graphs

        assert self.rec is not None
        graphs = [0] * self.env.world_size
        dist.all_gather_object(graphs, compiled_graphs())
        self.rec.event("compile", step=self.state.step, graphs=graphs)

    def finish(self) -> None:
        """After the last step: the probe logits, then (rank 0) ``train.done``."""
        assert self.rec is not None
        self.wait_for_save()  # train.done names the last checkpoint: it must be committed
        self.write_probe()
        if self.env.rank == 0:
            (self.run_dir / STOP).unlink(missing_ok=True)
            (self.run_dir / STOPPED).unlink(missing_ok=True)
            write_train_done(self.run_dir, {
                "step": self.state.step, "tokens_seen": self.state.tokens_seen,
                "checkpoint": self.ckpt.step_dir(self.state.step).name, "params": self.n_params,
                "tokens_by_source": self.loader.tokens_by_source(),
            })
        self.rec.event("finish", step=self.state.step)

    def write_probe(self) -> None:
        """Logits of the final model on a fixed validation batch: consolidation's reference."""
        from safetensors.torch import save_file

        from pipeline.data.loader import PackedDataset

        val = PackedDataset(self.data_dir, split="validation")
        n = min(2, len(val))
        ids = torch.stack([torch.from_numpy(val[i].astype("int64")) for i in range(n)])
        ids = ids.to(self.device)
        logits = self.engine.logits(ids)
        if self.env.rank == 0:
            save_file(
                {"input_ids": ids.cpu().contiguous(), "logits": logits.cpu().contiguous()},
                str(self.run_dir / PROBE_LOGITS),
            )

    # --- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Recorder, sample log, process group, then the run lock (safe after a failed build)."""
        # Training is over: a time-limit warning arriving now has nothing to stop. Ignored, not
        # handled: Python's shutdown puts handled signals back to their default (terminate), and
        # a warning landing in that window killed a finished rank (rc 1, a needless requeue).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None and ckpt.inflight is not None:
            # Ending on an error with a save in flight: finish it if the other ranks do too
            # (it is a good checkpoint); its own failure must not hide the error in flight.
            try:
                ckpt.wait()
            except Exception as err:
                log.warning("rank %d: the checkpoint in flight was not saved: %s",
                            self.env.rank, err)
        if self.rec is not None:
            self.rec.close()
        if self.samples is not None:
            self.samples.close()
            self.samples = None
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.lock is not None:
            self.lock.close()
            self.lock = None


def run(run_dir: Path, data_dir: Path) -> int:
    """Train one run; returns the process exit code."""
    trainer = Trainer(run_dir, data_dir)
    try:
        trainer.build()
        return trainer.train()
    finally:
        trainer.close()
