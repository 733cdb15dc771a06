"""Deserializing a ``torch.save`` file into memory the engine already has, by role.

A resume's DeepSpeed optimizer partition holds the fp32 master partition and Adam's moments.
The engine replaces them all (a fresh engine has masters but no moments yet: the base
optimizer makes them at its first step, and a requeued job's engine makes them for the load,
``DeepSpeedEngine.load_targets``): ``torch.optim``'s ``load_state_dict`` keeps the loaded
moments as its state, and DeepSpeed copies the loaded master partition into its own.
``torch.load`` puts them in fresh memory, whose first touch costs a page fault per page (a host
fault on VMs that hand free memory back; measured on the development VM, two ranks loading
800 MB partitions: the reads that landed in fresh memory took 270-540 ms per 16 MB, against
30-60 ms otherwise). Here the file is deserialized by torch's ``weights_only`` unpickler, as
``torch.load(weights_only=True)`` does, but in two steps: the pickle first, with storages that
are only reserved (no page is touched), then the storages' bytes, each read straight into the
engine's tensor that holds the same thing (:class:`LoadTargets`: the engine names its tensors by
their place in the loaded object, e.g. ``("optimizer_state_dict",
"single_partition_of_fp32_groups", 0)``), or into the reserved memory where none does. A
tensor read into the engine's own master partition *is* that partition, so DeepSpeed's copy of
it is skipped (``copy_`` between views of the same data does nothing).

Matching by role, not by size: the master partition and the two moments have one size, and a
moment read into the master's memory would be overwritten by DeepSpeed's copy of the master.
If the load is abandoned (a rank found damage), the engine's memory is put back as it was at
start-up (:meth:`LoadTargets.restore`).

Both of ``torch.save``'s formats: the zip one (records read in file order after the pickle) and
the legacy one DeepSpeed writes by default (the storages' bytes after the pickles, in order).
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.checkpoint.dcp import (
    Slice,
    memory_of,
    readinto_exact,
    storage_dtype,
    zip_record,
)
from pipeline.errors import PipelineError

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001

Path_ = tuple[Hashable, ...]


@dataclass
class LoadTargets:
    """The engine's tensors that a load replaces, by their place in the loaded object (dict keys
    and list indices from its root), and ``undo``: puts the engine's start-up values back in
    them (the load was abandoned after reading into some). Each is read into at most once."""

    tensors: dict[Path_, torch.Tensor]
    undo: Callable[[], None]
    made: bool = False
    """Whether the engine made some of them for this load (a fresh optimizer's moments): then
    :meth:`restore` runs ``undo`` (which drops them) even if nothing was read into them."""
    skip: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Byte ranges not read, by the engine storage they are in (its ``data_ptr``): what the
    engine rebuilds from other state it loads (``fill``). A storage read into such a tensor
    leaves that range as it was and sets :attr:`skipped`."""
    fill: Callable[[], None] | None = None
    """Rebuilds the :attr:`skip` ranges after the engine's load (run by the engine where
    :attr:`skipped`)."""
    regather: Callable[[], None] | None = None
    """Collective: puts back the start-up values of the tensors that a storage with a
    :attr:`skip` range was read into (from the ranges each rank skipped, which it left as they
    were). Run by :meth:`restore_shared` on every rank together."""
    skipped: bool = False
    used: bool = False
    claimed: int = 0
    """How many of them a load has read into (the trainer's ``load`` event reports it)."""

    def claim(self, path: Path_, like: torch.Tensor) -> torch.Tensor | None:
        """The engine's tensor at ``path`` if the storage of ``like`` (a loaded tensor) can be
        read into its storage: both CPU, one dtype, storages of one size, and ``like`` the
        same view of its storage as the engine's tensor is of its own (DeepSpeed saves its
        unpadded master partition as a view of the padded one). It is no longer offered."""
        t = self.tensors.get(path)
        if (t is None or t.device.type != "cpu" or t.dtype != like.dtype
                or t.untyped_storage().nbytes() != like.untyped_storage().nbytes()
                or t.storage_offset() != like.storage_offset() or t.shape != like.shape
                or t.stride() != like.stride()):
            return None
        del self.tensors[path]
        self.used = True
        self.claimed += 1
        return t

    def restore(self) -> None:
        """Undo the reads into the engine's memory (if any): the load was abandoned."""
        if self.used or self.made:
            with torch.no_grad():
                self.undo()
            self.used = self.made = False

    def restore_shared(self) -> None:
        """Collective, on every rank whose load was abandoned (all or none): :attr:`regather`,
        whether or not this rank read anything (another may have)."""
        if self.regather is not None:
            with torch.no_grad():
                self.regather()
            self.skipped = False


class _Loader:
    """One file's deserialization: storages reserved during the unpickle (untouched memory),
    then each bound to an engine tensor or kept, then filled."""

    def __init__(self) -> None:
        self.storages: dict[str, torch.storage.TypedStorage] = {}
        self.into: dict[str, torch.Tensor] = {}  # storage key -> engine tensor it is read into

    def storage(self, dtype: torch.dtype, key: str, numel: int) -> torch.storage.TypedStorage:
        if key not in self.storages:
            nbytes = int(numel) * torch._utils._element_size(dtype)
            self.storages[key] = torch.storage.TypedStorage(
                wrap_storage=torch.UntypedStorage(nbytes), dtype=dtype, _internal=True)
        return self.storages[key]

    def prefault(self, order: list[str]) -> None:
        """Fault in the pages of the storages of ``order`` (keys, in the order they are read)
        that are new memory (not bound to an engine tensor), ahead of the reads that fill them
        (:func:`pipeline.checkpoint.stream.prefault`)."""
        from pipeline.checkpoint.stream import prefault

        prefault([self.storages[k]._untyped_storage for k in order if k not in self.into])

    def skip(self, key: str, targets: LoadTargets | None) -> tuple[int, int] | None:
        """The byte range of storage ``key`` not to read (``targets.skip``; then sets
        ``targets.skipped``: the engine rebuilds it)."""
        t = self.into.get(key)
        if t is None or targets is None:
            return None
        got = targets.skip.get(t.untyped_storage().data_ptr())
        if got is not None:
            targets.skipped = True
        return got

    def memory(self, key: str) -> memoryview:
        t = self.into.get(key)
        raw = t.untyped_storage() if t is not None else self.storages[key]._untyped_storage
        return memory_of(raw.data_ptr(), raw.nbytes())

    def unpickle(self, f: Any, persistent: Any) -> Any:
        from torch import _weights_only_unpickler as wo

        up = wo.Unpickler(f, encoding="utf-8")
        up.persistent_load = persistent  # type: ignore[method-assign]
        return up.load()

    def bind(self, result: Any, targets: LoadTargets | None) -> Any:
        """Bind the storages of the tensors at the targets' paths to the engine's tensors, and
        return ``result`` with every tensor on such a storage replaced by the engine's tensor
        (or a view of it)."""
        if targets is None:
            return result
        key_of = {s._untyped_storage.data_ptr(): k for k, s in self.storages.items()}
        siblings: dict[int, list[Path_]] = {}
        for path, t in targets.tensors.items():
            siblings.setdefault(t.untyped_storage().data_ptr(), []).append(path)
        for path in list(targets.tensors):
            t = _at(result, path)
            if not isinstance(t, torch.Tensor):
                continue
            key = key_of.get(t.untyped_storage().data_ptr())
            if key is None or key in self.into:
                continue
            group = siblings[targets.tensors[path].untyped_storage().data_ptr()]
            if not all(_same_view(_at(result, p), targets.tensors[p], t) for p in group):
                continue  # several views of one storage laid out otherwise: fresh memory
            mine = targets.claim(path, t)
            if mine is not None:
                self.into[key] = mine
        if not self.into:
            return result
        bound = {self.storages[k]._untyped_storage.data_ptr(): t for k, t in self.into.items()}
        return _rebind(result, bound)


def _same_view(loaded: Any, mine: torch.Tensor, on: torch.Tensor) -> bool:
    """Whether ``loaded`` is, on the storage of ``on``, the view that ``mine`` is of its own
    (the engine's tensors sharing a storage, DeepSpeed's parameters in its flat buffer, read
    into only if the file lays every one of them out so: one storage read, each in its place)."""
    return (isinstance(loaded, torch.Tensor)
            and loaded.untyped_storage().data_ptr() == on.untyped_storage().data_ptr()
            and loaded.dtype == mine.dtype
            and loaded.storage_offset() == mine.storage_offset() and loaded.shape == mine.shape
            and loaded.stride() == mine.stride())


def _read_storage(f: Any, memory: memoryview, name: str, skip: tuple[int, int] | None) -> None:
    """Fill ``memory`` from ``f`` (at its position), leaving ``skip`` (a byte range of it, or
    None) as it is and not reading it: ``f`` seeks past it (a
    :class:`~pipeline.checkpoint.stream.WindowStream` then reads only whole blocks it serves
    from)."""
    if skip is None or skip[0] >= skip[1]:
        readinto_exact(f, memory, name)
        return
    start = f.tell()
    lo, hi = max(0, skip[0]), min(len(memory), skip[1])
    readinto_exact(f, memory[:lo], name)
    getattr(f, "skip_to", f.seek)(start + hi)
    readinto_exact(f, memory[hi:], name)


def _at(obj: Any, path: Path_) -> Any:
    for step in path:
        if isinstance(obj, dict):
            obj = obj.get(step)
        elif isinstance(obj, (list, tuple)) and isinstance(step, int) and -len(obj) <= step < len(obj):
            obj = obj[step]
        else:
            return None
    return obj


def _rebind(obj: Any, bound: dict[int, torch.Tensor]) -> Any:
    """``obj`` with each tensor whose storage is a key of ``bound`` replaced by the same view of
    that engine tensor's storage (the engine's tensor itself where the views are the same)."""
    if isinstance(obj, torch.Tensor):
        mine = bound.get(obj.untyped_storage().data_ptr())
        if mine is None:
            return obj
        if (obj.storage_offset() == mine.storage_offset() and obj.shape == mine.shape
                and obj.stride() == mine.stride()):
            return mine
        return torch.empty(0, dtype=obj.dtype).set_(mine.untyped_storage(),
                                                     obj.storage_offset(), obj.size(),
                                                     obj.stride())
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _rebind(v, bound)
        return obj
    if isinstance(obj, list):
        obj[:] = [_rebind(v, bound) for v in obj]
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_rebind(v, bound) for v in obj)
    return obj


def _load_legacy(f: Any, name: str, loader: _Loader, targets: LoadTargets | None) -> Any:
    from torch import _weights_only_unpickler as wo

    if wo.load(f, encoding="utf-8") != _LEGACY_MAGIC:
        raise PipelineError(f"{name}: not a torch checkpoint file (bad magic number)")
    if wo.load(f, encoding="utf-8") != _LEGACY_PROTOCOL:
        raise PipelineError(f"{name}: an unknown torch serialization protocol")
    wo.load(f, encoding="utf-8")  # the saving system's info

    def persistent(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 6 or saved_id[5] is not None:
            raise pickle.UnpicklingError("only whole storages are read here")
        _, storage_type, key, _location, numel, _ = saved_id
        return loader.storage(storage_dtype(storage_type), str(key), numel)

    result = loader.bind(loader.unpickle(f, persistent), targets)
    keys = wo.load(f, encoding="utf-8")
    if not isinstance(keys, list):
        raise PipelineError(f"{name}: its list of storages is a {type(keys).__name__}, not a list")
    loader.prefault([str(k) for k in keys if str(k) in loader.storages])
    for key in keys:
        s = loader.storages.get(str(key))
        if s is None:
            raise PipelineError(f"{name}: storage {key!r} is not named by the pickle")
        head = f.read(8)
        numel = int.from_bytes(head, "little") if len(head) == 8 else -1
        if numel * torch._utils._element_size(s.dtype) != s._untyped_storage.nbytes():
            raise PipelineError(f"{name}: storage {key!r} does not have the size its pickle says")
        _read_storage(f, loader.memory(str(key)), name, loader.skip(str(key), targets))
    return result


def _load_zip(f: Any, size: int, name: str, loader: _Loader,
              targets: LoadTargets | None) -> Any:
    whole = Slice(f, 0, size)
    infos = {i.filename.split("/", 1)[-1]: i for i in zipfile.ZipFile(whole).infolist()}
    pkl = infos.get("data.pkl")
    where = zip_record(whole, pkl) if pkl is not None else None
    if where is None:
        raise PipelineError(f"{name}: no readable data.pkl in the zip")
    whole.seek(where[0])
    pickled = whole.read(where[1])

    def persistent(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise pickle.UnpicklingError("unexpected persistent id")
        _, storage_type, key, _location, numel = saved_id
        return loader.storage(storage_dtype(storage_type), str(key), numel)

    result = loader.bind(loader.unpickle(io.BytesIO(pickled), persistent), targets)
    records = []
    for key, s in loader.storages.items():
        info = infos.get(f"data/{key}")
        rec = zip_record(whole, info) if info is not None else None
        if rec is None or rec[1] != s._untyped_storage.nbytes():
            raise PipelineError(f"{name}: storage {key!r} is missing or not its size")
        records.append((rec[0], key))
    records.sort()  # in file order: the stream reads ahead
    loader.prefault([key for _, key in records])
    for offset, key in records:
        whole.seek(offset)
        _read_storage(whole, loader.memory(key), name, loader.skip(key, targets))
    return result


def load_reusing(f: Any, size: int, name: str, classes: list[Any],
                 targets: LoadTargets | None) -> Any:
    """``torch.load(f, weights_only=True)`` with ``classes`` allowed too, on the CPU, reading
    the storage of each tensor found at a path of ``targets`` into that engine tensor's memory
    (``f``: seekable, ``size`` bytes). On a failure the caller calls ``targets.restore()``."""
    start = f.read(4)
    f.seek(0)
    loader = _Loader()
    try:
        with torch.serialization.safe_globals(classes):
            if start == b"PK\x03\x04":
                return _load_zip(f, size, name, loader, targets)
            return _load_legacy(f, name, loader, targets)
    except pickle.UnpicklingError as err:
        raise PipelineError(f"{name}: refused to unpickle ({str(err).splitlines()[0]})") from None
    except (OSError, RuntimeError, EOFError, zipfile.BadZipFile) as err:
        raise PipelineError(f"{name}: not a readable torch checkpoint file ({err})") from None
