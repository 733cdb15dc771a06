"""Which device a rank trains on (pipeline.train.trainer.select_device). There is no GPU on the
CI machine, so CUDA's answers are stood in for (a fault that cannot be caused here for real):
torch.cuda.is_available / device_count / set_device."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from pipeline.cluster.env import RankEnv
from pipeline.errors import PipelineError
from pipeline.train.trainer import select_device


def _rank(local_rank: int, local_world: int) -> RankEnv:
    return RankEnv.from_env({"RANK": str(local_rank), "WORLD_SIZE": str(local_world),
                             "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world)})


@pytest.fixture
def gpus(monkeypatch):
    chosen: list[int] = []

    def visible(n: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen

    return visible


def run(device: str) -> SimpleNamespace:
    return SimpleNamespace(cluster=SimpleNamespace(device=device))


def test_auto_uses_the_gpus_when_each_process_has_one(gpus):
    chosen = gpus(2)
    assert select_device(run("auto"), _rank(1, 2)) == torch.device("cuda", 1)
    assert chosen == [1]


def test_auto_with_fewer_gpus_than_processes_trains_on_the_cpu(gpus, caplog):
    # The default config's two processes on a one-GPU workstation: rank 1 has no GPU of its
    # own (cuda:1 would not exist), so the run stays on the CPU and says why.
    chosen = gpus(1)
    with caplog.at_level(logging.WARNING, logger="pipeline.train"):
        assert select_device(run("auto"), _rank(1, 2)) == torch.device("cpu")
    assert chosen == [] and "gpus_per_node: 1" in caplog.text


def test_cuda_with_too_few_gpus_names_the_key(gpus):
    gpus(1)
    with pytest.raises(PipelineError, match=r"cluster.gpus_per_node.*1 GPU\(s\) are visible"):
        select_device(run("cuda"), _rank(0, 2))
    gpus(0)
    with pytest.raises(PipelineError, match="CUDA_VISIBLE_DEVICES"):
        select_device(run("cuda"), _rank(0, 1))


def test_cpu_and_no_gpu(gpus):
    gpus(4)
    assert select_device(run("cpu"), _rank(0, 2)) == torch.device("cpu")
    gpus(0)
    assert select_device(run("auto"), _rank(0, 2)) == torch.device("cpu")
