"""DeepSpeed checkpoints' model tensors by HF name (ZeRO 0–3, AutoTP, PipelineModule), one at a
time, without the engine: the DeepSpeed half of :mod:`pipeline.checkpoint.tensors`'s readers.

Every file is opened through :func:`pipeline.checkpoint.tensors.load_ds_file` (memory-mapped,
``weights_only=True``, DeepSpeed's classes as inert stand-ins); callers verify the checkpoint
first (``pipeline.checkpoint.format.verify``).

* ZeRO 1/2 (also bf16): the fp32 master weights are the ranks' flat
  ``single_partition_of_fp32_groups``; their concatenation over ranks is the flat group, where
  parameters lie in ``param_shapes`` order with ``param_alignment_paddings`` between them.
* ZeRO-3: every parameter is split into ``ceil(n / world)`` elements per rank, at the same
  offset in each rank's concatenated ``fp32_flat_groups``.
* ZeRO-0: the module weights (fp32), or the optimizer's ``fp32_groups`` (bf16/fp16).
* AutoTP (``mp_rank_XX`` > 0): each TP rank's files are one of the above over its shards;
  a sharded tensor is the concatenation of the ranks' shards along the one dimension where
  their shape differs from the model's (AutoTP's column and row splits), a replicated one is
  TP rank 0's.
* PipelineModule: ``mp_rank_XX`` is the stage; the names are the pipeline's
  (``"<layer index>.<attribute>.<name>"``, :func:`pipe_to_hf_name`).

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
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.tensors import DCPSource, Source, TensorInfo, load_ds_file
from pipeline.errors import PipelineError

#: Attribute names of ``pipeline.train.ds_pipe``'s layer wrappers, which become the pipeline
#: checkpoint's names: ``0.embed_tokens.weight``, ``<i>.layer.<HF decoder layer name>``,
#: ``<last>.norm.weight``, ``<last>.lm_head.weight``.
PIPE_EMBED = "embed_tokens"
PIPE_DECODER = "layer"
PIPE_NORM = "norm"
PIPE_LM_HEAD = "lm_head"


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
    """The fp32 master weights of one model-parallel rank's files in a DeepSpeed checkpoint
    folder (``ds/``), ZeRO 0–3: the whole model without TP or PP (``mp_rank`` 0), one TP
    rank's shards, or one pipeline stage's parameters (under the pipeline's names)."""

    def __init__(self, ds_dir: Path, mp_rank: int = 0) -> None:
        self.dir = ds_dir
        optim_files: list[tuple[int, Path]] = []
        for f in ds_dir.iterdir():
            m = _OPTIM_RE.search(f.name)
            if m and int(m.group(2)) == mp_rank:
                optim_files.append((int(m.group(1)), f))
        optim_files.sort()
        if [r for r, _ in optim_files] != list(range(len(optim_files))):
            raise PipelineError(f"{ds_dir}: optimizer files of ranks {[r for r, _ in optim_files]}")
        model_file = ds_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"
        if not model_file.is_file():
            model_file = ds_dir / f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt"
        if not model_file.is_file():
            raise PipelineError(f"{ds_dir} has no DeepSpeed model states file for mp_rank "
                                f"{mp_rank:02d}")
        self.model_states = load_ds_file(model_file)
        # A pipeline's module weights are in its layer_XX files, not here (None).
        self.module: dict[str, torch.Tensor] = self.model_states["module"] or {}
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
            self.optim = [load_ds_file(f)["optimizer_state_dict"] for _, f in optim_files]
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



_LAYER_RE = re.compile(r"layer_(\d+)-model_states\.pt$")


def pipe_to_hf_name(name: str) -> str:
    """A ``PipelineModule`` parameter name (``"<layer>.<attribute>.<rest>"``, layer 0 the
    embedding, then one layer per decoder layer, the norm and head last) → its HF name."""
    index, _, rest = name.partition(".")
    attr, _, sub = rest.partition(".")
    if index.isdigit() and sub:
        if attr == PIPE_EMBED and index == "0":
            return f"model.embed_tokens.{sub}"
        if attr == PIPE_DECODER:
            return f"model.layers.{int(index) - 1}.{sub}"
        if attr == PIPE_NORM:
            return f"model.norm.{sub}"
        if attr == PIPE_LM_HEAD:
            return f"lm_head.{sub}"
    raise PipelineError(f"{name!r} is not a parameter of zerosnake's pipeline layers "
                        f"({PIPE_EMBED}, {PIPE_DECODER}, {PIPE_NORM}, {PIPE_LM_HEAD})")


class _LayerFilesSource(Source):
    """A pipeline's ``layer_XX-model_states.pt`` files (the module weights; ZeRO-0 keeps no
    other copy, and at fp32 they are the master weights), under the pipeline's names."""

    def __init__(self, ds_dir: Path) -> None:
        self.files = {}
        self.tensors = {}
        for f in sorted(ds_dir.iterdir()):
            m = _LAYER_RE.fullmatch(f.name)
            if not m:
                continue
            for key, t in load_ds_file(f).items():
                if t.dtype != torch.float32:
                    raise PipelineError(
                        f"{f}: {key} is {t.dtype}; a ZeRO-0 pipeline checkpoint holds no fp32 "
                        "master weights to consolidate (train with train.zero_stage: 1)")
                name = f"{int(m.group(1))}.{key}"
                self.files[name] = t
                self.tensors[name] = TensorInfo(tuple(t.shape), t.dtype)

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.files[name].clone()


class DeepSpeedPipeSource(Source):
    """A ``PipelineModule`` checkpoint (``mp_rank_XX`` is the stage) under HF names."""

    def __init__(self, ds_dir: Path, stages: int) -> None:
        self.stages: list[Source] = [DeepSpeedSource(ds_dir, mp_rank=s) for s in range(stages)]
        if not any(src.tensors for src in self.stages):  # ZeRO-0: the layer files only
            self.stages = [_LayerFilesSource(ds_dir)]
        self.where: dict[str, tuple[int, str]] = {}
        self.tensors = {}
        for s, src in enumerate(self.stages):
            for name, info in src.tensors.items():
                hf = pipe_to_hf_name(name)
                if hf in self.where:
                    raise PipelineError(f"{ds_dir}: {hf} is held by two pipeline stages")
                self.where[hf] = (s, name)
                self.tensors[hf] = info

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            s, pipe_name = self.where[name]
            yield from ((name, t) for _, t in self.stages[s].read([pipe_name]))


class DeepSpeedTPSource(Source):
    """An AutoTP checkpoint (``mp_rank_XX`` is the TP rank): each tensor is joined from the
    ranks' shards along the one dimension where a shard differs from the parameter's logical
    shape, which DeepSpeed records per parameter (``universal_checkpoint_info.affine_map``);
    a replicated tensor (embedding, norms) is TP rank 0's."""

    def __init__(self, ds_dir: Path, tp: int) -> None:
        self.ranks = [DeepSpeedSource(ds_dir, mp_rank=r) for r in range(tp)]
        info = self.ranks[0].model_states.get("universal_checkpoint_info") or {}
        logical = (info.get("affine_map") or {}).get("params") or {}
        if info.get("parameter_with_sub_params") or not logical:
            raise PipelineError(
                f"{ds_dir}: the AutoTP checkpoint has no per-parameter logical shapes (or has "
                "fused sub-parameters); convert it with DeepSpeed's ds_to_universal")
        self.join: dict[str, int | None] = {}
        self.tensors = {}
        for name, first in self.ranks[0].tensors.items():
            entry = logical.get(f"^{re.escape(name)}$")
            shards = [r.tensors[name].shape for r in self.ranks]
            full = tuple(entry["logical_shape"]) if entry else first.shape
            self.join[name] = self._join_dim(ds_dir, name, full, shards)
            self.tensors[name] = TensorInfo(full, first.dtype)

    @staticmethod
    def _join_dim(ds_dir: Path, name: str, full: tuple[int, ...],
                  shards: list[tuple[int, ...]]) -> int | None:
        differ = [d for d in range(len(full)) if shards[0][d] != full[d]]
        if not differ and all(s == full for s in shards):
            return None
        if len(differ) == 1:
            d = differ[0]
            if (sum(s[d] for s in shards) == full[d]
                    and all(s[:d] + s[d + 1:] == full[:d] + full[d + 1:] for s in shards)):
                return d
        raise PipelineError(f"{ds_dir}: {name}'s AutoTP shards {shards} do not join into its "
                            f"shape {full}; convert it with DeepSpeed's ds_to_universal")

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            dim = self.join[name]
            if dim is None:
                yield from self.ranks[0].read([name])
            else:
                yield name, torch.cat([t for r in self.ranks for _, t in r.read([name])], dim)


def open_ds_source(ds_dir: Path) -> Source:
    """The model tensors of a DeepSpeed checkpoint folder of any layout: ZeRO data
    parallelism, AutoTP, or a PipelineModule (told apart by the files' own record of their
    ``checkpoint_parallel_dimensions`` and the pipeline's layer files)."""
    first = ds_dir / "mp_rank_00_model_states.pt"
    if not first.is_file():  # ZeRO-3 names its model states per rank; no TP or PP there
        return DeepSpeedSource(ds_dir)
    states = load_ds_file(first)
    dims = states.get("checkpoint_parallel_dimensions") or {}
    mp = states.get("mp_world_size") or 1
    if any(_LAYER_RE.fullmatch(f.name) for f in ds_dir.iterdir()):
        return DeepSpeedPipeSource(ds_dir, int(dims.get("pp_degree") or mp))
    if mp > 1:
        return DeepSpeedTPSource(ds_dir, int(dims.get("tp_degree") or mp))
    return DeepSpeedSource(ds_dir)


def load_deepspeed_model_state(ckpt: Path, zero_stage: int | None = None) -> dict[str, torch.Tensor]:
    """Every fp32 model tensor of a DeepSpeed checkpoint folder (ZeRO 0–3), in memory.

    ``zero_stage`` is accepted for compatibility; the layout is read from the files themselves.
    """
    src = open_ds_source(ckpt / "ds")
    return dict(src.read(list(src.tensors)))


def open_source(ckpt: Path) -> Source:
    """The model tensors of a checkpoint folder of either engine."""
    if (ckpt / "ds").is_dir():
        return open_ds_source(ckpt / "ds")
    if (ckpt / "dcp").is_dir():
        return DCPSource(ckpt / "dcp")
    raise PipelineError(f"{ckpt} holds neither a dcp/ nor a ds/ folder")
