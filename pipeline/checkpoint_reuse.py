"""Deserializing a ``torch.save`` file into memory the process already has.

A resume's DeepSpeed optimizer partition holds Adam's moments, which ``torch.optim``'s
``load_state_dict`` keeps as its state (it replaces the state the engine built at start-up,
tensors of the same dtypes and sizes). ``torch.load`` puts them in fresh memory, whose first
touch costs a page fault per page (a host fault on VMs that hand free memory back; measured on
the development VM: two ranks loading 800 MB partitions at a third of the disk's rate). Here the
file is deserialized by torch's ``weights_only`` unpickler, as ``torch.load(weights_only=True)``
does, but each storage whose dtype and size match a tensor of that old state is read into that
tensor's memory (:class:`StoragePool`); the rest get fresh memory. The old state's tensors are
dropped by the engine's load right after; if the load is abandoned (a rank found damage), the
borrowed memory is zeroed (:meth:`StoragePool.wipe`), as the engine left it.

Both of ``torch.save``'s formats: the zip one (records read where the pickle names them) and the
legacy one DeepSpeed writes by default (the storages' bytes after the pickles, in order).
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

import torch

from pipeline.checkpoint_dcp import (
    Slice,
    memory_of,
    readinto_exact,
    storage_dtype,
    zip_record,
)
from pipeline.errors import PipelineError

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


class StoragePool:
    """Storages that a load may fill instead of allocating, by (dtype, bytes): the CPU tensors
    given that own their whole storage, of at least :data:`MIN_BYTES`."""

    #: Smaller tensors are not worth it (the point is the large moments).
    MIN_BYTES = 1 << 20

    def __init__(self, tensors: list[torch.Tensor] | None = None) -> None:
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.borrowed: list[torch.Tensor] = []
        seen: set[int] = set()
        for t in tensors or []:
            nbytes = t.numel() * t.element_size()
            if (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
                    and t.untyped_storage().nbytes() == nbytes and nbytes >= self.MIN_BYTES
                    and t.data_ptr() not in seen):
                seen.add(t.data_ptr())
                self._free.setdefault((t.dtype, t.untyped_storage().nbytes()), []).append(t)

    def take(self, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage | None:
        found = self._free.get((dtype, nbytes))
        if not found:
            return None
        t = found.pop()
        self.borrowed.append(t)
        return t.untyped_storage()

    def wipe(self) -> None:
        """Zero what was filled (a load that was abandoned leaves the state as it found it)."""
        with torch.no_grad():
            for t in self.borrowed:
                t.zero_()
        self.borrowed.clear()


class _Loader:
    """One file's deserialization: storages from the pool or fresh, filled by ``fill``."""

    def __init__(self, pool: StoragePool) -> None:
        self.pool = pool
        self.storages: dict[str, torch.storage.TypedStorage] = {}

    def storage(self, dtype: torch.dtype, key: str, numel: int) -> torch.storage.TypedStorage:
        if key not in self.storages:
            nbytes = int(numel) * torch._utils._element_size(dtype)
            raw = self.pool.take(dtype, nbytes) or torch.UntypedStorage(nbytes)
            self.storages[key] = torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype,
                                                            _internal=True)
        return self.storages[key]

    def unpickle(self, f: Any, persistent: Any) -> Any:
        from torch import _weights_only_unpickler as wo

        up = wo.Unpickler(f, encoding="utf-8")
        up.persistent_load = persistent  # type: ignore[method-assign]
        return up.load()


def _load_legacy(f: Any, name: str, loader: _Loader) -> Any:
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

    result = loader.unpickle(f, persistent)
    for key in wo.load(f, encoding="utf-8"):
        s = loader.storages.get(str(key))
        if s is None:
            raise PipelineError(f"{name}: storage {key!r} is not named by the pickle")
        raw = s._untyped_storage
        head = f.read(8)
        numel = int.from_bytes(head, "little") if len(head) == 8 else -1
        if numel * torch._utils._element_size(s.dtype) != raw.nbytes():
            raise PipelineError(f"{name}: storage {key!r} does not have the size its pickle says")
        readinto_exact(f, memory_of(raw.data_ptr(), raw.nbytes()), name)
    return result


def _load_zip(f: Any, size: int, name: str, loader: _Loader) -> Any:
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
        fresh = str(key) not in loader.storages
        s = loader.storage(storage_dtype(storage_type), str(key), numel)
        if fresh:
            info = infos.get(f"data/{key}")
            rec = zip_record(whole, info) if info is not None else None
            if rec is None or rec[1] != s._untyped_storage.nbytes():
                raise PipelineError(f"{name}: storage {key!r} is missing or not its size")
            whole.seek(rec[0])
            raw = s._untyped_storage
            readinto_exact(whole, memory_of(raw.data_ptr(), raw.nbytes()), name)
        return s

    return loader.unpickle(io.BytesIO(pickled), persistent)


def load_reusing(f: Any, size: int, name: str, classes: list[Any], pool: StoragePool) -> Any:
    """``torch.load(f, weights_only=True)`` with ``classes`` allowed too, on the CPU, filling
    storages from ``pool`` where dtype and size match (``f``: seekable, ``size`` bytes)."""
    start = f.read(4)
    f.seek(0)
    loader = _Loader(pool)
    try:
        with torch.serialization.safe_globals(classes):
            if start == b"PK\x03\x04":
                return _load_zip(f, size, name, loader)
            return _load_legacy(f, name, loader)
    except pickle.UnpicklingError as err:
        raise PipelineError(f"{name}: refused to unpickle ({str(err).splitlines()[0]})") from None
    except (OSError, RuntimeError, EOFError, zipfile.BadZipFile) as err:
        raise PipelineError(f"{name}: not a readable torch checkpoint file ({err})") from None
