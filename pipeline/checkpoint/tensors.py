"""Reading a checkpoint's model tensors by HF name, one at a time, without the engine.

The checkpoint format's reader side (``pipeline.checkpoint.format`` writes and verifies the folders):
consolidate streams weights out through it and tests compare engines' states with it. Callers
verify the whole checkpoint (``pipeline.checkpoint.format.verify``) before opening any file of it.

Untrusted bytes are data: a manifest can be rewritten along with the files, so nothing here
unpickles except through an allow-list. DCP's ``.metadata`` (a plain pickle) goes through a
restricted unpickler (:func:`load_dcp_metadata`: DCP's metadata classes, ``torch.Size``, dtypes,
layouts, the checkpoint path), also inside ``dcp.load`` (:func:`dcp_load`, whose planner loads
DCP's non-tensor entries with ``weights_only=True`` as well); DeepSpeed's ``*.pt`` files load
with ``weights_only=True`` and DeepSpeed's few classes (:data:`DS_GLOBALS`, also for the
engine's own resume: :func:`load_ds_file_for_engine`).

* FSDP2 (DCP): ``dcp.load(..., no_dist=True)`` of one tensor (or a small group) at a time;
  DCP's reader seeks to each chunk of the tensor in the ``.distcp`` files.
* DeepSpeed (ZeRO 0–3, AutoTP, PipelineModule): :mod:`pipeline.checkpoint.deepspeed`, which opens
  every file through :func:`load_ds_file` here; its ``open_source`` takes either engine's
  checkpoint folder.
"""

from __future__ import annotations

import importlib
import math
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, replace
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
    seen: set[Any] = set()  # thousands of entries, a few files: resolve each name once
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if rel in seen:
            continue
        if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise PipelineError(f"{path}: the DCP storage index names {rel!r}, not a file of {dcp_dir}")
        inside(dcp_dir, rel)
        seen.add(rel)


def read_dcp_metadata(dcp_dir: Path, fs: Any = None) -> Any:
    """The ``Metadata`` of a DCP checkpoint folder, unpickled through the allow-list."""
    return safe_reader(dcp_dir, fs).read_metadata()


def safe_reader(dcp_dir: Path, fs: Any = None) -> Any:
    """A DCP ``FileSystemReader`` whose ``read_metadata`` goes through the allow-list; ``fs``:
    the DCP ``FileSystem`` it reads through (the verified bytes of a resume,
    ``pipeline.checkpoint.read``), DCP's own by default."""
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

        def read_data(self, plan: Any, planner: Any) -> Any:
            # Each file's items in the order they lie in it (DCP reads them in the plan's
            # order): a file is then read front to back, through one read-ahead window
            # (pipeline.checkpoint.stream), instead of a jump per item.
            where = self.storage_data
            items = sorted(plan.items, key=lambda it: (where[it.storage_index].relative_path,
                                                       where[it.storage_index].offset))
            if any(getattr(where[it.storage_index], "transform_descriptors", None)
                   for it in items):
                return super().read_data(replace(plan, items=items), planner)
            # Tensors straight into their destination (pipeline.checkpoint.dcp).
            from torch.futures import Future

            from pipeline.checkpoint.dcp import read_items

            read_items(self, items, planner)
            done: Future[None] = Future()
            done.set_result(None)
            return done

    reader = _SafeFileSystemReader(str(dcp_dir))
    if fs is not None:
        reader.fs = fs
    return reader


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


def dcp_load(state: dict[str, Any], dcp_dir: Path, *, no_dist: bool = False,
             fs: Any = None) -> None:
    """``dcp.load`` of ``state`` from ``dcp_dir`` with the allow-listed metadata reader and
    planner; a refusal on any rank comes out as its :class:`PipelineError`, not DCP's
    ``CheckpointException`` with every rank's traceback. ``fs`` as in :func:`safe_reader`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = safe_reader(dcp_dir, fs)
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


def load_ds_file(path: Path) -> dict[str, Any]:
    """A DeepSpeed ``*.pt`` file, memory-mapped, with ``weights_only=True``."""
    unsafe = _unsafe_globals(path)
    foreign = [g for g in unsafe if not g.startswith("deepspeed.")]
    if foreign:
        raise PipelineError(f"{path} pickles objects that are not DeepSpeed's: {foreign[:5]}")
    with torch.serialization.safe_globals([(_DeepSpeedObject, g) for g in unsafe]):
        return _torch_load(path, map_location="cpu", mmap=True)


# --------------------------------------------------------------------------------------------
# Whole-state readers (in memory; for tests and small models)
# --------------------------------------------------------------------------------------------


def load_dcp_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of an FSDP2 checkpoint folder, in memory (names without ``model.``)."""
    src = DCPSource(ckpt / "dcp")
    return dict(src.read(list(src.tensors)))
