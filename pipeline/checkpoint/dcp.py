"""DCP's file reading, with each tensor read straight into the tensor it restores.

DCP's ``FileSystemReader.read_data`` ``torch.load``s every item of a shard file (each is one
``torch.save``d tensor, a small zip) into a new tensor and copies that into the destination
(the model's parameter or the optimizer's state, both already allocated). Here, an item that is
one plainly stored, contiguous tensor of the destination's dtype and shape is read from the
file into the destination's own memory: no new tensor (fresh memory costs a page fault per page,
a host fault on VMs that hand free memory back, see :mod:`pipeline.checkpoint.stream`) and one
copy fewer. What it is is still decided by the item's own pickle, unpickled by torch's
``weights_only`` unpickler with a storage on the ``meta`` device (no bytes); anything else
(another layout, a slice of the item for a resharded load, a GPU destination, an extension
such as compression) goes DCP's way, ``torch.load(weights_only=True)``.

The items of a file are read in the order they lie in it, so a file streams front to back
through the reader's windows.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

from pipeline.checkpoint.stream import SeekableReader
from pipeline.errors import PipelineError

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_MAGIC = 0x04034B50


class Slice(SeekableReader):
    """Bytes ``[offset, offset + length)`` of a seekable stream, as a file of their own."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        super().__init__(length)
        self._f = f
        self._off = offset

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._off + self._pos)
        got = self._f.readinto(out[:n]) or 0
        self._pos += got
        return got

    def skip_to(self, pos: int) -> None:
        """Seek to ``pos``, past bytes nobody reads (the stream's ``skip_to`` if it has one)."""
        self.seek(pos)
        if hasattr(self._f, "skip_to"):
            self._f.skip_to(self._off + pos)


def zip_record(f: Slice, info: zipfile.ZipInfo) -> tuple[int, int] | None:
    """(offset, size) of a stored (uncompressed) zip record's bytes within ``f``."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    f.seek(info.header_offset)
    head = f.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size:
        return None
    fields = _LOCAL_HEADER.unpack(head)
    if fields[0] != _LOCAL_MAGIC:
        return None
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    return (start, info.file_size) if start + info.file_size <= f.size else None


def _meta_tensor(pickled: bytes) -> torch.Tensor | None:
    """The tensor a ``torch.save`` pickle describes, on the ``meta`` device (its dtype, shape,
    strides and storage size; no data), through torch's ``weights_only`` unpickler; None unless
    it is one plain tensor over the storage record ``0``."""
    from torch import _weights_only_unpickler as wo

    keys: list[str] = []

    def persistent_load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise pickle.UnpicklingError("unexpected persistent id")
        _, storage_type, key, _location, numel = saved_id
        dtype = storage_dtype(storage_type)
        keys.append(str(key))
        nbytes = int(numel) * torch._utils._element_size(dtype)
        return torch.storage.TypedStorage(
            wrap_storage=torch.UntypedStorage(nbytes, device="meta"), dtype=dtype, _internal=True)

    up = wo.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    up.persistent_load = persistent_load  # type: ignore[method-assign]
    try:
        t = up.load()
    except Exception:  # not what this reads: DCP's own torch.load answers for it
        return None
    if type(t) is not torch.Tensor or t.layout != torch.strided or keys != ["0"]:
        return None
    return t


def saved_tensor(f: Slice) -> tuple[torch.Tensor, int] | None:
    """The meta tensor of one DCP item (:func:`_meta_tensor`) and the offset of its bytes,
    when the item is one contiguous tensor stored whole; else None."""
    try:
        names = zipfile.ZipFile(f).infolist()
    except PipelineError:  # the stream found the bytes damaged: not a format question
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    pkl = [i for i in names if i.filename.endswith("/data.pkl")]
    data = [i for i in names if "/data/" in i.filename]
    if len(pkl) != 1 or len(data) != 1 or not data[0].filename.endswith("/data/0"):
        return None
    where_pkl, where_data = zip_record(f, pkl[0]), zip_record(f, data[0])
    if where_pkl is None or where_data is None:
        return None
    f.seek(where_pkl[0])
    meta = _meta_tensor(f.read(where_pkl[1]))
    if meta is None or not meta.is_contiguous() or meta.storage_offset() != 0:
        return None
    nbytes = meta.numel() * meta.element_size()
    if meta.untyped_storage().nbytes() != nbytes or where_data[1] != nbytes:
        return None
    return meta, where_data[0]


def storage_dtype(storage_type: Any) -> torch.dtype:
    """The dtype of a storage type named by a ``torch.save`` pickle's persistent id."""
    return torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype


def memory_of(address: int, nbytes: int) -> memoryview:
    """``nbytes`` of CPU memory at ``address`` (a tensor's or storage's) as writable bytes."""
    import ctypes

    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def readinto_exact(f: Any, out: memoryview, what: str) -> None:
    """Fill ``out`` from ``f``; :class:`PipelineError` naming ``what`` if ``f`` ends first."""
    got = 0
    while got < len(out):
        n = f.readinto(out[got:])
        if not n:
            raise PipelineError(f"{what} ends early ({got} of {len(out)} bytes)")
        got += n


def read_item_into(f: Slice, req: Any, target: torch.Tensor) -> bool:
    """Read the DCP item open as ``f`` straight into ``target`` (the destination of ``req``),
    when it is one contiguous tensor of ``target``'s dtype and shape, requested whole; False
    (nothing read into ``target``) otherwise."""
    if target.device.type != "cpu" or not target.is_contiguous():
        return False
    found = saved_tensor(f)
    if found is None:
        return False
    meta, offset = found
    if (meta.dtype != target.dtype or tuple(meta.shape) != tuple(target.shape)
            or any(req.storage_offsets) or tuple(req.lengths) != tuple(meta.shape)):
        return False
    f.seek(offset)
    readinto_exact(f, memory_of(target.data_ptr(), target.numel() * target.element_size()),
                   f"an item of {getattr(f._f, 'path', 'a DCP file')}")
    return True


def read_items(reader: Any, items: list[Any], planner: Any) -> None:
    """DCP's ``read_data`` for ``items`` (sorted by file and offset) without extensions:
    tensors straight into their destination where :func:`read_item_into` can, the rest as DCP
    reads them (``torch.load(weights_only=True)``, narrowed, copied)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType

    for rel, reqs in _by_file(reader, items):
        path = reader.fs.concat_path(reader.path, rel)
        with reader.fs.create_stream(path, "rb") as stream:
            for req in reqs:
                md = reader.storage_data[req.storage_index]
                f = Slice(stream, md.offset, md.length)
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(f.read(-1)))
                    continue
                target = planner.resolve_tensor(req).detach()
                if not read_item_into(f, req, target):
                    f.seek(0)
                    try:
                        tensor = torch.load(f, map_location="cpu", weights_only=True)
                    except Exception:
                        # torch's reader reports what the stream raised as its own error.
                        if getattr(stream, "damage", None) is not None:
                            raise stream.damage from None
                        raise
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    if target.size() != tensor.size():
                        raise PipelineError(
                            f"{path}: item {req.storage_index} has shape {tuple(tensor.size())}, "
                            f"its destination {tuple(target.size())}")
                    target.copy_(tensor)
                planner.commit_tensor(req, target)


def _by_file(reader: Any, items: list[Any]) -> Iterator[tuple[str, list[Any]]]:
    per_file: dict[str, list[Any]] = {}
    for it in items:
        per_file.setdefault(reader.storage_data[it.storage_index].relative_path, []).append(it)
    yield from per_file.items()
