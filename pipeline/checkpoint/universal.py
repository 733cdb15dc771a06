"""DeepSpeed on another world size: its universal checkpoint, converted once, beside the step.

ZeRO partitions do not reshard on load; DeepSpeed's answer is the *universal* checkpoint (one
folder per parameter with its fp32 weights and optimizer moments), which loads into any world
size. When a DeepSpeed run resumes with another number of processes, rank 0 converts the
chosen checkpoint ``checkpoints/step-N`` into ``checkpoints/step-N.universal`` (a sibling: the
verified step folder is never written into), records the checksum of every file it wrote in
its own manifest, and renames it into place; the ranks then load it with DeepSpeed's
``load_universal``. A later resume from the same step reuses the conversion after verifying it.

Untrusted bytes: DeepSpeed's converter and its universal loader call ``torch.load(...,
weights_only=False)``. The step folder was verified (manifest checksums) and its ``*.pt`` files
checked against DeepSpeed's allow-list before conversion; the conversion itself runs in a
subprocess whose ``torch.load`` is :func:`safe_torch_load`'s (``weights_only=True`` with
DeepSpeed's classes allowed), and the engine's universal load runs under the same patch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.artifacts import CKPT_MANIFEST, UNIVERSAL_SUFFIX, fsync_dir
from pipeline.errors import PipelineError
from pipeline.io import read_json, sha256_file, write_json_atomic

#: Inside the conversion: the folder DeepSpeed's loader reads (its "tag").
TAG = "universal"
#: DeepSpeed's converter writes these objects into the files it produces and reads back.
_CONVERTER_GLOBALS = (
    "deepspeed.checkpoint.constants",
    "deepspeed.checkpoint.ds_to_universal.SubparamShape",
)


def universal_dir(step_dir: Path) -> Path:
    """Where the universal conversion of ``step_dir`` lives."""
    return step_dir.with_name(step_dir.name + UNIVERSAL_SUFFIX)


def _file_digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p)
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != CKPT_MANIFEST}


def verify(out: Path) -> bool:
    """A conversion is usable when its manifest lists exactly its files with their checksums."""
    try:
        meta = read_json(out / CKPT_MANIFEST)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("files") == _file_digests(out)


def ensure_universal(step_dir: Path) -> Path:
    """Rank 0: the verified universal conversion of ``step_dir`` (converted now if missing or
    not verified). Raises :class:`PipelineError` naming the folder when conversion fails."""
    from pipeline.checkpoint.tensors import check_ds_files

    out = universal_dir(step_dir)
    if out.is_dir():
        if verify(out):
            return out
        shutil.rmtree(out)  # ours (the suffix), and unverifiable: convert again
    check_ds_files(step_dir / "ds")
    tmp = step_dir.with_name(f".tmp-{out.name}")
    if tmp.exists():
        shutil.rmtree(tmp)  # a conversion of ours that was killed half way
    tmp.mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "pipeline.checkpoint.universal", str(step_dir / "ds"),
         str(tmp / TAG)],
        capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR":
                                             os.environ.get("DS_ACCELERATOR", "cpu")})
    if res.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PipelineError(
            f"converting {step_dir} to DeepSpeed's universal checkpoint (to resume on another "
            f"number of processes) failed:\n{res.stderr[-2000:]}\nresume on the original number "
            "of processes, or remove the run's checkpoints to start over"
        )
    write_json_atomic(tmp / CKPT_MANIFEST, {"source": step_dir.name, "files": _file_digests(tmp)})
    fsync_dir(tmp)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return out


@contextlib.contextmanager
def safe_torch_load() -> Iterator[None]:
    """``torch.load`` as ``weights_only=True`` with DeepSpeed's checkpoint classes allowed, for
    code (DeepSpeed's converter and universal loader) that asks for ``weights_only=False``."""
    import importlib

    import torch

    from pipeline.checkpoint.tensors import DS_GLOBALS, _unsafe_globals

    original = torch.load
    allowed = DS_GLOBALS + _CONVERTER_GLOBALS

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        classes = []
        if isinstance(f, (str, os.PathLike)):
            for g in _unsafe_globals(Path(f)):
                if not any(g == a or g.startswith(a + ".") for a in allowed):
                    raise PipelineError(f"{f} pickles objects outside DeepSpeed's allow-list: {g}")
                module, _, name = g.rpartition(".")
                classes.append(getattr(importlib.import_module(module), name))
        with torch.serialization.safe_globals(classes):
            return original(f, *args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def _convert(src: str, dst: str) -> None:
    """DeepSpeed's ``ds_to_universal`` (HF models need ``--inject_missing_state``), in this
    process, with :func:`safe_torch_load`; one worker each so the patch covers everything."""
    from deepspeed.checkpoint import ds_to_universal

    sys.argv = ["ds_to_universal", "--input_folder", src, "--output_folder", dst,
                "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    with safe_torch_load():
        ds_to_universal.main(ds_to_universal.parse_arguments())


if __name__ == "__main__":
    _convert(sys.argv[1], sys.argv[2])
