"""Reading a checkpoint's model tensors by HF name, one at a time, without the engine.

The checkpoint format's reader side (``pipeline.checkpoint`` writes and verifies the folders):
consolidate streams weights out through it and tests compare engines' states with it. Callers
verify the checkpoint (``pipeline.checkpoint.verify``) before trusting what it reads.

* FSDP2 (DCP): ``dcp.load(..., no_dist=True)`` of one tensor (or a small group) at a time;
  DCP's reader seeks to each chunk of the tensor in the ``.distcp`` files.
* DeepSpeed ZeRO 1/2 (also bf16): the fp32 master weights are the ranks' flat
  ``single_partition_of_fp32_groups``; their concatenation over ranks is the flat group, where
  parameters lie in ``param_shapes`` order with ``param_alignment_paddings`` between them.
* DeepSpeed ZeRO-3: every parameter is split into ``ceil(n / world)`` elements per rank, at the
  same offset in each rank's concatenated ``fp32_flat_groups``.
* DeepSpeed ZeRO-0: the module weights (fp32), or the optimizer's ``fp32_groups`` (bf16/fp16).

The rank files are memory-mapped (``torch.load(mmap=True)``), so the Adam moments in them are
never read; the pages of master weights already copied are handed back with
``madvise(MADV_DONTNEED)``, because a file mapping's resident pages count in the process's RSS.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import PipelineError

#: Small tensors are read from DCP in groups up to this many bytes (one ``dcp.load`` call has
#: a fixed cost: planning and re-reading the metadata).
GROUP_BYTES = 16 * 2**20

@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor of the source checkpoint, before it is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Source:
    """A checkpoint's model tensors by HF name, readable one at a time."""

    tensors: dict[str, TensorInfo]

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for ``names`` in order; each tensor is freshly allocated."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# FSDP2: torch.distributed.checkpoint
# --------------------------------------------------------------------------------------------


class DCPSource(Source):
    """The ``model.*`` tensors of a DCP checkpoint (saved as ``{"model": msd, "optim": osd}``)."""

    PREFIX = "model."

    def __init__(self, dcp_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self._dcp = dcp
        self.dir = dcp_dir
        meta = dcp.FileSystemReader(str(dcp_dir)).read_metadata()
        self.tensors = {
            key.removeprefix(self.PREFIX): TensorInfo(tuple(info.size), info.properties.dtype)
            for key, info in meta.state_dict_metadata.items()
            if key.startswith(self.PREFIX) and isinstance(info, TensorStorageMetadata)
        }

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        group: list[str] = []
        size = 0
        for name in names:
            info = self.tensors[name]
            nbytes = info.numel * info.dtype.itemsize
            if group and size + nbytes > GROUP_BYTES:
                yield from self._load(group)
                group, size = [], 0
            group.append(name)
            size += nbytes
        if group:
            yield from self._load(group)

    def _load(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        state = {
            self.PREFIX + n: torch.empty(self.tensors[n].shape, dtype=self.tensors[n].dtype)
            for n in names
        }
        # A fresh reader per call: FileSystemReader keeps per-load state (the storage index).
        self._dcp.load(state, storage_reader=self._dcp.FileSystemReader(str(self.dir)), no_dist=True)
        for n in names:
            yield n, state.pop(self.PREFIX + n)


# --------------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------------


class _DeepSpeedObject:
    """Inert stand-in for DeepSpeed's bookkeeping classes inside its checkpoint pickles.

    DeepSpeed's optimizer files pickle a few of its own objects (``LossScaler``,
    ``ZeroStageEnum``, ``fragment_address``) next to the tensors. ``torch.load(weights_only=True)``
    refuses unknown classes; rather than ``weights_only=False`` (which would run whatever the
    pickle names), every ``deepspeed.*`` global is mapped to this class, which only records
    its arguments and state. We read nothing but tensors, ints and shapes from these files.
    """

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _load_ds_file(path: Path) -> dict[str, Any]:
    """A DeepSpeed ``*.pt`` file, memory-mapped, with ``weights_only=True``."""
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    foreign = [g for g in unsafe if not g.startswith("deepspeed.")]
    if foreign:
        raise PipelineError(f"{path} pickles objects that are not DeepSpeed's: {foreign[:5]}")
    with torch.serialization.safe_globals([(_DeepSpeedObject, g) for g in unsafe]):
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


class _PageDropper:
    """Hands back the resident pages of memory-mapped checkpoint files once they were copied.

    ``madvise(MADV_DONTNEED)`` on a private file mapping that was never written only drops the
    process's page-table entries: touching the pages again re-reads the file, so no data can
    change (a neighbouring tensor sharing a page is simply re-read). On anonymous memory the
    same call would zero the pages, so it is issued only for address ranges that
    ``/proc/self/maps`` shows as mappings of the checkpoint's own files (Linux; elsewhere this
    does nothing and the bound on memory is looser).
    """

    MADV_DONTNEED = 4

    def __init__(self, files: list[Path]) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.libc: Any = None
        if not sys.platform.startswith("linux"):
            return
        names = {str(f.resolve()) for f in files}
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") in names:
                    a, b = (int(x, 16) for x in parts[0].split("-"))
                    self.ranges.append((a, b))
        if self.ranges:
            self.libc = ctypes.CDLL(None, use_errno=True)
            self.libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def __call__(self, t: torch.Tensor) -> None:
        if self.libc is None or t.numel() == 0:
            return
        page = mmap.PAGESIZE
        start = t.data_ptr() // page * page
        end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
        if any(a <= start and end <= b for a, b in self.ranges):
            self.libc.madvise(start, end - start, self.MADV_DONTNEED)


def _copy_range(
    parts: list[torch.Tensor],
    starts: list[int],
    lo: int,
    hi: int,
    dst: torch.Tensor,
    release: _PageDropper,
) -> None:
    """Copy elements [lo, hi) of the virtual concatenation of ``parts`` into ``dst``."""
    for part, start in zip(parts, starts, strict=True):
        a, b = max(lo, start), min(hi, start + part.numel())
        if a < b:
            src = part[a - start : b - start]
            dst[a - lo : b - lo].copy_(src)
            release(src)


_OPTIM_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class DeepSpeedSource(Source):
    """The fp32 master weights of a DeepSpeed checkpoint folder (``ds/``), ZeRO 0–3."""

    def __init__(self, ds_dir: Path) -> None:
        self.dir = ds_dir
        optim_files: list[tuple[int, Path]] = []
        for f in ds_dir.iterdir():
            m = _OPTIM_RE.search(f.name)
            if m:
                if int(m.group(2)) != 0:
                    raise PipelineError(
                        f"{f.name}: tensor/pipeline-parallel DeepSpeed checkpoints (mp_rank > 0) "
                        "cannot be consolidated here; convert with DeepSpeed's ds_to_universal.py"
                    )
                optim_files.append((int(m.group(1)), f))
        optim_files.sort()
        if [r for r, _ in optim_files] != list(range(len(optim_files))):
            raise PipelineError(f"{ds_dir}: optimizer files of ranks {[r for r, _ in optim_files]}")
        model_file = ds_dir / "mp_rank_00_model_states.pt"
        if not model_file.is_file():
            model_file = ds_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        if not model_file.is_file():
            raise PipelineError(f"{ds_dir} has no DeepSpeed model states file")
        self.model_states = _load_ds_file(model_file)
        self.module: dict[str, torch.Tensor] = self.model_states["module"]
        self.buffers = set(self.model_states.get("buffer_names") or ())
        self.shared: dict[str, str] = dict(self.model_states.get("shared_params") or {})
        if self.model_states.get("frozen_param_shapes"):
            raise PipelineError(
                f"{ds_dir}: frozen parameters are not supported by this consolidation "
                f"({list(self.model_states['frozen_param_shapes'])[:3]})"
            )
        # name → how to read it: ("module", None) | ("z12", (group, offset, numel))
        #                        | ("z3", (offset, per_rank_numel)) | ("fp32", tensor)
        self.where: dict[str, tuple[str, Any]] = {}
        self.tensors = {}
        if optim_files:
            self.optim = [_load_ds_file(f)["optimizer_state_dict"] for _, f in optim_files]
            self._index_partitions(len(optim_files))
        else:
            self._index_stage0()
        self.release = _PageDropper([model_file] + [f for _, f in optim_files])
        for name in self.buffers:
            t = self.module[name]
            self.tensors[name] = TensorInfo(tuple(t.shape), t.dtype)
            self.where[name] = ("module", None)
        for alias, target in self.shared.items():
            if target in self.tensors:
                self.tensors[alias] = self.tensors[target]
                self.where[alias] = self.where[target]

    def _index_partitions(self, world: int) -> None:
        opt0 = self.optim[0]
        counts = opt0["partition_count"]
        expect = max(counts) if isinstance(counts, list) else counts
        if expect != world:
            raise PipelineError(
                f"{self.dir}: the checkpoint was saved by {expect} ranks but holds {world} "
                "optimizer files (a partial or mixed checkpoint)"
            )
        shapes: list[dict[str, Any]] = self.model_states["param_shapes"]
        if "fp32_flat_groups" in opt0:  # ZeRO-3
            self.flat = [o["fp32_flat_groups"] for o in self.optim]
            self.starts = [0]
            for t in self.flat[0][:-1]:
                self.starts.append(self.starts[-1] + t.numel())
            offset = 0
            for group in shapes:
                for name, shape in group.items():
                    n = math.prod(shape)
                    per_rank = -(-n // world)
                    self.tensors[name] = TensorInfo(tuple(shape), torch.float32)
                    self.where[name] = ("z3", (offset, per_rank))
                    offset += per_rank
            have = sum(t.numel() for t in self.flat[0])
            if offset != have:
                raise PipelineError(f"{self.dir}: ZeRO-3 partitions hold {have} elements, {offset} expected")
            return
        # ZeRO 1/2 (and DeepSpeed's bf16 optimizer): one flat partition per group and rank.
        self.flat = [o["single_partition_of_fp32_groups"] for o in self.optim]
        paddings = opt0.get("param_alignment_paddings")
        for g, group in enumerate(shapes):
            size = self.flat[0][g].numel()
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                n = math.prod(shape)
                self.tensors[name] = TensorInfo(tuple(shape), torch.float32)
                self.where[name] = ("z12", (g, offset, n))
                offset += n + (paddings[g][i] if paddings is not None else 0)
            if offset > size * world:
                raise PipelineError(
                    f"{self.dir}: group {g} needs {offset} elements, the partitions hold {size * world}"
                )

    def _index_stage0(self) -> None:
        params = [(k, v) for k, v in self.module.items() if k not in self.buffers]
        opt = self.model_states.get("optimizer") or {}
        master = opt.get("fp32_groups")
        if all(v.dtype == torch.float32 for _, v in params):
            for k, v in params:
                self.tensors[k] = TensorInfo(tuple(v.shape), v.dtype)
                self.where[k] = ("module", None)
            return
        if master is None:
            raise PipelineError(
                f"{self.dir}: ZeRO-0 checkpoint with {params[0][1].dtype} weights and no fp32 "
                "master copy; refusing to write rounded weights as the trained model"
            )
        # bf16/fp16 at ZeRO-0: the optimizer keeps fp32 copies in the parameters' order,
        # tied parameters once (they share a storage in the module state dict).
        seen: dict[int, str] = {}
        unique: list[tuple[str, torch.Tensor]] = []
        for k, v in params:
            ptr = v.untyped_storage().data_ptr()
            if ptr in seen and v.numel():
                self.shared[k] = seen[ptr]
                continue
            seen[ptr] = k
            unique.append((k, v))
        flat_master = [t for group in master for t in group]
        if len(flat_master) != len(unique) or any(
            tuple(m.shape) != tuple(v.shape) for m, (_, v) in zip(flat_master, unique, strict=True)
        ):
            raise PipelineError(f"{self.dir}: ZeRO-0 fp32 master weights do not line up with the module")
        for (k, v), m in zip(unique, flat_master, strict=True):
            self.tensors[k] = TensorInfo(tuple(v.shape), torch.float32)
            self.where[k] = ("fp32", m)

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self._read(name)

    def _read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        kind, loc = self.where[name]
        if kind in ("module", "fp32"):
            src = self.module[name] if kind == "module" else loc
            out = src.clone()
            self.release(src)
            return out
        out = torch.empty(info.numel, dtype=torch.float32)
        if kind == "z12":
            g, offset, n = loc
            parts = [ranks[g] for ranks in self.flat]
            size = parts[0].numel()
            _copy_range(
                parts, [r * size for r in range(len(parts))], offset, offset + n, out, self.release
            )
        else:
            offset, per_rank = loc
            for r, groups in enumerate(self.flat):
                n = min(per_rank, info.numel - r * per_rank)
                if n > 0:
                    dst = out[r * per_rank : r * per_rank + n]
                    _copy_range(groups, self.starts, offset, offset + n, dst, self.release)
        return out.view(info.shape)


# --------------------------------------------------------------------------------------------
# Whole-state readers (in memory; for tests and small models)
# --------------------------------------------------------------------------------------------


def load_dcp_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of an FSDP2 checkpoint folder, in memory (names without ``model.``)."""
    src = DCPSource(ckpt / "dcp")
    return dict(src.read(list(src.tensors)))


def load_deepspeed_model_state(ckpt: Path, zero_stage: int | None = None) -> dict[str, torch.Tensor]:
    """Every fp32 model tensor of a DeepSpeed checkpoint folder (ZeRO 0–3), in memory.

    ``zero_stage`` is accepted for compatibility; the layout is read from the files themselves.
    """
    src = DeepSpeedSource(ckpt / "ds")
    return dict(src.read(list(src.tensors)))


def open_source(ckpt: Path) -> Source:
    """The model tensors of a checkpoint folder of either engine."""
    if (ckpt / "ds").is_dir():
        return DeepSpeedSource(ckpt / "ds")
    if (ckpt / "dcp").is_dir():
        return DCPSource(ckpt / "dcp")
    raise PipelineError(f"{ckpt} holds neither a dcp/ nor a ds/ folder")
