"""``train.compile: true``: every decoder layer compiled with ``torch.compile``.

torchtitan's approach (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_compile``):
each transformer block is compiled on its own with ``fullgraph=True``, after tensor parallelism
and activation checkpointing are applied and before FSDP's ``fully_shard``. torchtitan swaps
each block for its ``torch.compile`` wrapper; here the block is compiled in place with
``nn.Module.compile()``, which leaves the module tree unchanged (no ``_orig_mod.`` prefix), so
parameter names, state dicts and checkpoints are those of an eager run: a checkpoint of a
compiled run resumes eagerly and the other way round. The layers are one program, so Dynamo
traces one graph and reuses it for every layer (parameters are graph inputs), and the compiled
code lands in Inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_<user>``): a restarted or requeued job on the same node skips most of the
first compile.

Where it runs (CPU, 2 processes, fp32, 10 steps; losses against the eager run): fsdp with
FULL_SHARD, activation checkpointing, TP 2 and PP 2; ddp with and without checkpointing;
DeepSpeed ZeRO-2, AutoTP and its pipeline engine. Not with DeepSpeed ZeRO-3, whose parameter
gathering is a forward hook on every submodule that Dynamo cannot trace: the config refuses it.
What it needs is checked before the first step, with an error naming ``train.compile``
(:func:`check_toolchain`): Inductor generates C++ on CPU (a C++ compiler must run) and Triton
kernels on GPU.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pipeline.config.schema import RunConfig
from pipeline.errors import PipelineError
from pipeline.model.build import decoder_layers

log = logging.getLogger(__name__)


def check_toolchain(device: torch.device) -> None:
    """Raise a :class:`PipelineError` naming ``train.compile`` when this process cannot compile
    for ``device`` (a missing tool would otherwise surface as a traceback in the first step)."""
    if not torch._dynamo.is_dynamo_supported():
        raise PipelineError(
            "train.compile: torch.compile is not supported on this Python/torch build; set "
            "train.compile: false"
        )
    if device.type == "cpu":
        from torch._inductor import config as inductor_config
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()  # Inductor's own search (runs ``<cxx> --version``)
        except Exception:
            cxx = inductor_config.cpp.cxx
            tried = ", ".join(c for c in (cxx if isinstance(cxx, (list, tuple)) else [cxx]) if c)
            raise PipelineError(
                f"train.compile on CPU needs a C++ compiler: Inductor generates C++ kernels and "
                f"{tried or 'none'} does not run (the CXX environment variable names it); "
                "install one (e.g. apt-get install g++) or set train.compile: false"
            ) from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise PipelineError(
                "train.compile on GPU needs Triton (Inductor's GPU kernels); install the "
                "triton package that matches your torch build, or set train.compile: false"
            )


def compile_decoder_layers(model: Any, run: RunConfig, device: torch.device | None = None,
                           layers: list[torch.nn.Module] | None = None) -> int:
    """Compile each decoder layer of ``model`` in place when ``train.compile`` is on (a no-op
    otherwise); returns how many were compiled.

    ``device``: where the layers will run (default: the trainer's rule, a GPU when one is
    visible and ``cluster.device`` is not cpu; DeepSpeed moves the model itself).
    ``layers``: the layers to compile (a pipeline stage's own); default every decoder layer.
    Call after tensor parallelism and activation checkpointing are applied (so the compiled
    region holds the layer as it will run: DTensor ops, the checkpoint wrapper) and before
    ``fully_shard`` / DDP / ``deepspeed.initialize`` (torchtitan's order)."""
    if not run.train.compile:
        return 0
    if device is None:
        gpu = torch.cuda.is_available() and run.cluster.device != "cpu"
        device = torch.device("cuda" if gpu else "cpu")
    check_toolchain(device)
    todo = decoder_layers(model) if layers is None else layers
    for layer in todo:
        # fullgraph: one graph per layer or a clear error, never a silent fallback to eager.
        layer.compile(fullgraph=True)
    log.info("train.compile: %d decoder layers compiled (torch.compile per layer, fullgraph)",
             len(todo))
    return len(todo)


def compiled_graphs() -> int:
    """Graphs this process compiled so far (Dynamo's count): the proof, after a step, that the
    compiled code ran (the trainer records it per rank in a ``compile`` event)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
