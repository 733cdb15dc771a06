"""The training loop run by every rank under ``torchrun``: parse → build → train → teardown.

Exit codes: 0 finished (``train.done`` written); ``EXIT_REQUEUE`` stopped on request after a
complete checkpoint (the launcher requeues); anything else failed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline import checkpoint as ck
from pipeline.config import RunConfig, load_run_config
from pipeline.distenv import RankEnv
from pipeline.errors import PipelineError
from pipeline.io import read_json, sha256_file, sha256_json, write_json_atomic
from pipeline.model import build_model, flops_per_token, peak_flops

log = logging.getLogger("pipeline.train")

#: "Stopped at a checkpoint on request; requeue me" (EX_TEMPFAIL from sysexits.h).
EXIT_REQUEUE = 75
STOP_FILE = "STOP"


def config_hash(run: RunConfig) -> str:
    """Hash of what determines the trained model: not bookkeeping (checkpoint cadence) and not
    the layout (nodes, processes, micro batch × accumulation), so that a run can resume on
    another world size with the same global batch."""
    d = run.model_dump(mode="json")
    for key in ("checkpoint_every", "keep_last", "micro_batch_size", "grad_accum",
                "global_batch_size", "record_samples"):
        d["train"].pop(key, None)
    d["cluster"] = None
    d["plan"] = None
    d["global_batch_size"] = run.global_batch_size
    return sha256_json(d)


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
        self.file = run_dir / STOP_FILE
        signal.signal(signal.SIGUSR2, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.flag = True

    def agreed(self, device: torch.device) -> bool:
        local = self.flag or self.file.exists()
        t = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def _device(run: RunConfig, env: RankEnv) -> torch.device:
    want = run.cluster.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise PipelineError("cluster.device is cuda but no GPU is visible to this process")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


class _Recorder:
    """Rank 0's logs: metrics.jsonl (one line per step), events.jsonl, and TensorBoard (tb/)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.on = rank == 0
        self.metrics = run_dir / "metrics.jsonl"
        self.events = run_dir / "events.jsonl"
        self.attempt = 1
        self.tb = None
        if self.on and self.events.exists():
            self.attempt += sum(
                1 for line in self.events.read_text().splitlines() if '"event": "start"' in line
            )
        if self.on:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional for the loop; metrics.jsonl is not
                log.warning("tensorboard is not installed: writing metrics.jsonl only")
            else:
                self.tb = SummaryWriter(str(run_dir / "tb"))

    def _append(self, path: Path, rec: dict[str, Any]) -> None:
        if self.on:
            with path.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    def event(self, name: str, **kw: Any) -> None:
        self._append(self.events, {"event": name, "attempt": self.attempt, "time": time.time(), **kw})

    def step(self, rec: dict[str, Any]) -> None:
        self._append(self.metrics, {**rec, "attempt": self.attempt})
        if self.tb is not None:
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"train/{key}", value, rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def run(run_dir: Path, data_dir: Path) -> int:
    """Train one run; returns the process exit code."""
    from pipeline.data import BatchLoader, PackedDataset

    run_cfg = load_run_config(run_dir / "config.json")
    t = run_cfg.train
    env = RankEnv.from_env()
    device = _device(run_cfg, env)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    rec: _Recorder | None = None
    try:
        if dist.get_world_size() != run_cfg.world_size:
            raise PipelineError(
                f"launched with {dist.get_world_size()} processes, but the plan has "
                f"{run_cfg.world_size} (cluster.nodes × cluster.gpus_per_node); re-render the run"
            )
        rec = _Recorder(run_dir, env.rank)
        lock = _hold_run_lock(run_dir) if env.rank == 0 else None  # noqa: F841 (held until exit)
        dataset = PackedDataset(data_dir, split="train")
        manifest = dataset.manifest
        data_hash = sha256_file(data_dir / "manifest.json")
        tok = manifest["tokenizer"]
        model = build_model(
            run_cfg.model,
            vocab_size=tok["vocab_size"],
            eos_id=tok["eos_id"],
            bos_id=tok.get("bos_id"),
            seed=t.seed,
        )
        n_params = sum(p.numel() for p in model.parameters())
        fpt = flops_per_token(
            n_params, run_cfg.model.num_layers, run_cfg.model.hidden_size, run_cfg.data.seq_len
        )
        if t.backend == "deepspeed":
            from pipeline.train.engines import DeepSpeedEngine

            engine: Any = DeepSpeedEngine(model, run_cfg, read_json(run_dir / "ds_config.json"))
        else:
            from pipeline.train.engines import FSDPEngine

            engine = FSDPEngine(model, run_cfg, device)

        loader = BatchLoader(
            dataset,
            micro_batch_size=t.micro_batch_size,
            dp_rank=env.rank,
            dp_size=env.world_size,
            seed=t.seed,
        )
        state = ck.TrainerState()
        root = run_dir / "checkpoints"
        chash = config_hash(run_cfg)
        found = None
        if env.rank == 0:
            ck.clean_tmp(root)
            found = _resumable(root, chash, data_hash)
        box = [None if found is None else str(found[1])]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            path = Path(box[0])
            saved_world = read_json(path / ck.MANIFEST).get("world_size")
            if t.backend == "deepspeed" and saved_world != env.world_size:
                raise PipelineError(
                    f"checkpoint {path} was saved by {saved_world} DeepSpeed ranks, this job has "
                    f"{env.world_size}: ZeRO partitions do not reshard on load. Convert it with "
                    f"`python -m deepspeed.checkpoint.ds_to_universal --input_folder {path}/ds "
                    "--output_folder <dir>` and load that (DeepSpeed's universal checkpoint), "
                    f"or run on {saved_world} processes; fsdp runs reshard automatically"
                )
            trainer = ck.TrainerState.from_json(read_json(path / "trainer.json"))
            t_load = time.perf_counter()
            engine.load(path, {"scheduler": trainer.scheduler})
            loader.load_state_dict(trainer.loader)
            if saved_world == env.world_size:
                ck.load_rng(path, env.rank)
            state = trainer
            rec.event("load", step=state.step, seconds=time.perf_counter() - t_load)
            rec.event("start", resumed_from=state.step, checkpoint=path.name)
        else:
            rec.event("start", resumed_from=0, checkpoint=None)
        log.info("rank %d: starting at step %d of %d", env.rank, state.step, t.max_steps)

        stop = StopRequest(run_dir)
        # Audit trail of the data order (which global sequence indices each rank consumed).
        samples = (
            (run_dir / f"samples-rank{env.rank:05d}.jsonl").open("a", buffering=1)
            if t.record_samples
            else None
        )
        peak = peak_flops(device)
        tokens_per_step = run_cfg.global_batch_size * run_cfg.data.seq_len
        while state.step < t.max_steps:
            t0 = time.perf_counter()
            batches = [loader.next_batch() for _ in range(t.grad_accum)]
            micro = [b["input_ids"].to(device) for b in batches]
            if samples is not None:
                samples.write(json.dumps(
                    {"step": state.step + 1, "indices": [int(i) for b in batches for i in b["indices"]]}
                ) + "\n")
            res = engine.train_step(micro)
            loss = torch.tensor([res.loss], device=device)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG if backend == "nccl" else dist.ReduceOp.SUM)
            mean_loss = loss.item() if backend == "nccl" else loss.item() / env.world_size
            state.step += 1
            state.tokens_seen += tokens_per_step
            dt = time.perf_counter() - t0
            if not math.isfinite(mean_loss):
                rec.event("nan", step=state.step)
                raise PipelineError(
                    f"loss is {mean_loss} at step {state.step}; stopping without saving. The last "
                    f"good checkpoint is kept in {root}. Lower train.lr or check the data."
                )
            tps = tokens_per_step / dt
            rec.step(
                {
                    "step": state.step,
                    "time": time.time(),
                    "loss": mean_loss,
                    "lr": res.lr,
                    "grad_norm": res.grad_norm,
                    "tokens_seen": state.tokens_seen,
                    "tokens_per_s": tps,
                    "step_time_s": dt,
                    "mfu": None if peak is None else tps * fpt / (peak * env.world_size),
                    "peak_mem_gb": _peak_mem_gb(device),
                }
            )
            stopping = stop.agreed(device)
            if stopping or state.step % t.checkpoint_every == 0 or state.step == t.max_steps:
                state.loader = loader.state_dict()
                t_save = time.perf_counter()
                _save(engine, root, state, run_cfg, chash, data_hash, env)
                rec.event("save", step=state.step, seconds=time.perf_counter() - t_save)
            if stopping and state.step < t.max_steps:
                rec.event("stop", step=state.step)
                if env.rank == 0:
                    write_json_atomic(run_dir / "stopped.json", {"step": state.step})
                return EXIT_REQUEUE

        _write_probe(engine, data_dir, run_dir, env, device)
        if env.rank == 0:
            (run_dir / STOP_FILE).unlink(missing_ok=True)
            (run_dir / "stopped.json").unlink(missing_ok=True)
            write_json_atomic(
                run_dir / "train.done",
                {"step": state.step, "tokens_seen": state.tokens_seen, "checkpoint":
                 ck.step_dir(root, state.step).name, "params": n_params},
            )
        rec.event("finish", step=state.step)
        return 0
    finally:
        if rec is not None:
            rec.close()
        if dist.is_initialized():
            dist.destroy_process_group()


LOCK_FILE = "train.lock"


def _hold_run_lock(run_dir: Path) -> Any:
    """Rank 0 holds an exclusive lock on the run dir while it trains: a second trainer on the
    same run (a restarted Snakemake while an orphaned job still runs) fails instead of
    interleaving checkpoints. The kernel drops the lock when the process dies."""
    import fcntl

    f = (run_dir / LOCK_FILE).open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise PipelineError(
            f"another training process holds {run_dir / LOCK_FILE}: this run is already "
            "training; wait for it (the launcher does), or stop it first"
        ) from None
    return f


def _peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    # ru_maxrss is KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def _resumable(root: Path, chash: str, data_hash: str) -> tuple[int, Path] | None:
    """The checkpoint to resume from, if any. Checkpoints of another config are moved aside (Snakemake reruns a run whose config
    changed: it must start fresh, not resume the old experiment). Checkpoints over other data
    are an error: resuming would silently mix datasets."""
    found = ck.latest_valid(root)
    if found is None:
        return None
    meta = read_json(found[1] / ck.MANIFEST)
    if meta.get("data_manifest_sha256") != data_hash:
        raise PipelineError(
            f"the checkpoints in {root} were trained on another tokenized dataset "
            f"(data manifest {meta.get('data_manifest_sha256', '?')[:12]}, now "
            f"{data_hash[:12]}); delete {root} to start over, or use a new run name"
        )
    if meta.get("config_hash") != chash:
        dest = root.with_name(f"checkpoints.old-{meta.get('config_hash', 'unknown')[:12]}")
        log.warning("config changed since %s: moving old checkpoints to %s", found[1], dest)
        if dest.exists():
            import shutil

            shutil.rmtree(dest)
        os.replace(root, dest)
        return None
    return found


def _save(
    engine: Any,
    root: Path,
    state: ck.TrainerState,
    run_cfg: RunConfig,
    chash: str,
    data_hash: str,
    env: RankEnv,
) -> None:
    tmp = ck.tmp_dir(root, state.step)
    if env.rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    extra = engine.save(tmp)
    state.scheduler = extra.get("scheduler")
    ck.save_rng(tmp, env.rank)
    if env.rank == 0:
        write_json_atomic(tmp / "trainer.json", state.to_json())
    # Every rank's files are on disk (fsynced by the writer) before the manifest vouches for
    # them; the checksums taken while writing travel to rank 0 with this gather.
    digests: list[Any] | None = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(extra.get("digests", {}), digests, dst=0)
    if env.rank == 0:
        assert digests is not None
        known = {k: v for d in digests for k, v in (d or {}).items()}
        ck.finalize(
            root,
            state.step,
            {
                "backend": run_cfg.train.backend,
                "zero_stage": run_cfg.train.zero_stage if run_cfg.train.backend == "deepspeed" else None,
                "world_size": env.world_size,
                "config_hash": chash,
                "data_manifest_sha256": data_hash,
                "tokens_seen": state.tokens_seen,
            },
            run_cfg.train.keep_last,
            known,
        )
    dist.barrier()


def _write_probe(engine: Any, data_dir: Path, run_dir: Path, env: RankEnv, device: torch.device) -> None:
    """Logits of the final model on a fixed validation batch: the consolidation check's reference."""
    from safetensors.torch import save_file

    from pipeline.data import PackedDataset

    val = PackedDataset(data_dir, split="validation")
    n = min(2, len(val))
    ids = torch.stack([torch.from_numpy(val[i].astype("int64")) for i in range(n)]).to(device)
    logits = engine.logits(ids)
    if env.rank == 0:
        save_file(
            {"input_ids": ids.cpu().contiguous(), "logits": logits.cpu().contiguous()},
            str(run_dir / "probe_logits.safetensors"),
        )


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m pipeline.train worker",
        description="One training process (started by torchrun on every rank).",
    )
    p.add_argument("--run-dir", type=Path, required=True, help="results/runs/<run>")
    p.add_argument("--data-dir", type=Path, required=True, help="results/data (manifest.json)")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"[rank {os.environ.get('RANK', '0')}] %(levelname)s %(message)s"
    )
    try:
        return run(args.run_dir, args.data_dir)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
