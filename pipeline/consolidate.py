"""The consolidate stage: a run's last sharded checkpoint → an HF model directory, streaming.

``python -m pipeline.consolidate --run-dir results/runs/NAME --data-dir results/data --out
results/runs/NAME/hf`` reads the checkpoint named in ``train.done`` (verified completely
against its manifest before any file of it is opened), and writes ``config.json``, ``generation_config.json``, safetensors (split into shards with
``model.safetensors.index.json`` above ``--max-shard-size``) and the tokenizer files, so that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it offline.

Streaming: the full model never exists in memory. Tensor names, shapes and dtypes are known
before any weight is read (``pipeline.checkpoint.tensors``), so every safetensors header is
written first and then each tensor is read, converted and appended on its own. Peak memory is
about one fp32 tensor, its converted copy and one source chunk (≤ 2× the largest tensor), plus
a constant (imports, small tensors grouped up to ``checkpoint_tensors.GROUP_BYTES``).

The output folder is built beside ``--out`` and swapped in atomically
(``pipeline.artifacts.replacing_dir``); an existing ``--out`` is replaced only when it holds
``zerosnake.json``, i.e. when this command wrote it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline import artifacts as af
from pipeline.checkpoint import fastio
from pipeline.checkpoint import format as ck
from pipeline.checkpoint.deepspeed import load_deepspeed_model_state, open_source  # noqa: F401
from pipeline.checkpoint.tensors import (  # noqa: F401  (GROUP_BYTES: tests and benchmarks)
    GROUP_BYTES,
    load_dcp_model_state,
)
from pipeline.config.files import load_run_config
from pipeline.errors import PipelineError
from pipeline.io import sha256_file, write_json_atomic
from pipeline.model.build import hf_model_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# --------------------------------------------------------------------------------------------
# safetensors, written incrementally
# --------------------------------------------------------------------------------------------


def parse_size(size: str | int) -> int:
    """``"2GB"`` → 2·10⁹, ``"500MiB"`` → 500·2²⁰, ``1000`` → 1000 (transformers' convention)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", size, re.IGNORECASE)
    if not m:
        raise PipelineError(f"--max-shard-size: {size!r} is not a size such as 2GB or 500MiB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def plan_shards(sizes: dict[str, int], cap: int) -> list[list[str]]:
    """Split tensors (in order) into shards of at most ``cap`` bytes; a bigger one stands alone."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > cap:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _header(names: list[str], shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = math.prod(shapes[name]) * dtypes[name].itemsize
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[dtypes[name]],
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned (safetensors spec)
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(
    out: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    max_shard_size: int,
) -> list[str]:
    """Write ``tensors`` (arriving one at a time, in ``shapes``' order) as HF safetensors shards.

    Headers come from ``shapes``/``dtypes`` up front, so each tensor is written and dropped as
    it arrives. Returns the files written; writes ``model.safetensors.index.json`` when split.
    """
    sizes = {n: math.prod(s) * dtypes[n].itemsize for n, s in shapes.items()}
    shards = plan_shards(sizes, max_shard_size)
    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    it = iter(tensors)
    for fname, names in zip(files, shards, strict=True):
        # O_DIRECT (fastio): a buffered write + fsync of a multi-GB shard spends most of its time
        # in the page cache's copy and writeback, and leaves GBs of dirty pages behind.
        with fastio.ChecksumWriter(out / fname) as f:
            f.write(_header(names, shapes, dtypes))
            for name in names:
                got, t = next(it)
                if got != name or tuple(t.shape) != shapes[name] or t.dtype != dtypes[name]:
                    raise PipelineError(
                        f"internal: expected {name} {shapes[name]} {dtypes[name]}, "
                        f"got {got} {tuple(t.shape)} {t.dtype}"
                    )
                # Raw little-endian bytes, no copy (safetensors stores C-order data).
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
                del t
    if len(files) > 1:
        weight_map = {n: fname for fname, names in zip(files, shards, strict=True) for n in names}
        write_json_atomic(
            out / INDEX_FILE,
            {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
        )
    return files


# --------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------


def _converted(
    tensors: Iterator[tuple[str, torch.Tensor]], dtypes: dict[str, torch.dtype],
    total_bytes: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    from tqdm import tqdm

    # A progress bar by bytes written, at a terminal only (disable=None: off when stderr is
    # not a TTY, so Snakemake's and Slurm's logs stay free of carriage returns).
    with tqdm(total=total_bytes or None, unit="B", unit_scale=True, desc="consolidate",
              disable=None) as bar:
        for name, t in tensors:
            t = t.to(dtypes[name])
            bar.update(t.nbytes)
            yield name, t


def consolidate(
    run_dir: Path, data_dir: Path, out: Path, *, dtype: str = "float32", max_shard_size: str = "2GB"
) -> Path:
    """Write the HF directory for the run's final checkpoint; returns ``out``."""
    if dtype not in DTYPES:
        raise PipelineError(f"--dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    cap = parse_size(max_shard_size)
    # Before any work: never clobber a stranger, nor another run's hf/ (same marker, its run).
    view = af.read_json_or_none(run_dir / af.RUN_CONFIG)
    name = view.get("name") if isinstance(view, dict) else None
    af.check_replaceable(out, af.HF_PROVENANCE,
                         owner={"run": name if isinstance(name, str) else run_dir.name})
    run = load_run_config(run_dir / af.RUN_CONFIG)
    done = af.read_train_done(run_dir)
    name = done.get("checkpoint")
    if not isinstance(name, str) or not af.STEP_RE.match(name):
        raise PipelineError(
            f"{run_dir / af.TRAIN_DONE}: 'checkpoint' is {name!r}, not a checkpoint folder "
            "name; rerun the train rule"
        )
    af.inside(run_dir / af.CHECKPOINTS, name)
    ckpt = run_dir / af.CHECKPOINTS / name  # as named, not resolved: verify refuses a link
    # Verified completely (every file listed, sized and checksummed, nothing unlisted, no
    # links) before any reader opens a file of it: DCP's .metadata and DeepSpeed's *.pt are
    # pickles, so nothing unverified may reach a loader, and what verified still loads only
    # through allow-lists (pipeline.checkpoint.tensors).
    why = ck.verify(ckpt)
    if why is not None:
        raise PipelineError(f"checkpoint {ckpt} does not verify: {why}")
    _check_same_run(ckpt, run_dir, data_dir, run)
    return _consolidate(ckpt, run_dir, data_dir, out, dtype=dtype, cap=cap)


def _check_same_run(ckpt: Path, run_dir: Path, data_dir: Path, run: Any) -> None:
    """The checkpoint was trained by this run, on this data: its manifest's config and data
    hashes are the trainer's for ``run_dir``'s config and ``data_dir``'s manifest (a checkpoint
    copied from another run or another config would consolidate into the wrong model)."""
    meta = af.read_artifact(ckpt / ck.MANIFEST, "checkpoint manifest")
    want = ck.config_hash(run)
    if meta.get("config_hash") != want:
        raise PipelineError(
            f"checkpoint {ckpt} was trained with another config (config hash "
            f"{str(meta.get('config_hash'))[:12]}) than {run_dir / af.RUN_CONFIG} "
            f"({want[:12]}): it belongs to another run; consolidate that run, or move it out of "
            f"{run_dir / af.CHECKPOINTS}"
        )
    data = sha256_file(data_dir / af.DATA_MANIFEST) if (data_dir / af.DATA_MANIFEST).is_file() \
        else None
    if data is not None and meta.get("data_manifest_sha256") != data:
        raise PipelineError(
            f"checkpoint {ckpt} was trained on another tokenized dataset than --data-dir "
            f"{data_dir} (data manifest {str(meta.get('data_manifest_sha256'))[:12]}, here "
            f"{data[:12]}): pass the data directory the run was trained on"
        )


def _expected_tensors(config: Any) -> tuple[dict[str, tuple[int, ...]], set[str], str]:
    """The names and shapes the HF directory must hold (a meta-device model: no memory), the
    names left out because they are tied, and the model class name."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    dropped: set[str] = set()
    if getattr(config, "tie_word_embeddings", False):
        # A tied output head is saved once, under the input embedding's name, as HF does;
        # from_pretrained ties it back. Every other name of that parameter is left out.
        emb = model.get_input_embeddings().weight
        names = [k for k, p in model.named_parameters(remove_duplicate=False) if p is emb]
        dropped = set(names[1:])
        for k in dropped:
            expected.pop(k)
    return expected, dropped, type(model).__name__


def _check_match(ckpt: Path, source: Any, expected: dict[str, tuple[int, ...]],
                 dropped: set[str]) -> None:
    missing = [k for k in expected if k not in source.tensors]
    unexpected = [k for k in source.tensors if k not in expected and k not in dropped]
    wrong = [
        f"{k} {source.tensors[k].shape} (model: {s})"
        for k, s in expected.items()
        if k in source.tensors and source.tensors[k].shape != s
    ]
    if missing or unexpected or wrong:
        raise PipelineError(
            f"checkpoint {ckpt} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )


def _consolidate(ckpt: Path, run_dir: Path, data_dir: Path, out: Path, *, dtype: str, cap: int) -> Path:
    from transformers import GenerationConfig

    meta = af.read_artifact(ckpt / ck.MANIFEST, "checkpoint manifest")
    run = load_run_config(run_dir / af.RUN_CONFIG)
    tok = af.read_data_manifest(data_dir)["tokenizer"]
    # The same HF config the trainer built its model from (from scratch or init_from).
    config = hf_model_config(run.model, vocab_size=tok["vocab_size"], eos_id=tok["eos_id"],
                             bos_id=tok.get("bos_id"))
    expected, dropped, arch = _expected_tensors(config)
    config.architectures = [arch]
    config.use_cache = True  # training turned it off; inference wants it
    config.dtype = DTYPES[dtype]

    try:
        source = open_source(ckpt)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
        # Verified, yet not the layout an engine writes: a foreign or hand-made checkpoint.
        raise PipelineError(f"checkpoint {ckpt}: not a layout this reader knows "
                            f"({type(err).__name__}: {err})") from None
    _check_match(ckpt, source, expected, dropped)
    out_dtypes = {
        k: DTYPES[dtype] if source.tensors[k].dtype.is_floating_point else source.tensors[k].dtype
        for k in expected
    }
    with af.replacing_dir(out, af.HF_PROVENANCE, owner={"run": run.name}) as tmp:
        write_safetensors(
            tmp,
            _converted(source.read(list(expected)), out_dtypes,
                       sum(math.prod(expected[k]) * out_dtypes[k].itemsize for k in expected)),
            expected, out_dtypes, cap,
        )
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tok_dir = af.inside(data_dir, tok["path"])
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copy2(tok_dir / name, tmp / name)
        # The provenance file is also the marker that lets a rerun replace this folder.
        write_json_atomic(
            tmp / af.HF_PROVENANCE,
            {"run": run.name, "step": meta["step"], "checkpoint": ckpt.name,
             "checkpoint_manifest_sha256": sha256_file(ckpt / ck.MANIFEST), "dtype": dtype,
             "config_hash": meta.get("config_hash"),
             "data_manifest_sha256": meta.get("data_manifest_sha256")},
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.consolidate",
        description="Sharded training checkpoint → HF model directory (safetensors), streaming.",
    )
    p.add_argument("--run-dir", type=Path, required=True, help="results/runs/<run>")
    p.add_argument("--data-dir", type=Path, required=True, help="results/data (tokenizer)")
    p.add_argument("--out", type=Path, required=True, help="output HF directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--max-shard-size", default="2GB", help="split safetensors above this size (2GB, 500MiB, bytes)"
    )
    args = p.parse_args(argv)
    try:
        out = consolidate(
            args.run_dir, args.data_dir, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size
        )
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return af.EXIT_USAGE
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
