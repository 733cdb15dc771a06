"""Reading a checkpoint's model tensors by HF name, one at a time, without the engine.

The checkpoint format's reader side (``pipeline.checkpoint`` writes and verifies the folders):
consolidate streams weights out through it and tests compare engines' states with it. Callers
verify the whole checkpoint (``pipeline.checkpoint.verify``) before opening any file of it.

Untrusted bytes are data: a manifest can be rewritten along with the files, so nothing here
unpickles except through an allow-list. DCP's ``.metadata`` (a plain pickle) goes through a
restricted unpickler (:func:`load_dcp_metadata`: DCP's metadata classes, ``torch.Size``, dtypes,
layouts, the checkpoint path), also inside ``dcp.load`` (:func:`dcp_load`, whose planner loads
DCP's non-tensor entries with ``weights_only=True`` as well); DeepSpeed's ``*.pt`` files load
with ``weights_only=True`` and DeepSpeed's few classes (:data:`DS_GLOBALS`, also for the
engine's own resume: :func:`load_ds_file_for_engine`).

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
import importlib
import math
import mmap
import pickle
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts import inside
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
# Untrusted bytes are data: what a checkpoint may unpickle
# --------------------------------------------------------------------------------------------

_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
#: The globals a DCP ``.metadata`` pickle names (torch 2.x: ``Metadata`` and its parts, the
#: file system reader's storage index, ``torch.Size``, dtypes and layouts, the checkpoint id).
_DCP_GLOBALS = frozenset({
    *((_DCP_META, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                               "TensorStorageMetadata", "BytesStorageMetadata",
                               "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    (_DCP_FS, "_StorageInfo"), (_DCP_FS, "_StoragePrefix"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
})


class _NotAllowed(pickle.UnpicklingError):
    """A pickle named a global outside the allow-list."""


class _RestrictedUnpickler(pickle.Unpickler):
    """``pickle`` that resolves only the allow-listed globals (and torch's dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _NotAllowed(f"{module}.{name} is not on the allow-list")

    def persistent_load(self, pid: Any) -> Any:
        raise _NotAllowed("persistent ids are not allowed")


def load_dcp_metadata(stream: Any, path: Path | str) -> Any:
    """A DCP ``.metadata`` pickle through the allow-list; :class:`PipelineError` naming ``path``
    for anything else (a foreign global, a truncated or garbled file)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        meta = _RestrictedUnpickler(stream).load()
    except _NotAllowed as err:
        raise PipelineError(
            f"{path}: refused to unpickle the DCP metadata ({err}); the checkpoint was not "
            "written by torch.distributed.checkpoint or was tampered with"
        ) from None
    except Exception as err:  # any failure of a garbled pickle gets the same answer
        raise PipelineError(f"{path}: unreadable DCP metadata ({type(err).__name__}: {err})") from None
    if not isinstance(meta, Metadata):
        raise PipelineError(f"{path}: the DCP metadata is a {type(meta).__name__}, not Metadata")
    return meta


def _check_storage_paths(meta: Any, dcp_dir: Path, path: Any) -> None:
    """The files DCP's storage index points at are plain names inside the checkpoint's folder
    (a crafted index could otherwise read any file into a tensor)."""
    storage = getattr(meta, "storage_data", None)
    if not isinstance(storage, dict):
        raise PipelineError(f"{path}: the DCP metadata has no storage index")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise PipelineError(f"{path}: the DCP storage index names {rel!r}, not a file of {dcp_dir}")
        inside(dcp_dir, rel)


def read_dcp_metadata(dcp_dir: Path) -> Any:
    """The ``Metadata`` of a DCP checkpoint folder, unpickled through the allow-list."""
    return safe_reader(dcp_dir).read_metadata()


def safe_reader(dcp_dir: Path) -> Any:
    """A DCP ``FileSystemReader`` whose ``read_metadata`` goes through the allow-list."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeFileSystemReader(FileSystemReader):
        refused: PipelineError | None = None  # DCP turns a failed read into its own message

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                try:
                    meta = load_dcp_metadata(stream, path)
                except PipelineError as err:
                    self.refused = err
                    raise
            _check_storage_paths(meta, dcp_dir, path)
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return _SafeFileSystemReader(str(dcp_dir))


def safe_planner(dcp_dir: Path) -> Any:
    """DCP's default load planner, except that non-tensor entries (optimizer hyper-parameters
    and the like, which DCP pickles with ``torch.save``) load with ``weights_only=True``."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise PipelineError(
                    f"{dcp_dir}: refused to unpickle the entry {fqn!r} ({str(err).splitlines()[0]})"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return _SafeLoadPlanner()


def dcp_load(state: dict[str, Any], dcp_dir: Path, *, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` from ``dcp_dir`` with the allow-listed metadata reader and
    planner; a refusal on any rank comes out as its :class:`PipelineError`, not DCP's
    ``CheckpointException`` with every rank's traceback."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = safe_reader(dcp_dir)
    try:
        dcp.load(state, storage_reader=reader, planner=safe_planner(dcp_dir), no_dist=no_dist)
    except CheckpointException as err:
        if reader.refused is not None:
            raise reader.refused from None
        for exc, _trace in err.failures.values():
            if isinstance(exc, PipelineError):
                raise exc from None
        raise


# --------------------------------------------------------------------------------------------
# FSDP2: torch.distributed.checkpoint
# --------------------------------------------------------------------------------------------


class DCPSource(Source):
    """The ``model.*`` tensors of a DCP checkpoint (saved as ``{"model": msd, "optim": osd}``)."""

    PREFIX = "model."

    def __init__(self, dcp_dir: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.dir = dcp_dir
        meta = read_dcp_metadata(dcp_dir)
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
        dcp_load(state, self.dir, no_dist=True)
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


#: DeepSpeed's own classes inside its checkpoint pickles (ZeRO 0-3; fp32, bf16 and fp16), which
#: the engine's resume needs as themselves. Anything else a ``*.pt`` file names is refused.
DS_GLOBALS = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)


def _unsafe_globals(path: Path) -> list[str]:
    """The globals a torch checkpoint file names beyond torch's ``weights_only`` defaults."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception as err:  # a truncated or garbled file: the same answer for every kind
        raise PipelineError(f"{path}: not a readable torch checkpoint file ({err})") from None


def _torch_load(path: Path, **kw: Any) -> Any:
    try:
        return torch.load(path, weights_only=True, **kw)
    except pickle.UnpicklingError as err:
        raise PipelineError(f"{path}: refused to unpickle ({str(err).splitlines()[0]})") from None
    except (OSError, RuntimeError, EOFError) as err:
        raise PipelineError(f"{path}: not a readable torch checkpoint file ({err})") from None


def check_ds_files(ds_dir: Path) -> None:
    """Every ``*.pt`` under a DeepSpeed checkpoint folder names only :data:`DS_GLOBALS`
    (checked before the engine reads any of them, on every rank: all ranks agree)."""
    for f in sorted(ds_dir.rglob("*.pt")):
        foreign = [g for g in _unsafe_globals(f) if g not in DS_GLOBALS]
        if foreign:
            raise PipelineError(f"{f} pickles objects outside DeepSpeed's allow-list: {foreign[:5]}")


def load_ds_file_for_engine(path: str | Path, map_location: Any = None) -> Any:
    """DeepSpeed's checkpoint engine ``load``, made safe: ``weights_only=True`` with
    :data:`DS_GLOBALS` (the real classes) as the only extra globals."""
    path = Path(path)
    unsafe = _unsafe_globals(path)
    foreign = [g for g in unsafe if g not in DS_GLOBALS]
    if foreign:
        raise PipelineError(f"{path} pickles objects outside DeepSpeed's allow-list: {foreign[:5]}")
    classes = []
    for g in unsafe:
        module, _, name = g.rpartition(".")
        classes.append(getattr(importlib.import_module(module), name))
    with torch.serialization.safe_globals(classes):
        return _torch_load(path, map_location=map_location)


def _load_ds_file(path: Path) -> dict[str, Any]:
    """A DeepSpeed ``*.pt`` file, memory-mapped, with ``weights_only=True``."""
    unsafe = _unsafe_globals(path)
    foreign = [g for g in unsafe if not g.startswith("deepspeed.")]
    if foreign:
        raise PipelineError(f"{path} pickles objects that are not DeepSpeed's: {foreign[:5]}")
    with torch.serialization.safe_globals([(_DeepSpeedObject, g) for g in unsafe]):
        return _torch_load(path, map_location="cpu", mmap=True)


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
