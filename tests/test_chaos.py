"""The reduced chaos test (issue 12): ``bench.chaos`` in CI, fewer faults than the bench.

fsdp gets one fault of every kind (SIGKILL of a rank, SIGKILL during a checkpoint write, the
time-limit warning, the whole launcher tree killed, the newest checkpoint corrupted, the disk
full during a save, a frozen rank); deepspeed the kinds that touch its own checkpoint files and
resume path. Each run's final weights must equal an uninterrupted run's bit for bit, and every
step must have consumed the same sequences (none repeated, none skipped). The faults are real:
signals to real processes, bytes flipped on disk, a full tmpfs.
"""

from __future__ import annotations

import os

import pytest

from bench import chaos

pytestmark = pytest.mark.slow

PLAN = {
    "fsdp": list(chaos.KINDS),
    "deepspeed": ["kill_in_save", "corrupt_newest", "time_limit"],
}


@pytest.mark.parametrize("engine", list(PLAN))
def test_training_survives_injected_faults_bit_identically(engine, capsys):
    kinds = PLAN[engine]
    if "disk_full" in kinds and os.geteuid() != 0:
        kinds = [k for k in kinds if k != "disk_full"]  # mounting the small tmpfs needs root
    res = chaos.run([engine], faults=len(kinds), kinds=kinds, seed=1)[engine]
    out = capsys.readouterr().out
    assert res["injected"] == dict.fromkeys(kinds, 1), out
    assert res["identical"], (res["differing"], out)
    assert (res["repeated"], res["skipped"], res["same_order"]) == (0, 0, True), out
    assert res["attempts"] > len(kinds) - 2  # every fault but the tree kills cost an attempt
    if "freeze_rank" in kinds:
        assert res["hangs"] >= 1  # the watchdog named the frozen rank
