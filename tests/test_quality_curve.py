"""benchmarks/quality_curve.py without the model: the bound it reads (benchmarks/quality_oracle.py's
results.json) is refused by name when it is not one, and its figure plots the curve beside the oracle."""
from __future__ import annotations

import json

import pytest

from benchmarks import quality_curve as qc
from benchmarks import results as R


def _row(kind, setting, skip, **kw):
    return {"kind": kind, "setting": setting, "skip": skip, "top1": 0.9, "top1_se": 0.01, "prefix": 20.0,
            "prefix_se": 1.0, "facts": 0.4, "facts_se": 0.05, **kw}


def test_bound_is_refused_unless_it_is_the_oracles(tmp_path):
    with pytest.raises(SystemExit, match="no results.json of benchmarks.quality_oracle"):
        qc._bound(tmp_path)
    R.write_results("demo", {}, "", tmp_path)
    with pytest.raises(SystemExit, match="is 'demo''s, not benchmarks.quality_oracle's"):
        qc._bound(tmp_path)
    R.write_results("quality-curve-bound", {"rows": [], "sequences": 0}, "", tmp_path)
    assert qc._bound(tmp_path)["name"] == "quality-curve-bound"
    assert qc._bound(None) is None


def test_figure_plots_trained_skippers_baselines_and_the_oracle(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row("base", "-", None), _row("trained", "flexidepth:path=a, threshold 0.3", 0.05),
            _row("trained", "flexidepth:path=a, threshold 0.5", 0.12),
            _row("trained", "flexidepth:path=b, threshold 0.5", 0.2), _row("random", "rate 0.1", 0.1),
            _row("static", "layers [15]", 0.067)]
    bound = [{"kind": "oracle", "skip_generated": g, "top1": 0.95, "top1_se": 0.01, "prefix": 25.0, "prefix_se": 2.0}
             for g in (0.08, 0.16)]
    qc.figure(rows, tmp_path / "curve.png", bound)
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    json.dumps(rows)  # what results.json holds


def test_merge_takes_an_earlier_runs_rows_measured_on_the_same_data(tmp_path):
    import argparse

    args = argparse.Namespace(limit=24, arithmetic=24, facts=80, max_new_tokens=48, arith_tokens=64,
                              influence_prompts=64, quick=False)
    rows = [_row("base", "-", None), _row("trained", "flexidepth:path=a, threshold 0.5", 0.12)]
    R.write_results("quality-curve", {"rows": rows, "args": vars(args)}, "", tmp_path / "a")
    assert qc._merged(tmp_path / "a", args) == rows[1:]  # the base is this run's own
    other = argparse.Namespace(**{**vars(args), "facts": 339})
    with pytest.raises(SystemExit, match=r"measured on other prompts or questions \{'facts': \(80, 339\)\}"):
        qc._merged(tmp_path / "a", other)
    R.write_results("demo", {}, "", tmp_path / "b")
    with pytest.raises(SystemExit, match="not the quality curve's"):
        qc._merged(tmp_path / "b", args)
