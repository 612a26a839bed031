"""The decode table's context axis (resident K/V tokens per row): interpolation, V* read off it, the
chooser reading a step's resident K/V, calibrate's grid and flags, and the startup line's V*."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch

import vskipper
from vskipper import cost
from vskipper.calibrate import break_even_line, context_grid, format_tokens

from tiny import tiny_llama, transformed

A = 1 / 1024  # per row, a K/V token costs A of a row's weight work
TAU = 4.0  # the routed body's fixed cost per step (ms)


def dense_ms(T, c):
    return T * (1 + A * c)


def routed_ms(T, f, c):
    return TAU + T * (0.2 + f * (1 + A * c))  # RUN rows pay what dense rows do; skipped rows 0.2 of a row


def vstar(T, f):
    """Resident K/V from which routed_ms <= dense_ms: TAU + 0.2 T <= (1 - f) T (1 + A c)."""
    return T * ((TAU + 0.2 * T) / ((1 - f) * T) - 1) / A


def context_table(contexts=(256, 1024, 4096), ts=(2, 4, 8, 16, 64), fs=(0.0, 0.5, 1.0), hidden=40, intermediate=72,
                  phase="decode"):
    """A decode table whose cost is affine in the context (as a step's K/V reads are): every cell exact."""
    def tables(c):
        return (tuple(tuple(dense_ms(T, c) for _ in fs) for T in ts),
                tuple(tuple(routed_ms(T, f, c) for f in fs) for T in ts),
                tuple(tuple(routed_ms(T, f, c) + 1.0 for f in fs) for T in ts))

    d, r, rm = tables(contexts[0])
    more = tuple(cost.ContextTable(c, ts, fs, *tables(c)) for c in contexts[1:])
    return cost.Calibration(cost.device_name("cpu"), cost.versions(), hidden, intermediate, ts, fs, d, r,
                            routed_mlp=rm, phase=phase, context=contexts[0], by_context=more)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VSKIPPER_CACHE", str(tmp_path / "cache"))
    cost._warned.clear()


def test_prediction_is_linear_in_the_context_and_never_falls_past_the_last():
    cal = context_table()
    assert cal.contexts == (256, 1024, 4096)
    for c in (256, 700, 1024, 3000, 4096, 20000):  # exact where the cost is affine in c, past the last too
        assert cal.predict("dense", 8, 0.5, c) == pytest.approx(dense_ms(8, c))
        assert cal.predict("routed", 8, 0.5, c) == pytest.approx(routed_ms(8, 0.5, c))
    assert cal.predict("routed", 8, 0.5, 10) == cal.predict("routed", 8, 0.5, 256)  # below the first: the first's
    assert cal.predict("routed", 8, 0.5) == cal.predict("routed", 8, 0.5, 256)  # unknown: the first context's
    # a noisy table whose last context came out cheaper than the one before: past it, flat, never falling
    last = cal.by_context[-1]
    cheaper = dataclasses.replace(last, dense=tuple(tuple(x / 4 for x in row) for row in last.dense))
    noisy = dataclasses.replace(cal, by_context=(cal.by_context[0], cheaper))
    assert noisy.predict("dense", 8, 0.5, 50000) == pytest.approx(noisy.predict("dense", 8, 0.5, 4096))
    assert noisy.predict("dense", 8, 0.5, 2048) < noisy.predict("dense", 8, 0.5, 1024)  # (inside: as measured)


def test_contexts_must_increase():
    cal = context_table()
    with pytest.raises(ValueError, match=r"contexts \[256, 4096, 1024\] must increase"):
        cost.Calibration(cal.device, cal.versions, 40, 72, cal.ts, cal.fs, cal.dense, cal.routed, context=256,
                         by_context=(cal.by_context[1], cal.by_context[0]))


def test_break_even_is_read_off_the_context_axis():
    cal = context_table()
    for T in (4, 8):
        assert cal.break_even(T, 0.5) == pytest.approx(vstar(T, 0.5), rel=1e-6)
        assert cal.choose(T, 0.5, context=0.9 * vstar(T, 0.5) / T) == "dense"
        assert cal.choose(T, 0.5, context=1.1 * vstar(T, 0.5) / T) == "routed"
    assert vstar(16, 0.5) < 0 and cal.break_even(16, 0.5) == 0.0  # pays at every context (the fixed cost spread)
    assert cal.break_even(8, 1.0) == math.inf  # every row runs: routing never pays
    one = cost.Calibration(cal.device, cal.versions, 40, 72, cal.ts, cal.fs, cal.dense, cal.routed, context=256)
    assert one.break_even(8, 0.5) is None  # one context: no axis to read it from
    assert format_tokens(0.0, 512, 1 << 20) == "<=512" and format_tokens(math.inf, 512, 1 << 20) == ">1.0M"
    assert format_tokens(5734.4, 512, 1 << 20) == "6k" and format_tokens(None, 1, 2) == "?"
    line = break_even_line(cal, 0.5, [4, 64])
    assert "at RUN fraction 0.5" in line and "4:6k" in line and "64:<=16k" in line, line
    assert "not measured" in break_even_line(one, 0.5) and "vskipper calibrate" in break_even_line(one, 0.5)


def test_the_context_axis_survives_the_cache_and_an_old_table_is_refused_by_name():
    cal = context_table()
    path = cost.save(cal)
    assert cost.load("cpu", 40, 72) == cal
    entries = json.loads(path.read_text())
    assert [t["context"] for t in entries[0]["by_context"]] == [1024, 4096]
    old = {k: v for k, v in entries[0].items() if k not in ("context", "by_context")}
    old["versions"] = {**old["versions"], "method": "6"}  # made before the context axis
    path.write_text(json.dumps([old]))
    with pytest.warns(UserWarning, match=r"ignoring a stale cost calibration .*method '6'.*run `vskipper calibrate`"):
        assert cost.load("cpu", 40, 72) is None


def test_the_chooser_prices_a_decode_step_at_its_resident_kv():
    cal = context_table()
    chooser = cost.Chooser(cal, expected=0.5, bodies=("dense", "routed"))
    assert chooser.reads_context
    v = vstar(8, 0.5)
    assert chooser.choose(8, 4, resident=int(0.8 * v)) == "dense"  # 4 of 8 rows RUN: f = 0.5
    assert chooser.choose(8, 4, resident=int(1.25 * v)) == "routed"
    assert chooser.choose(8, 4, resident=int(0.8 * v), decode=False) == "dense"  # prefill: no context, dense wins
    assert chooser.choose(8, 4) == "dense"  # unknown: the smallest context, below V*
    one = cost.Chooser(cost.Calibration(cal.device, cal.versions, 40, 72, cal.ts, cal.fs, cal.dense, cal.routed))
    assert not one.reads_context and one.choose(8, 4, resident=10 * int(v)) == one.choose(8, 4)


def test_auto_reads_the_resident_kv_of_decode_steps_only(monkeypatch):
    """AutoBody asks the attention part for the step's resident K/V at decode (host-side), and its body
    follows it; prefill steps are not asked."""
    from vskipper.engines.hf import HFAttention

    cost.save(context_table(contexts=(16, 256, 1024, 4096)))
    m = transformed(tiny_llama(), vskipper.RandomSkip(0.5, [2], seed=3), "auto")
    body = m.vskipper.bodies[2]
    asked, resident = [], {"v": 0}
    monkeypatch.setattr(HFAttention, "resident_tokens", lambda self, x, ctx: asked.append(x.shape) or resident["v"])
    ids = torch.randint(1, 100, (8, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(torch.randint(1, 100, (8, 5)))  # prefill of 8 prompts
        assert asked == []
        vskipper.stats(m, reset=True)
        m(ids)  # one token per sequence: a decode step (RandomSkip decides from ids and positions alone)
        st = vskipper.stats(m, reset=True)[2]
        f = st["run"] / st["tokens"]
        assert st["tokens"] == 8 and vstar(8, f) > 0, st  # a fraction at which the context decides
        for scale, want in ((0.5, "dense"), (2.0, "routed")):
            resident["v"] = int(scale * vstar(8, f))
            before = dict(body.chosen)
            body.chooser.current.clear()
            m(ids)
            assert [k for k in body.chosen if body.chosen[k] != before[k]] == [want], (scale, f, body.chosen)
    assert asked and all(s[1] == 1 for s in asked)
    assert "resident K/V" in body.describe()


def test_context_grid_caps_resident_kv_and_drops_thin_contexts():
    grid = context_grid(cost.GRID_T, (256, 1024, 4096, 16384), "cpu")  # 64k resident on a CPU
    assert grid[0] == (256, cost.GRID_T, cost.GRID_F)
    assert grid[1] == (1024, (1, 4, 16, 64), cost.CONTEXT_F) and grid[2] == (4096, (1, 4, 16), cost.CONTEXT_F)
    assert grid[3] == (16384, (1, 4), cost.CONTEXT_F)
    assert [c for c, *_ in context_grid(cost.GRID_T, (256, 16384), "cpu", max_resident=16384)] == [256]  # (1,) only
    assert [c for c, *_ in context_grid((1, 64), (4096, 256), "cuda")] == [256, 4096]  # sorted
    with pytest.raises(ValueError, match="integers >= 1"):
        context_grid(cost.GRID_T, (0, 256), "cpu")


def test_calibrate_flags_reach_the_measurement_and_it_prints_v_star(monkeypatch, capsys):
    from vskipper import calibrate

    seen = []
    monkeypatch.setattr(calibrate, "measure", lambda *a, phase, **k: (seen.append((phase, k["contexts"],
                                                                                  k["max_resident"])),
                                                                     (context_table(phase=phase), None))[1])
    calibrate.main(["--shape", "40,72", "--contexts", "512", "2048", "--max-resident", "4096",
                    "--run-fraction", "0.25"])
    assert seen == [("decode", [512, 2048], 4096), ("prefill", None, 4096)]
    out = capsys.readouterr().out
    assert "V* (resident K/V tokens from which routed costs no more than dense, at RUN fraction 0.25" in out, out
    for argv, msg in ((["--contexts", "0"], "--contexts"), (["--max-resident", "0"], "--max-resident"),
                      (["--run-fraction", "2"], "--run-fraction")):
        with pytest.raises(SystemExit):
            calibrate.main(["--shape", "40,72", *argv])
        assert msg in capsys.readouterr().err


def test_the_startup_line_reports_v_star_for_the_batch_sizes_in_the_table():
    from vskipper import first_start

    cal = context_table()
    line = first_start.bodies_line(cal, context_table(contexts=(0,), phase="prefill"), 0.5, 16)
    assert "at 256 resident K/V tokens per row" in line and "V* (resident K/V tokens" in line, line
    assert "2:" in line and "16:" in line and "64:" not in line, line  # the table's sizes up to the server's batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = cost.Calibration(cal.device, cal.versions, 40, 72, cal.ts, cal.fs, cal.dense, cal.routed)
        assert "V*: not measured" in first_start.bodies_line(one, one, 0.5, 16)
