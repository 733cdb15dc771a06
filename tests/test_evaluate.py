"""The evaluate stage's lm-eval pieces that need no trained model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.evaluate import continuation_items, run_lm_eval


class _Tok:
    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def test_continuation_items_point_at_the_true_continuation() -> None:
    seqs = np.arange(10 * 20).reshape(10, 20)  # every sequence distinct
    items = continuation_items(_Tok(), seqs, n=8, context=12, cont=8)
    assert len(items) == 8
    for i, item in enumerate(items):
        assert item["context"] == _Tok().decode(seqs[i][:12].tolist())
        assert item["choices"][item["label"]] == _Tok().decode(seqs[i][12:20].tolist())
        assert len(set(item["choices"])) == 4
    assert len({it["label"] for it in items}) > 1  # the answer's position is shuffled


def test_too_little_held_out_text_gives_no_items() -> None:
    assert continuation_items(_Tok(), np.zeros((3, 100), np.int64)) == []
    assert continuation_items(_Tok(), np.zeros((10, 20), np.int64), context=48, cont=16) == []


def test_without_lm_eval_the_harness_is_skipped_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    got = run_lm_eval(None, None, [], tmp_path / "work")
    assert "not installed" in got["skipped"]
    assert not (tmp_path / "work").exists()


def test_read_metrics_keeps_integer_steps_and_the_plots_only_numbers(tmp_path: Path) -> None:
    from pipeline.evaluate import _final_loss, _series, read_metrics

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 5.0, "lr": 0.1, "tokens_seen": 8, "tokens_per_s": 9}\n'
                 '{"step": "2", "loss": 1.0}\n[1]\n{"step": [3]}\n'
                 '{"step": 4, "loss": null, "lr": "high"}\n{"step": 5, "lo')
    recs = read_metrics(p)
    assert [r["step"] for r in recs] == [1, 4]
    assert _series(recs, "step", "lr") == ([1], [0.1])
    assert _final_loss(recs) == 5.0


def test_report_shows_each_sources_target_and_consumed_share(tmp_path: Path) -> None:
    """The run's train.mixture (config.json) is the target, train.done's tokens_by_source the
    consumed share; a run without either is proportional / not known."""
    import json

    from pipeline.evaluate import _report, run_mixture

    manifest = {"seq_len": 4, "by_source": {"code": {"train": {"tokens": 900}},
                                            "prose": {"train": {"tokens": 100}}}}
    run = tmp_path / "r"
    run.mkdir()
    assert run_mixture(run, manifest) == {"code": {"target": 0.9, "consumed": None},
                                          "prose": {"target": 0.1, "consumed": None}}
    (run / "config.json").write_text(json.dumps({"train": {"mixture": {"code": 1, "prose": 1}}}))
    (run / "train.done").write_text(json.dumps({"tokens_by_source": {"code": 600, "prose": 400}}))
    shares = run_mixture(run, manifest)
    assert shares == {"code": {"target": 0.5, "consumed": 0.6},
                      "prose": {"target": 0.5, "consumed": 0.4}}
    (run / "train.done").write_text(json.dumps({"tokens_by_source": {"code": "many"}}))
    assert run_mixture(run, manifest)["code"]["consumed"] is None  # malformed: not known
    m = {"perplexity": 9.0, "loss": 2.2, "tokens": 10, "vocab_size": 8, "step": 3,
         "final_train_loss": None, "samples": [], "mixture": shares}
    md = _report("r", m, [])
    assert "| code | 50.0 % | 60.0 % |" in md and "| prose | 50.0 % | 40.0 % |" in md
